"""vLLM's cache resets, sent on to every engine: POST /reset_prefix_cache, /reset_mm_cache and
/reset_encoder_cache.

Benchmarks reset the caches between runs (aiperf's --reset-kv-cache posts /reset_prefix_cache to the endpoint
it measures), and a router in front of the fleet must reset all of it. vLLM serves these routes only with
VLLM_SERVER_DEV_MODE=1: an engine without it answers 404, named in the error. With an admin token configured,
the routes need it as /admin does; without one they are open, as vLLM's own are.

An engine publishes its AllBlocksCleared KV event with its next step's batch, which an idle engine takes only
when a request comes: the index forgets an engine's GPU blocks as soon as it says it has reset them, so the
next request is routed on what the engines hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from starlette.responses import JSONResponse, Response

from router.errors import OpenAIError
from router.http.admin import check_admin_token
from router.index.routing_index import RoutingIndex
from router.upstreams.instances import Upstreams

log = logging.getLogger(__name__)

RESET_TIMEOUT_S = 30.0  # a reset waits for the engine's busy loop, behind a step of a long prefill


@dataclass(frozen=True, slots=True)
class _Engine:
    """One API server: the instances the router has at its URL (data-parallel ranks share one)."""

    url: str
    names: tuple[str, ...]
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class _Answer:
    engine: _Engine
    body: object = None  # the JSON of a 200
    failure: str | None = None  # why there is no 200 (or not the one expected)
    success: bool | None = None  # what a 200 of /reset_prefix_cache says
    status: int | None = None  # the engine's, when it answered


def cache_reset_routes(
    fleet: Upstreams,
    index: RoutingIndex,
    token: Callable[[], str | None],
    timeout_s: float = RESET_TIMEOUT_S,
) -> APIRouter:
    """token: the current admin token, as for admin_routes (None: the routes are open)."""

    def authorized(request: Request) -> None:
        expected = token()
        if expected is not None:
            check_admin_token(request, expected)

    routes = APIRouter(dependencies=[Depends(authorized)])

    @routes.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = Query(default=False),
        reset_external: bool = Query(default=False),
    ) -> JSONResponse:
        """200 {"success": all reset, "instances": {name: reset}} when every engine answered, as vLLM's
        {"success": false} tells that an engine still held blocks (callers may retry); 502 naming those that
        did not answer."""
        flags = {"reset_running_requests": reset_running_requests, "reset_external": reset_external}
        params = {name: "true" for name, on in flags.items() if on}
        answered = await _broadcast(_engines(fleet), "/reset_prefix_cache", params, timeout_s)
        answers = [_with_success(answer) for answer in answered]
        reset: dict[str, bool] = {}
        for answer in answers:
            if answer.success is None:
                continue
            if answer.success:
                _forget_gpu_blocks(index, answer.engine.names)
            reset.update(dict.fromkeys(answer.engine.names, answer.success))
        _raise_for_failures("the prefix cache", answers)
        log.info("reset the prefix cache: %s", reset)
        return JSONResponse({"success": all(reset.values()), "instances": reset})

    for path, what in (
        ("/reset_mm_cache", "the multi-modal cache"),
        ("/reset_encoder_cache", "the encoder cache"),
    ):
        routes.add_api_route(path, _plain_reset(fleet, path, what, timeout_s), methods=["POST"])
    return routes


def _plain_reset(
    fleet: Upstreams, path: str, what: str, timeout_s: float
) -> Callable[[], Awaitable[Response]]:
    """A reset vLLM answers with an empty 200 (it does not check that it happened): so does this, once every
    engine has."""

    async def reset() -> Response:
        _raise_for_failures(what, await _broadcast(_engines(fleet), path, {}, timeout_s))
        return Response(status_code=200)

    return reset


def _engines(fleet: Upstreams) -> list[_Engine]:
    by_url: dict[str, list[str]] = {}
    headers: dict[str, Mapping[str, str]] = {}
    for instance in fleet.instances:
        by_url.setdefault(instance.url, []).append(instance.name)
        headers.setdefault(instance.url, instance.headers)  # its API key; a rank header is no matter here
    return [_Engine(url, tuple(names), headers[url]) for url, names in by_url.items()]


async def _broadcast(
    engines: list[_Engine], path: str, params: Mapping[str, str], timeout_s: float
) -> list[_Answer]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(_post(session, e, path, params, timeout_s) for e in engines)))


async def _post(
    session: aiohttp.ClientSession, engine: _Engine, path: str, params: Mapping[str, str], timeout_s: float
) -> _Answer:
    try:
        async with session.post(engine.url + path, params=params, headers=engine.headers) as response:
            if response.status != 200:
                return _Answer(engine, failure=_status_failure(response.status), status=response.status)
            data = await response.read()
            if not data:
                return _Answer(engine)
            try:
                return _Answer(engine, body=await response.json(content_type=None))
            except ValueError:
                return _Answer(engine, failure="answered 200 with a body that is not JSON")
    except TimeoutError:
        return _Answer(engine, failure=f"no answer within {timeout_s:g} s")
    except aiohttp.ClientError as exc:
        return _Answer(engine, failure=f"unreachable ({type(exc).__name__})")


def _status_failure(status: int) -> str:
    if status == 404:
        return "HTTP 404: vLLM serves it only with VLLM_SERVER_DEV_MODE=1"
    return f"HTTP {status}"


def _with_success(answer: _Answer) -> _Answer:
    """A 200 of /reset_prefix_cache is vLLM's {"success": bool}; anything else is no answer to it."""
    body = answer.body
    if answer.failure is not None:
        return answer
    if isinstance(body, dict) and isinstance(success := body.get("success"), bool):
        return _Answer(answer.engine, body, success=success)
    return _Answer(answer.engine, failure=f'answered 200 with {repr(body)[:200]}, not {{"success": bool}}')


def _forget_gpu_blocks(index: RoutingIndex, names: tuple[str, ...]) -> None:
    """What the engine's AllBlocksCleared will do when it comes, done now: every rank's GPU blocks go."""
    for name in names:
        index.cache_reset(name)


def _raise_for_failures(what: str, answers: list[_Answer]) -> None:
    failed = [answer for answer in answers if answer.failure is not None]
    if not failed:
        return
    if all(answer.status == 404 for answer in answers):  # no engine serves it: nor does the router
        raise HTTPException(404, "Not Found")
    named = "; ".join(f"{', '.join(a.engine.names)}: {a.failure}" for a in failed)
    log.warning("resetting %s failed on %s", what, named)
    message = f"Resetting {what} failed on {len(failed)} of {len(answers)} engines ({named})."
    raise OpenAIError(502, message, "upstream_error", "reset_failed")
