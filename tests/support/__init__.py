"""What many tests share: helpers only, no tests (the fleet and router processes are kvroute/processes.py's)."""
