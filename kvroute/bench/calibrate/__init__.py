"""`kvroute bench calibrate`: a real engine measured, and the simulator's engine profile fitted to it."""
