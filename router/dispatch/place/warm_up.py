"""Warm-ups: a program's prompt prefilled, while its tool runs, where its next turn is foreseen to go without
its KV (programs.warm_up; the rule is router/programs/warm_ups.py's).

Once a program's turn is answered, its prompt is looked up in the index again and its policy foresees the
next turn's instance. A warm-up is the client's body as the instance would have it, but whole and of one
token: the engine computes (or loads from the pool) the prompt's KV and keeps it in its prefix cache. It is
counted in flight at its instance as any request, so that routing sees its load; it is the router's alone,
and nothing of it reaches a client. At most one per instance goes at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec

from router.dispatch.context import Received
from router.dispatch.decide.decision import Prepared
from router.dispatch.place.sending import Outgoing, SendContext
from router.programs.warm_ups import WarmUps
from router.upstreams.instances import Instance

log = logging.getLogger(__name__)

# The APIs whose body the instance renders to the prompt itself, and whose answer can be cut to one token
# without anything kept (a Responses request would store a response, or name one stored).
_WARMED = frozenset({"chat", "completions", "messages"})
# What could make the warm-up more than a prefill, or end it before its one token.
_DROPPED = frozenset({"stream_options", "n", "best_of", "logprobs", "top_logprobs", "prompt_logprobs"})
_encode = msgspec.json.Encoder().encode


def warm_up_body(raw: bytes) -> bytes:
    """The client's body as a warm-up: whole, one token."""
    body: dict[str, Any] = msgspec.json.decode(raw)
    warm = {key: value for key, value in body.items() if key not in _DROPPED}
    warm |= {"stream": False, "max_tokens": 1}
    if "max_completion_tokens" in warm:
        warm["max_completion_tokens"] = 1
    if "min_tokens" in warm:
        warm["min_tokens"] = 1
    return _encode(warm)


class WarmUpSender:
    def __init__(self, context: SendContext, enabled: bool) -> None:
        observers = context.observers
        self._context = context
        self._warm_ups = WarmUps(enabled, observers.programs, observers.metrics)
        self._warming: set[str] = set()  # the instances a warm-up was sent to and is not over
        self._tasks: set[asyncio.Task[None]] = set()  # held: the event loop keeps only weak references

    def follow(self, received: Received, prepared: Prepared, path: str) -> Callable[[Instance], None] | None:
        """What warms the next turn once request's answer came from an instance; None: it is not one a
        warm-up follows (no program's, not tokenized, or an API whose answer keeps state)."""
        request, target = prepared.request, received.target
        if not self._warm_ups.enabled or request.session_key is None or not request.chain:
            return None
        if target.api not in _WARMED or target.body_for is not None or target.pinned is not None:
            return None
        if self._context.upstreams.disaggregated(request.model):
            return None
        return lambda answered_at: self._foresee(received, prepared, path, answered_at)

    def _foresee(self, received: Received, prepared: Prepared, path: str, answered_at: Instance) -> None:
        task = asyncio.get_running_loop().create_task(self._warm(received, prepared, path, answered_at))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.warning("a warm-up failed: %r", error)

    async def _warm(self, received: Received, prepared: Prepared, path: str, answered_at: Instance) -> None:
        context = self._context
        fresh = await context.decider.refresh(prepared)
        prompt = replace(fresh.request, new_program=False)
        healthy = context.upstreams.candidates(prompt.model)
        candidates = [i for i in context.room.filter(prompt, healthy) if i.name not in self._warming]
        if not candidates:
            return
        foreseen = candidates[received.policy.predict(prompt, candidates)]
        warm_up = self._warm_ups.where(prompt, answered_at.name, foreseen, candidates)
        if warm_up is None:
            return
        assert prompt.session_key is not None
        self._warm_ups.sent(prompt.session_key, warm_up)
        instance = next(i for i in candidates if i.name == warm_up.instance.name)
        self._warming.add(instance.name)
        try:
            await self._send(received, path, fresh, instance, warm_up.uncached_tokens)
        finally:
            self._warming.discard(instance.name)

    async def _send(
        self, received: Received, path: str, prepared: Prepared, instance: Instance, uncached: int
    ) -> None:
        tokens, chain = prepared.request.prompt_tokens, prepared.chain
        instance.start(tokens, uncached, chain)
        outgoing = Outgoing(instance, path, warm_up_body(received.raw), received.headers)
        sent = None
        try:
            sent = await self._context.sender.prefill(outgoing)
        finally:
            answered = sent is not None and sent.upstream is not None and sent.upstream.status == 200
            instance.end(tokens, uncached, admitted=answered, chain=chain)
            if sent is not None and sent.upstream is not None:
                if answered:
                    sent.upstream.release()
                else:  # not back to the pool: the engine sees the connection go
                    sent.upstream.close()
            self._context.observers.room_freed.fire()
        if not answered:
            log.debug("warm-up at %s: %s", instance.name, sent.kind if sent is not None else "not sent")
