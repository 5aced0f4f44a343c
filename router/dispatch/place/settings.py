"""The `disaggregation` section: models served in a prefill leg and a decode leg (router/dispatch/place/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from router.settings_base import Strict

KVConnector = Literal["nixl", "mooncake"]


class DisaggregationConfig(Strict):
    """Models served in a prefill leg and a decode leg (router/dispatch/place/prefill_leg.py)."""

    connector: KVConnector = Field(
        default="nixl",
        description="the prefill-to-decode connector the instances run (inside a MultiConnector or not): "
        "nixl (NixlConnector: the prefill answer carries what the decode leg needs) or mooncake "
        "(MooncakeConnector: the router names the transfer, the prefill instance's kv_engine_id and "
        "kv_bootstrap_url)",
    )
    local_prefill_max_tokens: int = Field(
        default=256,
        ge=0,
        description="a decode instance computes up to this many uncached prompt tokens itself (what it holds "
        "locally or in the pool covers the rest): the prefill leg is skipped",
    )
