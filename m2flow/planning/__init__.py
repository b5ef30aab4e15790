"""Choosing the execution plan before a flow runs: the profilers (`profile.py`, `profile_embodied.py`) time each
component with the real workers, and auto mode (`auto.py`) searches the plans a flow can run and picks the fastest
predicted. Above the workers and the scheduler, beside the flows: it imports no flow, and no flow imports it
(docs/architecture.md)."""
