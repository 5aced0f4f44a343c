"""Follows one vLLM instance's KV events and hands them, in order and per owner, to a sink (the index).

Sequence numbers count from 0 per engine process and per data parallel rank, so each rank is tracked on its
own. A jump forward is a gap, filled from the instance's replay buffer; when it cannot be filled, the owner's
entries are dropped, as stale entries route worse than none. A jump back is a new engine process, whose
predecessor's blocks are gone, unless it is a batch already applied coming again (the live copy of a replayed
batch), which has the engine timestamp recorded for its number. Timestamps are only compared for equality:
engine clocks step, and a new process's may be behind its predecessor's.

A faulty or hostile publisher costs the rest of the router neither its event loop nor its memory: a replay
answer is cut (a failed replay) at bounds an engine's never reaches (router/index/replay.py), a message past
a size no engine step makes is refused, and a large batch is decoded and applied in steps, with turns for
other work between them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeAlias, runtime_checkable

import msgspec
import zmq
import zmq.asyncio

from router.index._zmq_drain import drain
from router.index.events import (
    END_OF_REPLAY,
    EVENT_TYPES,
    BlockStored,
    EncodedBatch,
    EventBatch,
    EventDecoder,
    KVEvent,
    MalformedBatch,
)
from router.index.ingest_turns import IngestTurns
from router.index.replay import ReplayClient, Replayed, ReplayFailed
from router.metrics import RouterMetrics
from router.supervisor import supervise

log = logging.getLogger(__name__)
_YIELD_EVERY = 256  # batches of a replay applied between turns given to the event loop
_RUN_BATCHES = 256  # queued batches taken at most into one run, which ends when the slice of its turn does
_DRAIN_BYTES = 1 << 20  # queued messages taken at once stop here (each may be up to max_message_bytes)
# The largest message taken (ZMQ's MAXMSGSIZE: libzmq drops the connection that carries a larger one). One
# event is decoded in one go, which nothing else on the event loop can interleave (msgspec holds the GIL: in a
# thread it stalls the loop as long), at 8-25 ms a MiB here: an event of 8 MiB held the loop 60-85 ms. vLLM
# publishes a batch per engine step, of at most its token budget's blocks and as many evictions: 32,768 tokens
# (its largest default, doubled) make 0.32 MB a KV cache group, 131,072 (no chunked prefill, a 128k context)
# 1.26 MB (tests/router/index/test_rogue_publisher.py measures these).
MAX_MESSAGE_BYTES = 8 * 2**20
# Messages libzmq queues here ahead of the subscriber (its RCVHWM). Past them TCP pushes back and the engine
# queues them itself, up to its own send queue of 100,000 (vLLM's hwm; a gap past it, replayed): a burst
# then costs the router about this many messages an instance (a batch of 32 blocks is ~4 KB) rather than the
# whole burst, whose memory the C allocator keeps once freed (`kvroute bench index`, a lone serve: 237 B of
# RSS a block at a 2M-block burst's end with 100,000, 103 B with 1,000, 73 B with 256; no slower).
RECEIVE_QUEUE_MESSAGES = 256
# A payload of at most this many bytes is decoded and applied in one go: batches of 1-32 blocks are 0.3-5 KB,
# and this much of the costliest content (one-byte events, each skipped) takes ~20 ms. A larger one goes in
# steps, with turns for the rest of the router between them.
_AT_ONCE_BYTES = 16 * 2**10
_STEP_BLOCKS = 4096  # blocks applied in a step: ~3 ms here
_STEP_EVENTS, _STEP_BYTES = 512, 256 * 2**10  # events decoded in a step: ~3 ms here
# Applied batches whose timestamps a rank's position keeps: the copies that come again are the live ones of a
# warm start's replay, published while it was read.
_REMEMBERED = 1024
_FOREIGN_STORES_NAMED = 4  # BlockStored events of another size, and none of block_size, before it is said

Owner: TypeAlias = tuple[str, int]
"""(instance name, data parallel rank); a batch without a rank belongs to rank 0."""

_Numbered: TypeAlias = tuple[int, EventBatch | EncodedBatch]
_Steps: TypeAlias = Callable[[Owner, Sequence[KVEvent], int], Iterator[None]]


class EventSink(Protocol):
    def apply(self, owner: Owner, events: Sequence[KVEvent]) -> None: ...

    def drop(self, owner: Owner) -> None: ...


@runtime_checkable
class SteppedSink(EventSink, Protocol):
    """A sink that can take a large batch in steps (BlockIndex); another one takes it in one."""

    def apply_in_steps(self, owner: Owner, events: Sequence[KVEvent], step_blocks: int) -> Iterator[None]: ...


@dataclass(slots=True)
class _Position:
    next_seq: int
    applied: OrderedDict[int, float] = field(default_factory=OrderedDict)  # seq -> ts, the latest ones


class Source(NamedTuple):
    """An engine's KV events: the instance's name, its publisher's endpoint, and its replay endpoint (None:
    it has none)."""

    instance: str
    endpoint: str
    replay: str | None = None


@dataclass(frozen=True)
class SubscriberOptions:
    replay_timeout_s: float = 2.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # The index's: an engine whose blocks are all of another size cannot be indexed, which is said once.
    block_size: int | None = None
    # The event loop's time for ingest, shared by a router's subscribers (None: this one's own).
    turns: IngestTurns | None = None


class KVEventSubscriber:
    """Keeps `sink` in step with one instance's events, recovering missed ones through `replay_endpoint`.

    ```
    source = Source("a", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5567")
    subscriber = KVEventSubscriber(source, index, metrics, context)
    task = asyncio.create_task(subscriber.run())
    ```
    """

    def __init__(
        self,
        source: Source,
        sink: EventSink,
        metrics: RouterMetrics,
        context: zmq.asyncio.Context,
        options: SubscriberOptions = SubscriberOptions(),
    ) -> None:
        instance, endpoint, replay_endpoint = source
        replay_timeout_s, max_message_bytes = options.replay_timeout_s, options.max_message_bytes
        self._turns = IngestTurns() if options.turns is None else options.turns
        self.instance = instance
        self._block_size = options.block_size
        self.foreign_block_size: int | None = None  # the engine's, once known to differ from block_size
        self._sizes_seen = [0, 0]  # BlockStored events of block_size and of others, since the engine began
        self._endpoint = endpoint
        self._sink, self._metrics, self._context = sink, metrics, context
        self._steps: _Steps = (
            sink.apply_in_steps if isinstance(sink, SteppedSink) else functools.partial(_at_once, sink)
        )
        self._max_message_bytes = max_message_bytes
        self._decoder = EventDecoder()
        self._positions: dict[int, _Position] = {}
        self._started_over: set[int] = set()  # ranks seen restarting since the load scraper last said so
        self._events = {kind: metrics.kv_events(instance, kind.__name__) for kind in EVENT_TYPES}
        # Events applied and the newest batch's timestamp since the metrics were last told: an update of a
        # metric costs more than a small batch's other bookkeeping, so they are told once a run of batches,
        # and whenever the event loop is given up (a scrape then reads them told).
        self._counted = dict.fromkeys(EVENT_TYPES, 0)
        self._newest_ts: float | None = None
        self._malformed = metrics.kv_malformed(instance)
        self._replayer: ReplayClient | None = None
        if replay_endpoint is not None:
            self._replayer = ReplayClient(
                replay_endpoint, self._socket, self._decoder, self._malformed.inc, replay_timeout_s
            )
        self._skipped = metrics.kv_skipped_events(instance)
        self._gaps = metrics.kv_gaps(instance)
        self._replays_ok = metrics.kv_replays(instance, "ok")
        self._replays_failed = metrics.kv_replays(instance, "failed")
        self._restarts = metrics.kv_restarts(instance)
        self._warm = metrics.kv_warm(instance)
        self._warm.set(0)
        self._last_event = metrics.kv_last_event(instance)

    async def run(self) -> None:
        """Follow the instance until cancelled; a failed session is logged, counted and started again."""
        await supervise(f"kv-events {self.instance}", self._session, 1.0, self._metrics.task_failures)

    def engine_restarted(self) -> None:
        """The instance is served by a new engine process (its /metrics said so). A rank whose sequence was
        seen starting over since the last such news follows that process already; the others are dropped and
        start afresh with their next batch, replayed from the engine's buffer from 0 when there is one."""
        for rank in list(self._positions):
            if rank not in self._started_over:
                self._restart(rank)
        self._started_over.clear()

    async def _session(self) -> None:
        sub = self._socket(zmq.SUB, self._endpoint)
        reconnecting = asyncio.create_task(self._reconnect_when_dropped(sub))
        try:
            await self._warm_start()
            run: collections.deque[list[bytes]] = collections.deque()
            turns = self._turns
            while True:
                if not run:
                    run.append(await sub.recv_multipart())
                await turns.take()  # the turns are given here (a message waiting already takes none)
                started = time.perf_counter()
                ends = turns.run_ends(started)
                # What is queued behind it, taken at once in C (router/index/_zmq_drain.pyx): without a future
                # and a loop turn each, and without pyzmq's 4 µs a message.
                run.extend(drain(sub.underlying, _RUN_BATCHES - len(run), _DRAIN_BYTES))
                first = True  # a run takes one batch at least, however little of the slice is left
                while run and (first or time.perf_counter() < ends):  # the rest waits for a later turn
                    first = False
                    numbered = self._parse(run.popleft())
                    if numbered is None:
                        continue
                    seq, batch = numbered
                    rank = batch.data_parallel_rank or 0
                    position = self._positions.get(rank)
                    if position is not None and seq == position.next_seq and type(batch) is EventBatch:
                        self._apply(rank, seq, batch)  # the next in order, as _accept would: no coroutine
                    else:
                        await self._accept(seq, batch, live=True)
                self._tell_metrics()
                turns.spent(started)
        finally:
            try:
                reconnecting.cancel()
                await asyncio.gather(reconnecting, return_exceptions=True)
            finally:
                sub.close(linger=0)
                self._tell_metrics()

    async def _reconnect_when_dropped(self, sub: zmq.asyncio.Socket) -> None:
        """libzmq drops a connection that sends a message over MAXMSGSIZE and never reconnects it (a protocol
        error, unlike a lost peer): connect again, and the next batch's sequence gap is handled as any gap."""
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await monitor.recv_multipart()
                log.info("KV events connection to %s dropped; connecting again", self.instance)
                try:
                    sub.disconnect(self._endpoint)
                    sub.connect(self._endpoint)
                except zmq.ZMQError as exc:  # the socket goes on as libzmq left it; the next drop retries
                    log.warning("could not reconnect to %s's KV events: %s", self.instance, exc)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)

    async def _warm_start(self) -> None:
        """Rebuild from the engine's buffer what a restarted router would otherwise never learn, applying its
        batches as they come (a buffer may be larger than a router would hold at once). A session started
        again goes on from its positions instead: its next batch shows what it missed, as a gap."""
        if self._replayer is None or self._positions:
            return
        try:
            async with contextlib.aclosing(self._replayer.batches(0)) as replayed:
                async for seq, batch in replayed:
                    await self._accept(seq, batch, live=False)
                    self._tell_metrics()  # the next batch is awaited
        except ReplayFailed:
            self._replays_failed.inc()  # what came is applied: its next batch replays the rest, as a gap
            return
        finally:
            self._tell_metrics()
        self._replays_ok.inc()
        self._warm.set(1)

    async def _accept(self, seq: int, batch: EventBatch | EncodedBatch, live: bool) -> None:
        """Apply a batch in sequence; a gap before a live batch is replayed, one inside a replay cannot be."""
        rank = batch.data_parallel_rank or 0
        position = self._positions.get(rank)
        if position is not None and seq < position.next_seq:
            if position.applied.get(seq) == batch.ts:
                return  # the live copy of a batch a replay applied
            self._restart(rank)
            position = None
        if position is not None:
            expected = position.next_seq
        elif live and self._replayer is not None:
            expected = 0  # a process we have not followed yet: its history is in the buffer from 0
        else:
            expected = seq  # the oldest batch still to be had is where history begins
        if seq > expected:
            self._gaps.inc()
            replayed = None
            if live:
                # From one batch earlier: if the batch applied last comes back different, a new process has
                # passed our position (its sequence restarted at 0), so its whole history is needed instead.
                start = expected - 1 if position is not None and expected else expected
                replayed = await self._replay(start, rank, seq)
                if self._positions.get(rank) is not position:  # dropped meanwhile, as engine_restarted does
                    return await self._accept(seq, batch, live)
                if position is not None and replayed and _restarted(replayed, rank, expected - 1, position):
                    self._restart(rank)
                    expected, replayed = 0, await self._replay(0, rank, seq)
            if not await self._fill(rank, expected, seq, replayed):
                return await self._accept(seq, batch, live)
        if isinstance(batch, EventBatch):
            self._apply(rank, seq, batch)
        else:
            await self._apply_encoded(rank, seq, batch)

    async def _fill(self, rank: int, start: int, end: int, replayed: list[Replayed] | None) -> bool:
        """Apply the batches start..end-1 of rank; drop the owner first when some of them are lost. False
        when rank was dropped meanwhile (a long gap gives the event loop turns, as engine_restarted may)."""
        mine = {seq: batch for seq, batch in replayed or () if (batch.data_parallel_rank or 0) == rank}
        first = end
        while first > start and first - 1 in mine:
            first -= 1
        if first == start:
            self._replays_ok.inc()
        else:
            self._replays_failed.inc()
            self._drop(rank)  # what follows the lost batches is still true, so it is applied after the drop
        for number, seq in enumerate(range(first, end), start=1):
            position = await self._apply_encoded(rank, seq, mine[seq])
            if number % _YIELD_EVERY == 0:
                await self._pause()  # a gap of thousands of batches must not stall every other request
            if self._positions.get(rank) is not position:
                return False
        return True

    def _apply(self, rank: int, seq: int, batch: EventBatch) -> _Position:
        """Apply batch seq of rank; the position it advanced."""
        position = self._advance(rank, seq, batch.ts)
        checking, counted = self._checking_block_size(), self._counted
        for event in batch.events:  # as _observe does: inline, as every live batch comes this way
            counted[type(event)] += 1
            if checking and type(event) is BlockStored:
                self._check_block_size(event)
        if batch.skipped_events:
            self._skipped.inc(batch.skipped_events)
        try:
            self._sink.apply((self.instance, rank), batch.events)
        except Exception:
            log.exception("the KV event sink failed on a batch from %s rank %d", self.instance, rank)
        return position

    async def _apply_encoded(self, rank: int, seq: int, batch: EncodedBatch) -> _Position:
        """_apply for a batch whose events are still encoded: a large one is decoded and applied in steps,
        between which engine_restarted may drop rank (the position returned is then no longer rank's)."""
        if batch.size <= _AT_ONCE_BYTES:
            return self._apply(rank, seq, self._decoder.complete(batch))
        position = self._advance(rank, seq, batch.ts)
        await self._apply_in_steps(rank, position, batch)
        return position

    def _advance(self, rank: int, seq: int, ts: float) -> _Position:
        position = self._positions.get(rank)
        if position is None:
            position = self._positions[rank] = _Position(seq)
        position.next_seq = seq + 1
        applied = position.applied
        applied[seq] = ts
        if len(applied) > _REMEMBERED:
            applied.popitem(last=False)
        self._newest_ts = ts
        return position

    async def _apply_in_steps(self, rank: int, position: _Position, batch: EncodedBatch) -> None:
        """A large batch, decoded and applied in steps with turns for the rest of the router between them.
        Left when rank is dropped meanwhile (the rest would be dropped too); dropped when cancelled midway,
        as what rank holds is then neither before nor after it."""
        try:
            events: list[KVEvent] = []
            for part in _parts(self._decoder.items(batch)):
                decoded, skipped = self._decoder.events(part)
                self._observe(decoded, skipped)
                events += decoded
                await self._pause()
                if self._positions.get(rank) is not position:
                    return
            try:
                for _ in self._steps((self.instance, rank), events, _STEP_BLOCKS):
                    await self._pause()
                    if self._positions.get(rank) is not position:
                        return
            except Exception:
                log.exception("the KV event sink failed on a batch from %s rank %d", self.instance, rank)
        except asyncio.CancelledError:
            if self._positions.get(rank) is position:
                self._drop(rank)
            raise

    def _observe(self, events: Sequence[KVEvent], skipped: int) -> None:
        """Count events of a batch applied (and skipped ones), and learn the engine's block size from them."""
        checking, counted = self._checking_block_size(), self._counted
        for event in events:
            counted[type(event)] += 1
            if checking and type(event) is BlockStored:
                self._check_block_size(event)
        if skipped:
            self._skipped.inc(skipped)

    async def _pause(self) -> None:
        """A turn for the rest of the router, the metrics told first."""
        self._tell_metrics()
        await asyncio.sleep(0)

    def _tell_metrics(self) -> None:
        """The events counted and the newest timestamp seen since the metrics were last told."""
        for kind, count in self._counted.items():
            if count:
                self._events[kind].inc(count)
                self._counted[kind] = 0
        if self._newest_ts is not None:
            self._last_event.set(self._newest_ts)
            self._newest_ts = None

    def _checking_block_size(self) -> bool:
        """Whether stores are still to be checked: once one of block_size came, the engine's is the index's
        until it restarts."""
        return self._block_size is not None and not self._sizes_seen[0]

    def _check_block_size(self, event: BlockStored) -> None:
        """vLLM also stores blocks of other sizes in passing: partial blocks, an offloading connector's
        placeholders of size 0, other KV cache groups' blocks. An engine of another size stores nothing of
        block_size: it is named once a few of its stores came and none of that size."""
        size = event.block_size
        if size <= 0 or not event.token_ids or event.group_idx not in (None, 0):
            return
        seen = self._sizes_seen
        seen[size != self._block_size] += 1
        if seen[0] == 0 and seen[1] >= _FOREIGN_STORES_NAMED and self.foreign_block_size is None:
            self.foreign_block_size = size
            log.error(
                "%s publishes KV blocks of %d tokens but block_size is %d: the index cannot hold them, so "
                "routing ignores what %s has cached; set block_size: %d (the engines' --block-size)",
                self.instance,
                size,
                self._block_size,
                self.instance,
                size,
            )

    def _restart(self, rank: int) -> None:
        """rank's events come from a new engine process: its predecessor's blocks are gone."""
        self._restarts.inc()
        self.foreign_block_size, self._sizes_seen = None, [0, 0]  # it may run another block size
        self._drop(rank)
        self._started_over.add(rank)

    def _drop(self, rank: int) -> None:
        self._positions.pop(rank, None)
        try:
            self._sink.drop((self.instance, rank))
        except Exception:
            log.exception("the KV event sink failed to drop %s rank %d", self.instance, rank)

    async def _replay(self, start: int, rank: int, end: int) -> list[Replayed] | None:
        """rank's buffered batches numbered start to end - 1 (those still buffered); None when there is no
        replay endpoint or the replay fails."""
        if self._replayer is None:
            return None
        self._tell_metrics()
        return await self._replayer.kept(start, rank, end)

    def _parse(self, frames: list[bytes]) -> _Numbered | None:
        """[topic, seq, payload] as (seq, batch); anything else is counted and yields None. A large payload's
        events are left encoded, to be decoded in steps."""
        if len(frames) == 3 and len(frames[1]) == 8 and frames[1] != END_OF_REPLAY:
            seq, payload = int.from_bytes(frames[1], "big"), frames[2]  # unpack_seq's, inline: every message
            try:
                if len(payload) > _AT_ONCE_BYTES:
                    return seq, self._decoder.envelope(payload)
                return seq, self._decoder.decode(payload)
            except MalformedBatch:
                pass
        self._malformed.inc()
        return None

    def _socket(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        if endpoint.startswith("tcp://["):
            # libzmq reaches IPv6 addresses only with this; as vLLM, not for names, which it would then
            # resolve to their IPv6 address alone (localhost to ::1 when the engine binds 127.0.0.1).
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        return sock


def _at_once(sink: EventSink, owner: Owner, events: Sequence[KVEvent], step_blocks: int) -> Iterator[None]:
    """A sink that cannot take a batch in steps takes it in one."""
    sink.apply(owner, events)
    yield from ()


def _parts(items: list[msgspec.Raw]) -> Iterator[list[msgspec.Raw]]:
    """items in runs of at most _STEP_EVENTS events and about _STEP_BYTES bytes: one step's decoding each."""
    start = size = 0
    for end, item in enumerate(items, start=1):
        size += len(item)
        if end - start >= _STEP_EVENTS or size >= _STEP_BYTES:
            yield items[start:end]
            start, size = end, 0
    if start < len(items):
        yield items[start:]


def _restarted(replayed: list[Replayed], rank: int, seq: int, position: _Position) -> bool:
    """Whether the buffered batch seq of rank is not the one applied as seq (told by its engine timestamp)."""
    for found_seq, batch in replayed:
        if found_seq == seq and (batch.data_parallel_rank or 0) == rank:
            return batch.ts != position.applied.get(seq)
    return False  # no longer buffered: nothing tells, and a gap is the likelier story
