"""Observability: structured logs and Prometheus metrics. They observe verdicts; never decide."""
