"""Stored responses' conversations, and the instances of ids clients chose, on the replicas' shared store.

A Responses follow-up (`previous_response_id`) names a response one replica routed; the instance it must go
to is read from the id alone (router/apis/responses/ids.py), but its prompt, the conversation the
response was rendered from and its output, is known only where it was routed. So each replica writes a
completed stored response's conversation to the store, and one that meets a follow-up whose conversation it
does not hold reads it from there first (one read, within shared.timeout_s): the follow-up is then routed with
prefix knowledge through any replica. An id a client chose itself is written with its instance and owner in
the same way. Writes go in the background, at most MAX_WRITING at once (more are dropped and counted); a read
that fails or comes late leaves the follow-up routed without prefix knowledge, as before the store.

A follow-up can reach another replica before the conversation's write does (its client sends it the moment
the answer ends). So a response is also marked pending on the store when it is sent, long before it ends,
and a follow-up whose conversation is pending waits for it, within the same shared.timeout_s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from router.shared.store import SharedStore, StoreError

MAX_WRITING = 256
PENDING_TTL_S = 600  # a response still pending this long is not waited for
_PENDING_POLL_S = 0.005


class SharedConversation(msgspec.Struct, array_like=True):
    messages: list[Any]
    output: list[Any]


class ChosenId(msgspec.Struct, array_like=True):
    url: str  # the instance's
    owner: str


class SharedConversations:
    def __init__(self, store: SharedStore) -> None:
        self._store = store
        self._writing: set[asyncio.Task[None]] = set()
        self._encoder = msgspec.msgpack.Encoder()
        self._conversation = msgspec.msgpack.Decoder(SharedConversation)
        self._chosen = msgspec.msgpack.Decoder(ChosenId)

    def pending(self, key: str) -> None:
        """A stored response was sent: its conversation is to come, under its history key."""
        self._write(self._store.key("pending", key), b"1", PENDING_TTL_S)

    def kept(self, key: str, messages: Sequence[Mapping[str, Any]], output: list[Any]) -> None:
        """A stored response completed: its conversation, under its history key."""
        value = self._encoder.encode(SharedConversation(list(messages), output))
        self._write(self._store.key("conversation", key), value)

    def chosen(self, response_id: str, url: str, owner: str) -> None:
        """A client chose a response's id: the instance that makes it, and its owner."""
        self._write(self._store.key("chosen", response_id), self._encoder.encode(ChosenId(url, owner)))

    async def recall(
        self, response_id: str, history_key: str
    ) -> tuple[ChosenId | None, SharedConversation | None]:
        """What the store holds of a response: its chosen id's instance and owner, and its conversation."""
        store = self._store
        conversation_key = store.key("conversation", history_key)
        keys = [store.key("chosen", response_id), conversation_key, store.key("pending", history_key)]
        try:
            async with asyncio.timeout(store.config.timeout_s):
                chosen, conversation, pending = await store.client.mget(keys)
                while conversation is None and pending is not None:  # its write is on its way
                    await asyncio.sleep(_PENDING_POLL_S)
                    conversation = await store.client.get(conversation_key)
            store.answered()
        except StoreError as exc:
            store.failed("conversation_read", exc)
            return None, None
        try:
            return (
                self._chosen.decode(chosen) if isinstance(chosen, bytes) else None,
                self._conversation.decode(conversation) if isinstance(conversation, bytes) else None,
            )
        except msgspec.DecodeError:  # written by another version, or not by a replica
            return None, None

    def _write(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        if len(self._writing) >= MAX_WRITING:
            self._store.dropped("conversation_write")
            return
        task = asyncio.get_running_loop().create_task(self._set(key, value, ttl_s))
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)

    async def _set(self, key: str, value: bytes, ttl_s: float | None) -> None:
        store = self._store
        try:
            await store.client.set(key, value, ex=round(ttl_s or store.config.conversation_ttl_s))
            store.answered()
        except StoreError as exc:
            store.failed("conversation_write", exc)
