"""`kvroute demo`: a local fleet, the router, and an agentic workload driven through every policy (run.py)."""
