"""The `upstream`, `load`, `health` and `circuit_breaker` sections: how the instances are reached."""

from __future__ import annotations

from pydantic import Field

from router.settings_base import Strict


class UpstreamConfig(Strict):
    connect_timeout_s: float = Field(default=5.0, gt=0, description="to open a connection to an instance")
    first_byte_timeout_s: float = Field(
        default=600.0, gt=0, description="streams: to the first chunk (prefill is slow, queues are long)"
    )
    stream_idle_timeout_s: float = Field(
        default=60.0, gt=0, description="streams: between chunks once the first one has arrived"
    )
    response_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="non-streamed requests: the longest from sending one to its answer's last byte (a whole "
        "answer arrives at the end of the generation)",
    )
    max_connections_per_instance: int = Field(
        default=1024, ge=1, description="one per request in flight there: it caps those too"
    )
    api_key_env: str | None = Field(
        default=None,
        min_length=1,
        description="environment variable with the key the instances require (vLLM --api-key), sent to "
        "them as Authorization: Bearer; clients' own keys never reach them",
    )
    attempts: int = Field(
        default=2, ge=1, description="instances tried when one refuses the connection or drops the request"
    )


class LoadConfig(Strict):
    scrape_interval_s: float = Field(default=0.2, gt=0, description="GET /metrics on every instance")
    timeout_s: float = Field(default=0.5, gt=0, description="one slow instance must not age the others' load")
    stale_after_s: float = Field(default=1.0, gt=0, description="older engine load is ignored")
    # One read of vLLM's ~56 KB /metrics cost the router 0.34 ms of CPU here, so every 0.2 s each engine
    # takes 0.17% of a core: a fleet of 600 would take a core, one of 2,000 more than the router has.
    max_scrapes_per_s: float = Field(
        default=200.0,
        gt=0,
        description="engines' /metrics read a second at most: a larger fleet is read a share each "
        "scrape_interval_s, in turn, and its loads go stale that many intervals later",
    )


class HealthConfig(Strict):
    interval_s: float = Field(default=2.0, gt=0, description="between two checks of an instance's /health")
    timeout_s: float = Field(default=1.0, gt=0, description="for one check's answer")
    unhealthy_after: int = Field(default=2, ge=1, description="consecutive failed checks")
    # A check cost the router 0.17 ms of CPU here: 2,000 instances every 2 s took a sixth of a core.
    max_checks_per_s: float = Field(
        default=200.0,
        gt=0,
        description="checks a second at most: past it the longest due go first and a large fleet's checks "
        "come less often than interval_s (requests that cannot reach an instance still mark it down at once)",
    )


class CircuitBreakerConfig(Strict):
    failures: int = Field(
        default=5, ge=1, description="consecutive connection errors, timeouts or 5xx that open the breaker"
    )
    open_s: float = Field(default=10.0, gt=0, description="no requests for this long, then one probe")
