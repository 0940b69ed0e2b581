"""Tooling: `stepguard bench proxy` and `stepguard bench drift`, their upstreams and harness."""
