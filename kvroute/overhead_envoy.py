"""The old name of kvroute/bench/overhead/envoy.py, kept only for tests/router/epp/ (conftest.py and
test_gateway_failures.py import it from here): once they import kvroute.bench.overhead.envoy, delete this."""

from kvroute.bench.overhead.envoy import connection_manager, envoy_bootstrap, find_envoy, routing_filter

__all__ = ["connection_manager", "envoy_bootstrap", "find_envoy", "routing_filter"]
