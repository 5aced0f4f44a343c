"""The `traffic` and `admission` sections: which policy routes a request, and how many the router takes in
(router/dispatch/intake/; the per-instance limits are applied where room is, router/upstreams/room.py, and
the memory hold in router/dispatch/wait/memory_gate.py)."""

from __future__ import annotations

from pydantic import Field, field_validator

from router.settings_base import Strict
from router.traffic_split import TrafficSplit


class TrafficConfig(Strict):
    split: dict[str, float] | None = Field(
        default=None,
        description="policy -> weight (>= 0): each session goes to one policy, by weight; "
        "default: everything to default_policy",
    )
    session_header: str = Field(
        default="x-session-id", min_length=1, description="the session key; else the body's `user`"
    )
    force_header: str = Field(
        default="x-kvroute-policy", min_length=1, description="names the policy for one request"
    )

    @field_validator("split")
    @classmethod
    def _weights(cls, split: dict[str, float] | None) -> dict[str, float] | None:
        if split is not None:
            TrafficSplit(split)  # the split's own checks, the same as PUT /admin/traffic gets
        return split


class AdmissionConfig(Strict):
    max_in_flight: int = Field(default=4096, ge=1, description="requests in the router at once")
    max_in_flight_per_instance: int = Field(
        default=1024, ge=1, description="requests at one instance at once; a full instance is not a candidate"
    )
    max_waiting_per_instance: int | None = Field(
        default=None,
        ge=1,
        description="the engines' waiting-queue limit, where they refuse (503) past it (a gateway's or an "
        "engine's queue cap; vLLM itself queues without one): an instance whose queue is near it is not a "
        "candidate while another has room. null: no limit",
    )
    queue_size: int = Field(default=1024, ge=0, description="requests waiting for a slot; past it: 429")
    queue_timeout_s: float = Field(default=10.0, gt=0, description="longest wait for a slot; past it: 429")
    memory_hold_s: float = Field(
        default=0.0,
        ge=0,
        description="a request no instance has KV memory for waits in the router up to this long, then goes "
        "where memory frees first (router/dispatch/wait/memory_gate.py); 0: off",
    )
