"""The targets each part of `kvroute bench overhead` measures unless told otherwise."""

from __future__ import annotations

GRID_TARGETS = ("direct", "kvroute", "kvroute:round-robin", "python-proxy", "vllm-router:round_robin")
LONG_TARGETS = ("direct", "kvroute", "vllm-router:round_robin", "vllm-router:kv_aware")
STREAM_TARGETS = ("direct", "vllm-router:round_robin", "kvroute", "kvroute-workers:2", "envoy-epp")
