"""Executors and tensor-parallel workers (Ray actors for tp_size > 1)."""
