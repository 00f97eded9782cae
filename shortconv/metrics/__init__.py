"""Metrics: definitions, the per-step recorder and the Prometheus sinks."""
