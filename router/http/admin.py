"""The operator's API under /admin: A/B results, the traffic split, configuration reload.

Every route needs `Authorization: Bearer <token>`, the token from the configuration or its environment
variable; with no token configured the routes do not exist (404). A missing token is a 401, a wrong one 403.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse

from router.config import api_key
from router.errors import OpenAIError, bad_request
from router.http.settings import MIN_TOKEN_LENGTH, AdminConfig
from router.runtime import Runtime

log = logging.getLogger(__name__)
_warned_short: set[str] = set()  # environment variables already warned about


def admin_token(config: AdminConfig) -> str | None:
    """The configured token, else its environment variable's; None: the admin routes are off. A token from
    the environment is held to the length a configured one must have: shorter, the routes stay off."""
    if config.token is not None:
        return config.token
    if config.token_env is None:
        return None
    token = api_key(config.token_env) or None  # stripped: a token file's newline is no part of it
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        if config.token_env not in _warned_short:
            _warned_short.add(config.token_env)
            log.warning(
                "$%s holds fewer than %d characters: the admin routes stay off",
                config.token_env,
                MIN_TOKEN_LENGTH,
            )
        return None
    return token


def check_admin_token(request: Request, expected: str) -> None:
    """Raises OpenAIError unless request carries `Authorization: Bearer <expected>`: 401 without a token,
    403 with another."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise OpenAIError(
            401,
            "Admin routes need `Authorization: Bearer <token>`.",
            "authentication_error",
            "missing_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise OpenAIError(403, "Wrong admin token.", "permission_error", "wrong_token")


class _TrafficBody(msgspec.Struct, forbid_unknown_fields=True):
    split: dict[str, float]


def admin_routes(
    token: Callable[[], str | None], runtime: Runtime, reload: Callable[[], Awaitable[Any]]
) -> APIRouter:
    """token: the current token (a reload may change it); reload: re-reads the configuration file, raises
    OpenAIError with the reason when the new one cannot be used."""

    def authorized(request: Request) -> None:
        expected = token()
        if expected is None:
            raise OpenAIError(404, "Not Found", "not_found_error", "404")
        check_admin_token(request, expected)

    routes = APIRouter(prefix="/admin", dependencies=[Depends(authorized)])

    @routes.get("/ab")
    async def ab() -> JSONResponse:
        table = runtime.table
        return JSONResponse(await table.ab.report_off_loop(table.split.weights))

    @routes.post("/ab/reset")
    async def ab_reset() -> JSONResponse:
        if runtime.shared_ab is None:
            runtime.table.ab.reset()
        else:  # every replica's
            await runtime.shared_ab.reset()
        return JSONResponse({"status": "reset"})

    @routes.get("/traffic")
    async def traffic_now() -> JSONResponse:
        """The split in force: the file's, or the last one PUT here (which a restart forgets)."""
        return JSONResponse({"split": runtime.table.split.shares()})

    @routes.put("/traffic")
    async def traffic(request: Request) -> JSONResponse:
        current = runtime.table
        try:
            body = msgspec.json.decode(await request.body(), type=_TrafficBody)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:  # a key's bytes, a deep nest
            raise bad_request(f'The body must be {{"split": {{"policy": weight, ...}}}}: {exc}') from exc
        unknown = [name for name in body.split if name not in current.policies]
        if unknown:
            known = ", ".join(current.policies)
            raise bad_request(f"Unknown policies {unknown}; known: {known}.", param="split")
        try:
            runtime.table = current.with_split(body.split)
        except ValueError as exc:
            raise bad_request(str(exc), param="split") from exc
        if runtime.shared_ab is not None:  # every replica's
            await runtime.shared_ab.split_set(body.split)
        return JSONResponse({"split": runtime.table.split.shares()})

    @routes.post("/reload")
    async def reload_config() -> JSONResponse:
        return JSONResponse(await reload())

    return routes
