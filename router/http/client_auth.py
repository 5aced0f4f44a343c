"""Client API keys: when configured, every /v1 request needs `Authorization: Bearer <key>` (or, as Anthropic's
clients send it, `x-api-key: <key>`), checked before anything else is done with it (its size, its type, its
body): a client without a key learns nothing else."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from router.apis.routes import KEY_HEADERS, presented_key
from router.config import client_api_keys
from router.errors import anthropic_route, invalid_api_key
from router.http.settings import ClientAuthConfig

_GUARDED_PREFIX = "/v1/"


def client_key_digests(auth: ClientAuthConfig) -> frozenset[bytes]:
    """SHA-256 digests of the clients' API keys from the environment; empty: no client authentication."""
    keys = client_api_keys(auth.api_keys_env) if auth.api_keys_env else []
    return frozenset(hashlib.sha256(key.encode()).digest() for key in keys)


class ClientAuth:
    def __init__(self, app: ASGIApp, digests: frozenset[bytes], rejected: Callable[[], None]) -> None:
        """digests: client_key_digests; rejected: told of every request refused."""
        self.app, self._digests, self._rejected = app, digests, rejected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._digests and scope["type"] == "http" and scope["path"].startswith(_GUARDED_PREFIX):
            if not self._allowed(scope):
                self._rejected()
                await invalid_api_key().response(anthropic_route(scope["path"]))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        key = presented_key({name: headers.get(name.encode(), b"").decode("latin-1") for name in KEY_HEADERS})
        # Digests of equal length are looked up in a set: no timing difference tells a prefix of a key.
        return bool(key) and hashlib.sha256(key.encode()).digest() in self._digests
