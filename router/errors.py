"""Errors the router answers itself, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

_encode = msgspec.json.Encoder().encode

MALFORMED_HTTP = "malformed_http"  # the code of the 400 for what the HTTP parser refused


RETRY_AFTER_S = 1  # what the router's own 429s and 503s ask a client to wait


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        code: str | int,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.param, self.headers = param, headers or {}

    def response(self, anthropic: bool = False) -> Response:
        """anthropic: in the shape of Anthropic's API, for its routes."""
        if anthropic:
            body = anthropic_error_json(self.message, anthropic_error_type(self.status))
        else:
            body = error_json(self.message, self.kind, self.code, self.param)
        return Response(body, self.status, headers=self.headers, media_type="application/json")


ANTHROPIC_ROUTES = "/v1/messages"  # and /v1/messages/count_tokens: their errors in Anthropic's shape


def anthropic_route(path: str) -> bool:
    return path.startswith(ANTHROPIC_ROUTES)


# Anthropic's error types by status, for the router's own errors on its routes
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_json(message: str, kind: str) -> bytes:
    """Anthropic's error body, as vLLM's Messages routes answer it: {"type":"error","error":{...}}."""
    return _encode({"type": "error", "error": {"type": kind, "message": message}})


def error_json(message: str, kind: str, code: str | int, param: str | None = None) -> bytes:
    """OpenAI's error object, encoded: for answers the router makes itself and for SSE error events."""
    return _encode({"error": {"message": message, "type": kind, "param": param, "code": code}})


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", code, param)


def not_utf8() -> OpenAIError:
    """A request body that is no UTF-8: refused before routing by `serve` (router/http/request_limits.py), and
    where the gateway hands the picker a body (router/apis/openai_body.py)."""
    return bad_request("The request body is not valid UTF-8.", "invalid_encoding")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or no instance serves it.",
        "invalid_request_error",
        "model_not_found",
        "model",
    )


def unavailable(message: str, code: str, retry_after_s: int) -> OpenAIError:
    """503: nothing can serve the request now; Retry-After tells well-behaved clients when to come back."""
    return OpenAIError(
        503, message, "service_unavailable_error", code, headers={"Retry-After": str(retry_after_s)}
    )


def upstream_failed(instance: str, cause: BaseException) -> OpenAIError:
    """502: the instance accepted the request but its answer broke off (the request may have run)."""
    return OpenAIError(
        502,
        f"Instance {instance} failed while answering: {type(cause).__name__}.",
        "upstream_error",
        "upstream_failed",
    )


def upstream_timeout(instance: str, limit: str) -> OpenAIError:
    """504: the instance took longer than the router waits (the request may still be running there)."""
    message = f"Instance {instance} did not answer within upstream.{limit}."
    return OpenAIError(504, message, "upstream_error", "upstream_timeout")


def upstream_unauthorized(instance: str, status: int) -> OpenAIError:
    """502: the instance refused the router's own key; a 401 would tell the client its key is wrong."""
    message = (
        f"Instance {instance} refused the router's credentials ({status}): its key belongs in the "
        "environment variable that upstream.api_key_env (or the instance's api_key_env) names."
    )
    return OpenAIError(502, message, "upstream_error", "upstream_unauthorized")


def upstream_redirected(instance: str, status: int, location: str) -> OpenAIError:
    """502: the instance answered a redirect, which the router does not follow; its URL is to be fixed."""
    message = (
        f"Instance {instance} answered {status}, a redirect to {location or '(no Location)'}: the router "
        "does not follow redirects; give the instance the URL it leads to."
    )
    return OpenAIError(502, message, "upstream_error", "upstream_redirected")


def too_many_requests(message: str, code: str, retry_after_s: int) -> OpenAIError:
    """429: the router is at capacity; Retry-After says when to try again."""
    return OpenAIError(429, message, "rate_limit_error", code, headers={"Retry-After": str(retry_after_s)})


def invalid_api_key() -> OpenAIError:
    message = "Incorrect or missing API key: send `Authorization: Bearer <key>`."
    return OpenAIError(
        401, message, "invalid_request_error", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


def body_timeout(limit_s: float) -> OpenAIError:
    """408: the client took longer than limit_s to send its request body."""
    message = f"The request body did not arrive within {limit_s:g} s."
    return OpenAIError(408, message, "invalid_request_error", "body_timeout")


def client_closed() -> OpenAIError:
    """499 (nginx's code): the client disconnected before the answer began; nobody reads this body."""
    return OpenAIError(499, "The client closed the request.", "invalid_request_error", "client_closed")


class _ErrorShape(msgspec.Struct):
    error: dict[str, object]


def error_object(payload: bytes) -> dict[str, object]:
    """The `error` object of an OpenAI-shaped error body; msgspec.DecodeError when payload is not one."""
    return msgspec.json.decode(payload, type=_ErrorShape).error


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"The request body is larger than {limit} bytes.", "invalid_request_error", "body_too_large"
    )
