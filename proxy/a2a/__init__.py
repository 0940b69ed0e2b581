"""A2A (Agent2Agent) traffic over the JSON-RPC binding: sends checked as steps matched by skill."""
