"""The Gateway API Inference Extension's endpoint picker: kvroute's routing for a gateway that proxies."""
