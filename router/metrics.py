"""The router's Prometheus metrics, all prefixed kvroute_, with low-cardinality labels."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created series double the output and no dashboard reads them

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Proxied requests by policy, instance and HTTP status",
            ["policy", "instance", "status"],
            registry=r,
        )
        self.rejected = Counter(
            "kvroute_rejected_requests",
            "Requests answered by the router itself with an error",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_time_to_first_byte_seconds",
            "Time from routing to the upstream's first response byte (TTFT for streams)",
            ["policy"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvroute_request_duration_seconds",
            "End-to-end time of proxied requests",
            ["policy"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            "kvroute_routing_decision_seconds",
            "Time to choose an instance",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvroute_upstream_errors",
            "Failures reaching an instance, by kind",
            ["instance", "kind"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvroute_instance_in_flight", "Requests in flight through this router", ["instance"], registry=r
        )
        self.healthy = Gauge(
            "kvroute_instance_healthy", "1 when the instance passes health checks", ["instance"], registry=r
        )
        self.task_failures = Counter(
            "kvroute_background_task_failures", "Failed iterations of background tasks", ["task"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
