"""`kvroute bench live`: the same workload through several routers in front of one fleet (run.py)."""
