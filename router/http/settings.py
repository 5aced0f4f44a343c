"""The `admin`, `auth` and `cors` sections: who may call the HTTP door, and from where (router/http/)."""

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
