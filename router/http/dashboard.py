"""A read-only live dashboard: GET /dashboard, one self-contained page that polls GET /dashboard/state.

The page holds no data and is open. The state holds the A/B report, which /admin guards: with an admin token
configured, it needs that token as /admin does (the page asks for it, or takes it from /dashboard#token=...);
without one, it is open. Instance URLs are left out, so the page does not tell strangers where the engines
listen. Flow control's queue and refusals are this router process's (under `kvroute serve --workers N`, the
worker that answered). Alarms (what /health lists as warnings, such as a model whose token ids differ from an
instance's) head the page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import HTMLResponse, JSONResponse

from router.dispatch.wait.flow_gate import FlowGate
from router.dispatch.wait.settings import ObjectiveConfig
from router.http.admin import check_admin_token
from router.index.figures import IndexFigures
from router.index.holdings import Tier
from router.metrics import RouterMetrics
from router.programs.table import WorkingSets
from router.runtime import Runtime
from router.upstreams.instances import Instance, Upstreams

# The page loads nothing from elsewhere; the policy makes the browser hold it to that.
_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
    "cache-control": "no-store",
}


def dashboard_routes(fleet: Upstreams, runtime: Runtime, token: Callable[[], str | None]) -> APIRouter:
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
        table, index = runtime.table, runtime.index_figures()
        body = {
            "alarms": runtime.warnings(),
            "tokenizers": runtime.tokenizer_watch.state(),
            "instances": instances_state(fleet, index, runtime.programs.working_sets()),
            "index": {
                "entries": index.entries,
                "max_entries": index.max_entries,
                "bytes": index.bytes,
                "pool_entries": index.pool_entries,
            },
            "flow_control": flow_control_state(runtime.flow_gate, runtime.metrics),
            "programs_waiting": runtime.programs.gate.waiting(),
            "ab": await table.ab.report_off_loop(table.split.weights),
        }
        return JSONResponse(body, headers={"cache-control": "no-store"})

    return routes


_NO_PROGRAMS = WorkingSets()


def instances_state(
    fleet: Upstreams, index: IndexFigures, programs: Mapping[str, WorkingSets] | None = None
) -> list[dict[str, Any]]:
    """Each instance as the router sees it, with the blocks the index holds for it by tier (ranks added)
    and the agent programs whose KV working set is there."""
    blocks: dict[str, list[int]] = {i.name: [0] * len(Tier) for i in fleet.instances}
    for name, _, sizes in index.by_owner:
        totals = blocks.setdefault(name, [0] * len(Tier))
        for tier, size in zip(Tier, sizes, strict=True):
            totals[tier] += size
    sets = programs or {}
    return [_instance(i, blocks[i.name], sets.get(i.name, _NO_PROGRAMS)) for i in fleet.instances]


def flow_control_state(gate: FlowGate, metrics: RouterMetrics) -> dict[str, Any]:
    """Flow control's settings and queue: each objective configured (and `default`, every other request's),
    highest priority first, with its requests waiting now and those refused so far by reason. An objective a
    reload removed is listed while requests of it still wait, with no priority."""
    config, control = gate.config, gate.control
    waiting: dict[str, int] = {}
    for queue in control.queues().values():
        for name, count in queue.by_objective.items():
            waiting[name] = waiting.get(name, 0) + count
    refused: dict[str, dict[str, int]] = {}
    for family in metrics.flow_refused.metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.value:
                by_reason = refused.setdefault(sample.labels["objective"], {})
                by_reason[sample.labels["reason"]] = int(sample.value)
    configured: dict[str, ObjectiveConfig | None] = {
        **config.objectives,
        "default": config.objective(None)[1],
    }
    for name, count in waiting.items():
        if count:
            configured.setdefault(name, None)

    def rank(item: tuple[str, ObjectiveConfig | None]) -> tuple[bool, int, str]:
        """Highest priority first; those no longer configured last."""
        name, settings = item
        return settings is None, 0 if settings is None else -settings.priority, name

    objectives = [
        {
            "name": name,
            "priority": None if settings is None else settings.priority,
            "max_queued": None if settings is None else settings.max_queued,
            "max_queue_s": None if settings is None else settings.max_queue_s,
            "queued": waiting.get(name, 0),
            "refused": refused.get(name, {}),
        }
        for name, settings in sorted(configured.items(), key=rank)
    ]
    return {
        "enabled": config.enabled,
        "ordering": config.ordering,
        "queued": control.queued(),
        "objectives": objectives,
    }


def _instance(instance: Instance, blocks: list[int], programs: WorkingSets) -> dict[str, Any]:
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
        "programs": {
            "running": programs.running,
            "tool_call": programs.tool_call,
            "paused": programs.paused,
            "warmed": programs.warmed,
            "working_set_tokens": programs.tokens,
        },
        "ttft_rates": instance.ttft_model.rates,
        "ttft_slowdown": instance.ttft_model.slowdown,
    }
