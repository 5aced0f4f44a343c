"""Replicas' load snapshots over the shared store's publish/subscribe channel.

Each replica publishes its snapshot (router/upstreams/peer_sync.py: its load in flight per instance, its
flows' counts, sessions' placements and agent programs' turns) on the namespace's ``load`` channel every
shared.interval_s, from PeerSync's publish loop (send()), and follows the channel: every replica that
publishes there is a peer, with no list of addresses anywhere; one silent for shared.stale_after_s counts no
more. A snapshot stands alone, so one lost while the store is down is replaced
by the next once it is back: the shared state is whole again one interval after the store returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from router.shared.store import SharedStore, StoreError

MAX_SNAPSHOT_BYTES = 2**20  # larger messages on the channel are not a replica's: skipped unread
_FOLLOW_POLL_S = 1.0  # a wait for the next message, between which the subscription's health is checked


class SnapshotChannel:
    def __init__(
        self, store: SharedStore, receive: Callable[[bytes], None], skipped: Callable[[], None]
    ) -> None:
        """receive: a peer's snapshot (or this one's own, which it skips); skipped: a message too large to be
        a snapshot."""
        self._store, self._receive, self._skipped = store, receive, skipped
        self.channel = store.key("load")

    async def send(self, snapshot: bytes) -> None:
        """This replica's snapshot, published; given up (and counted) when the store does not take it."""
        store = self._store
        try:
            await store.client.publish(self.channel, snapshot)
            store.answered()
        except StoreError as exc:
            store.failed("publish", exc)

    async def follow(self) -> None:
        """Follow the channel; a lost subscription is made again once the store answers."""
        store = self._store
        while True:
            pubsub = store.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                while True:
                    message = await pubsub.get_message(timeout=_FOLLOW_POLL_S)
                    if message is None or message.get("type") != "message":
                        continue
                    data = message["data"]
                    if not isinstance(data, bytes) or len(data) > MAX_SNAPSHOT_BYTES:
                        self._skipped()
                        continue
                    self._receive(data)
            except StoreError as exc:
                store.failed("follow", exc)
                await asyncio.sleep(store.config.stale_after_s / 2)
            finally:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
