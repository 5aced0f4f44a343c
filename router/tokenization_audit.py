"""Checks, now and then, that chats with tools the router renders itself get the engine's own token ids.

Agents send ``tools`` with every turn. Rendering them locally (router/chat_conversation.py) saves an instance
a whole render of a long conversation per request, but its exactness rests on reproducing vLLM's message
handling for this model's template. So the first such chat of each model, and one in ``every`` after it, is
also sent to an instance's ``/tokenize`` in the background (the request does not wait). One mismatch and
that model's chats with tools go to the engine's renderer from then on: routing on wrong ids would credit
blocks no instance holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from router.chat_conversation import engine_messages
from router.metrics import RouterMetrics
from router.token_cache import RemoteTokenizer, TokenizeFailed

log = logging.getLogger(__name__)


class TokenizationAudit:
    def __init__(
        self, every: int, metrics: RouterMetrics, remote: Callable[[str], RemoteTokenizer | None]
    ) -> None:
        """every: one chat in this many is checked (0: none); remote: an instance's /tokenize for a model."""
        self._every, self._metrics, self._remote = every, metrics, remote
        self._seen: Counter[str] = Counter()
        self._distrusted: set[str] = set()
        self._checks: set[asyncio.Task[None]] = set()

    def trusts(self, model: str) -> bool:
        return model not in self._distrusted

    def consider(
        self, model: str, messages: Sequence[Any], flags: Mapping[str, bool], tools: list[Any], ids: list[int]
    ) -> None:
        """A chat with tools was tokenized locally into ``ids``; check it if its turn has come."""
        seen = self._seen[model]
        self._seen[model] += 1
        if self._every == 0 or seen % self._every or model in self._distrusted:
            return
        remote = self._remote(model)
        if remote is None:
            return
        check = asyncio.create_task(self._check(remote, model, engine_messages(messages), flags, tools, ids))
        self._checks.add(check)
        check.add_done_callback(self._checks.discard)

    async def _check(
        self,
        remote: RemoteTokenizer,
        model: str,
        messages: list[Any],
        flags: Mapping[str, bool],
        tools: list[Any],
        ids: list[int],
    ) -> None:
        try:
            engine_ids = await remote.chat_ids(messages, **flags, template_inputs={"tools": tools})
        except TokenizeFailed as exc:
            log.debug("tokenization audit of %s could not ask the engine: %s", model, exc)
            self._metrics.tokenization_audits(model, "failed").inc()
            return
        if engine_ids == ids:
            self._metrics.tokenization_audits(model, "match").inc()
            return
        self._metrics.tokenization_audits(model, "mismatch").inc()
        if model not in self._distrusted:
            self._distrusted.add(model)
            differ = next((i for i, (a, b) in enumerate(zip(ids, engine_ids, strict=False)) if a != b),
                          min(len(ids), len(engine_ids)))  # fmt: skip
            log.warning(
                "%s: a chat with tools rendered here gave %d ids, the engine %d, first different at %d; "
                "from now on the engine tokenizes this model's chats with tools",
                model, len(ids), len(engine_ids), differ,
            )  # fmt: skip

    def close(self) -> None:
        for check in self._checks:
            check.cancel()
