"""Scheduling: the engine loop, scheduler, requests, step plans and outputs."""
