"""A/B testing across router replicas: one split, one set of results, one reset.

Each replica writes its A/B results (router/dispatch/observe/ab.py's export) under its own key every
SHARE_S, kept RESULTS_TTL_S after its last write, and a report at any replica reads its peers' and merges
them with its own: `GET /admin/ab` says the same at every replica, a few seconds apart at most. A reset
(`POST /admin/ab/reset`) starts a new generation on the store: every replica drops its results when it sees
it (within SHARE_S), and results written under an older one are left out. A split set at runtime
(`PUT /admin/traffic`) is written with the file's split it replaced, and every replica whose file has that
split adopts it within SHARE_S; a new file's split leaves it behind. Without the store each replica reports
and changes its own, as a router alone does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import msgspec

from router.dispatch.observe.ab import ABStats, PolicyResults
from router.shared.store import SharedStore, StoreError

SHARE_S = 1.0
RESULTS_TTL_S = 600  # a replica gone this long leaves the results
_REFRESH_S = 60.0  # unchanged results are written again this often, within their time-to-live
_MAX_REPLICAS = 64  # results read at once: a key scan past it stops


class ReplicaResults(msgspec.Struct, array_like=True):
    generation: int
    policies: dict[str, PolicyResults]


class SharedSplit(msgspec.Struct, array_like=True):
    weights: dict[str, float]
    over: dict[str, float]  # the file's split when it was set


class SharedABResults:
    def __init__(
        self,
        store: SharedStore,
        router_id: str,
        stats: ABStats,
        file_split: Callable[[], Mapping[str, float]],
        adopt_split: Callable[[dict[str, float]], None],
    ) -> None:
        """file_split: the configuration's split now; adopt_split: sets the split in force (ValueError when it
        cannot)."""
        self._store, self._stats = store, stats
        self._file_split, self._adopt_split = file_split, adopt_split
        self._own_key = store.key("ab", "results", router_id)
        self._generation_key, self._split_key = store.key("ab", "generation"), store.key("ab", "split")
        self._generation: int | None = None
        self._written: tuple[int, int, float] | None = None  # generation, requests, when
        self._adopted: bytes | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._results = msgspec.msgpack.Decoder(ReplicaResults)
        self._split = msgspec.msgpack.Decoder(SharedSplit)
        stats.peers_results = self.peers

    async def share(self) -> None:
        """One round: a new generation seen (a reset elsewhere) drops this replica's results; a split set
        elsewhere is adopted; this replica's results are written when they changed."""
        store, now = self._store, time.monotonic()
        try:
            generation, split = await store.client.mget([self._generation_key, self._split_key])
            current = int(generation or 0)
            if self._generation is not None and current != self._generation:
                self._stats.reset()
            self._generation = current
            if isinstance(split, bytes) and split != self._adopted:
                self._adopt(split)
            requests, written = self._stats.requests, self._written
            due = written is None or written[:2] != (current, requests) or now - written[2] > _REFRESH_S
            if requests and due:
                results = self._encoder.encode(ReplicaResults(current, self._stats.export()))
                await store.client.set(self._own_key, results, ex=RESULTS_TTL_S)
                self._written = current, requests, now
            store.answered()
        except StoreError as exc:
            store.failed("ab", exc)

    async def peers(self) -> list[dict[str, PolicyResults]]:
        """The other replicas' results of this generation; none while the store does not answer."""
        store = self._store
        try:
            keys = []
            async for key in store.client.scan_iter(match=store.key("ab", "results", "*"), count=100):
                if key.decode() != self._own_key:
                    keys.append(key)
                if len(keys) >= _MAX_REPLICAS:
                    break
            values = await store.client.mget(keys) if keys else []
            store.answered()
        except StoreError as exc:
            store.failed("ab", exc)
            return []
        found = []
        for value in values:
            try:
                results = self._results.decode(value) if isinstance(value, bytes) else None
            except msgspec.DecodeError:  # written by another version
                continue
            if results is not None and results.generation == self._generation:
                found.append(results.policies)
        return found

    async def reset(self) -> None:
        """Every replica's results start afresh (this one's at once)."""
        self._stats.reset()
        store = self._store
        try:
            self._generation = await store.client.incr(self._generation_key)
            self._written = None
            store.answered()
        except StoreError as exc:
            store.failed("ab", exc)

    async def split_set(self, weights: Mapping[str, float]) -> None:
        """A split set here at runtime: every replica with the same file's split takes it."""
        value = self._encoder.encode(SharedSplit(dict(weights), dict(self._file_split())))
        store = self._store
        try:
            await store.client.set(self._split_key, value)
            self._adopted = value
            store.answered()
        except StoreError as exc:
            store.failed("ab", exc)

    def _adopt(self, value: bytes) -> None:
        self._adopted = value
        try:
            split = self._split.decode(value)
        except msgspec.DecodeError:
            return
        if split.over != dict(self._file_split()):  # set over another file's split: this one's stands
            return
        try:
            self._adopt_split(split.weights)
        except ValueError:  # names a policy this replica does not have
            pass
