"""The shared call core every traffic kind builds on: the call loop, boundaries, run keys and
joining, holds and waiting, routing, bodies, SSE, the upstream client and forwarding, problems,
refusals, escalation and the settings. It imports no traffic kind."""
