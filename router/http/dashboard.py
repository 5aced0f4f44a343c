"""A read-only live dashboard: GET /dashboard, one self-contained page that polls GET /dashboard/state.

The page holds no data and is open. The state holds the A/B report, which /admin guards: with an admin token
configured, it needs that token as /admin does (the page asks for it, or takes it from /dashboard#token=...);
without one, it is open. Instance URLs are left out, so the page does not tell strangers where the engines
listen.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import HTMLResponse, JSONResponse

from router.http.admin import check_admin_token
from router.index.block_index import BlockIndex, Tier
from router.runtime import Runtime
from router.upstreams.instances import Instance, Upstreams

# The page loads nothing from elsewhere; the policy makes the browser hold it to that.
_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
    "cache-control": "no-store",
}


def dashboard_routes(
    fleet: Upstreams, index: BlockIndex, runtime: Runtime, token: Callable[[], str | None]
) -> APIRouter:
    """token: the current admin token, as for admin_routes."""
    page = resources.files("router").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    routes = APIRouter(prefix="/dashboard")

    def authorized(request: Request) -> None:
        expected = token()
        if expected is not None:
            check_admin_token(request, expected)

    @routes.get("")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers=_HEADERS)

    @routes.get("/state", dependencies=[Depends(authorized)])
    async def state() -> JSONResponse:
        table = runtime.table
        body = {
            "instances": instances_state(fleet, index),
            "index": {
                "entries": index.entries,
                "max_entries": index.max_entries,
                "bytes": index.footprint_bytes(),
                "pool_entries": index.pool_entries,
            },
            "ab": await table.ab.report_off_loop(table.split.weights),
        }
        return JSONResponse(body, headers={"cache-control": "no-store"})

    return routes


def instances_state(fleet: Upstreams, index: BlockIndex) -> list[dict[str, Any]]:
    """Each instance as the router sees it, with the blocks the index holds for it by tier (ranks added)."""
    blocks: dict[str, list[int]] = {i.name: [0] * len(Tier) for i in fleet.instances}
    for (name, _), sizes in index.entries_by_owner().items():
        totals = blocks.setdefault(name, [0] * len(Tier))
        for tier, size in zip(Tier, sizes, strict=True):
            totals[tier] += size
    return [_instance(i, blocks[i.name]) for i in fleet.instances]


def _instance(instance: Instance, blocks: list[int]) -> dict[str, Any]:
    load = instance.load
    return {
        "name": instance.name,
        "healthy": instance.healthy,
        "in_flight": instance.in_flight,
        "active_tokens": instance.active_tokens,
        "kv_capacity_tokens": instance.kv_capacity_tokens,
        "pending_prefill_tokens": instance.pending_prefill_tokens,
        "load": None
        if load is None
        else {"waiting": load.waiting, "running": load.running, "kv_usage": load.kv_usage},
        "blocks": {tier.name.lower(): blocks[tier] for tier in Tier},
        "ttft_rates": instance.ttft_model.rates,
        "ttft_slowdown": instance.ttft_model.slowdown,
    }
