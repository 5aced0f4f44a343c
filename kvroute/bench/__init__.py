"""`kvroute bench`'s measurements of the real code: the index (index.py), live routers in front of one fleet
(live/) and what the router itself costs per request (overhead/). `kvroute bench simulate` is
kvroute/simulate/."""
