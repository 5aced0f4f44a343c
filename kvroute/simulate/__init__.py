"""A discrete-event simulation of a vLLM fleet behind kvroute's real index, scorers and pickers."""
