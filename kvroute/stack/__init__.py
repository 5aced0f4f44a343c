"""The real stack on one machine (run.py), `kvroute stack up|down|status`, and its configuration
(config.py)."""
