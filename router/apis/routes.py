"""The APIs the router serves by routing, each with the body it takes and the shape of its errors.

Both front doors (router/http/, router/epp/) look a request's method and path up here. The prompt APIs
(chat, completions, and the agents' Responses and Anthropic Messages, which vLLM renders as chats) are
routed by their prompt's cached prefix; the others that vLLM serves (tokenizer, pooling) by load and model;
a stored response's retrieval and cancellation go to the instance that holds it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

KEY_HEADERS = ("authorization", "x-api-key")  # where OpenAI's clients and Anthropic's send their key

# How the router reads a body: as a chat or a completion (router/apis/openai_body.py), as an agent API it
# renders as vLLM does (router/apis/responses/stored.py), or for its model alone.
BodyKind = Literal["chat", "completion", "responses", "messages", "model_only", "none"]


@dataclass(frozen=True, slots=True)
class Api:
    name: str  # the metrics' `api` label
    body: BodyKind
    anthropic: bool = False  # errors in Anthropic's shape ({"type":"error","error":{...}})
    get: bool = False  # sent to the engine as a GET, without a body


CHAT = Api("chat", "chat")
COMPLETIONS = Api("completions", "completion")
RESPONSES = Api("responses", "responses")
MESSAGES = Api("messages", "messages", anthropic=True)
COUNT_TOKENS = Api("count_tokens", "model_only", anthropic=True)
# A stored response's: the path names it, and the instance holding it serves it
RETRIEVE_RESPONSE = Api("responses", "none", get=True)
CANCEL_RESPONSE = Api("responses", "none")

# vLLM's other model routes, routed by load: tokenizer endpoints, and those of pooling models.
_BY_LOAD = {
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/embeddings": "embeddings",
    "/pooling": "pooling",
    "/classify": "classify",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
}
# POST routes, by path: the engine's path is the client's.
ROUTED_PATHS: dict[str, Api] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
    "/v1/messages/count_tokens": COUNT_TOKENS,
    **{path: Api(name, "model_only") for path, name in _BY_LOAD.items()},
}

_STORED_RESPONSE = re.compile(r"/v1/responses/([^/]+)(/cancel)?")


def routed_api(method: str, path: str) -> tuple[Api, str | None] | None:
    """The API a request is for, and the stored response its path names; None: not routed here."""
    if method == "POST":
        api = ROUTED_PATHS.get(path)
        if api is not None:
            return api, None
    if not path.startswith("/v1/responses/"):
        return None
    found = _STORED_RESPONSE.fullmatch(path)
    if found is None:
        return None
    if found.group(2) is None:
        return (RETRIEVE_RESPONSE, found.group(1)) if method == "GET" else None
    return (CANCEL_RESPONSE, found.group(1)) if method == "POST" else None


def presented_key(headers: Mapping[str, str]) -> str:
    """The client key a request presents: `Authorization: Bearer <key>`, else Anthropic's `x-api-key`."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    return key if scheme.lower() == "bearer" else headers.get("x-api-key", "")
