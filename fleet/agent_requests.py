"""Reading the agent APIs' bodies (/v1/responses, /v1/messages) as vLLM 0.32's FastAPI layer does: a body
that is not JSON, or lacks a required field, is refused with the 400 of vLLM's RequestValidationError handler,
``{"error":{"message":"N validation error(s):\\n  {pydantic error}","type":"Bad Request","param":...}}``, in
OpenAI's shape on every route (the Anthropic routes' own errors are in Anthropic's)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from fleet.server import ClientError, checked_fields

_BOM = "\ufeff"
_PHRASE = "Bad Request"  # vLLM names these errors by the HTTP status phrase


class BodyValidationError(ClientError):
    """Refused before the endpoint's handler runs: always in OpenAI's error shape."""

    def __init__(self, errors: list[str], param: str | None) -> None:
        label = "error" if len(errors) == 1 else "errors"
        message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {error}" for error in errors)
        super().__init__(400, message, _PHRASE, param)


def _summary(value: Any) -> str:
    """How vLLM's handler shows an offending container: never its contents."""
    return f"<{type(value).__name__} of {len(value)} items>"


async def read_json_body(
    request: web.Request,
    required: tuple[str, ...],
    booleans: tuple[str, ...] = (),
    before: Callable[[dict[str, Any]], None] = lambda body: None,
) -> dict[str, Any]:
    """The body as an object with its required fields, booleans read as pydantic reads them and the
    sampling parameters checked as vLLM checks them; before: what the request model's "before" validators
    change, ahead of the check of the fields."""
    media_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise BodyValidationError(["Unsupported Media Type: Only 'application/json' is allowed"], None)
    text = (await request.read()).decode("utf-8", "replace").removeprefix(_BOM)
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        error = {
            "type": "json_invalid",
            "loc": f"body.{exc.pos}",
            "msg": "JSON decode error",
            "input": _summary({}),
            "ctx": {"error": exc.msg},
        }
        raise BodyValidationError([str(error)], f"body.{exc.pos}") from exc
    if not isinstance(body, dict):
        error = {
            "type": "model_attributes_type",
            "loc": "body",
            "msg": "Input should be a valid dictionary or object to extract fields from",
        }
        raise BodyValidationError([str(error)], "body")
    before(body)
    missing = [name for name in required if name not in body]
    if missing:
        errors = [
            str({"type": "missing", "loc": f"body.{name}", "msg": "Field required", "input": _summary(body)})
            for name in missing
        ]
        raise BodyValidationError(errors, f"body.{missing[0]}")
    return checked_fields(body, booleans)
