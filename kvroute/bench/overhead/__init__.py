"""`kvroute bench overhead`: what the router itself costs per request (run.py)."""
