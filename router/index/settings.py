"""The `index` and `pool` sections: what the KV index keeps and how pool blocks are confirmed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from router.settings_base import Strict, checked_http_url

TierName = Literal["gpu", "cpu", "pool"]


def _default_medium_tiers() -> dict[str, TierName]:
    return {"GPU": "gpu", "CPU": "cpu", "STORAGE": "cpu", "cpu": "pool"}


class IndexConfig(Strict):
    max_entries: int = Field(
        default=10_000_000,
        ge=1,
        description="(instance, block) entries kept at most: about 60 bytes each, a burst of events over",
    )
    speculative_ttl_s: float = Field(
        default=2.0,
        ge=0,
        description="how long a routed request's blocks count before their events arrive (none of a request "
        "that loads part of its prompt from CPU or the pool: one admitted meanwhile loads its own copy)",
    )
    medium_tiers: dict[str, TierName] = Field(
        default_factory=_default_medium_tiers,
        description="tier of a KV event's medium: vLLM's own are GPU, CPU and STORAGE; the "
        "MooncakeStoreConnector's pool writes say cpu; events without a medium are gpu, unknown ones cpu",
    )


class PoolConfig(Strict):
    master_url: str | None = Field(
        default=None,
        description="the Mooncake master's admin HTTP (its --metrics_port), e.g. http://127.0.0.1:9003; "
        "unset: pool blocks from KV events are credited unconfirmed",
    )
    confirm_ttl_s: float = Field(default=2.0, ge=0, description="how long the master's yes is trusted")
    timeout_s: float = Field(default=0.2, gt=0, description="a slower master means no pool credit")

    @field_validator("master_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        return None if url is None else checked_http_url(url)
