"""Scoring: how a policy ranks the instances that may serve a request.

The extension points are named in scorers/plugins.py; the registry (scorers/registry.py) maps a YAML `type`
to a plugin; a policy (scorers/policy.py) weighs its scorers and lets its picker choose. Each built-in scorer
is one module here. Nothing in this package imports the router: what a scorer reads of a request and of an
instance is defined here (scorers/request.py, scorers/candidate.py), and the router hands it over.
"""
