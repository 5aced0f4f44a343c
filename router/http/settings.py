"""The `admin`, `auth`, `cors` and `limits` sections: who may call the HTTP door, from where, and what a
client may send it (router/http/)."""

from __future__ import annotations

from pydantic import Field

from router.settings_base import Strict

MIN_TOKEN_LENGTH = 16  # of the admin token: guessing it must be out of reach


class AdminConfig(Strict):
    token: str | None = Field(
        default=None, min_length=MIN_TOKEN_LENGTH, description="bearer token of /admin/*"
    )
    token_env: str | None = Field(
        default="KVROUTE_ADMIN_TOKEN", description="environment variable holding the token, if token is unset"
    )


class ClientAuthConfig(Strict):
    api_keys_env: str | None = Field(
        default=None,
        description="environment variable with the clients' API keys, comma-separated (named but unset or "
        "empty: the router refuses to start, rather than serve without keys); null: no client authentication",
    )


class CorsConfig(Strict):
    allow_origins: list[str] = Field(
        default_factory=list,
        description="origins whose browser pages may call the router (CORS); ['*']: any, as vLLM allows by "
        "default; empty: no CORS headers",
    )


class LimitsConfig(Strict):
    max_body_bytes: int = Field(
        default=32 * 2**20, ge=1, description="/v1/* request bodies larger than this are answered 413"
    )
    max_buffered_body_bytes: int = Field(
        default=256 * 2**20,
        ge=1,
        description="request bodies read ahead of admission, all requests together (each counts its "
        "Content-Length, else max_body_bytes): past it, a body waits unread, then 503 after body_timeout_s",
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="a client slower than this to send its body is answered 408"
    )
    send_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="a stream's client that takes no data for this long is cut off, freeing its slot and "
        "aborting the engine's request (nginx's send_timeout)",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a connection must send a request's head within this long of opening, or of its previous "
        "answer's end, or it is closed (408 if the head was begun; nginx's client_header_timeout)",
    )
    max_header_bytes: int = Field(
        default=64 * 2**10,
        ge=1024,
        description="a request's head (request line and headers) larger than this is answered 431 and its "
        "connection closed (Envoy's max_request_headers_kb is 60 KiB)",
    )
