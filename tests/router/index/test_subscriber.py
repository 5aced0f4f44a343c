"""The KV event subscriber: real vLLM frames, gaps, restarts, warm starts, garbage, DP ranks, a real fleet."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import zmq
import zmq.asyncio

from fleet.publisher import EventPublisher
from kvroute.processes import FleetPorts, free_port_block, running_fleet
from router.config import RouterConfig, parse_config
from router.index import subscriber as kv_subscriber
from router.index.block_index import BlockIndex
from router.index.events import (
    END_OF_REPLAY,
    MAX_DATA_PARALLEL_RANK,
    BlockRemoved,
    BlockStored,
    EventDecoder,
    EventEncoder,
    KVEvent,
    pack_seq,
)
from router.index.subscriber import KVEventSubscriber, Owner, Source, SubscriberOptions
from router.metrics import RouterMetrics
from router.runtime import Runtime
from scorers.request import TierMatch
from tests.conftest import ipv6_loopback
from tests.router.index.test_block_index import BS, TOKENS, prompt, stored

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm"
TOPIC = b"kv@a@tiny-llama"
A0: Owner = ("a", 0)
TIMEOUT_S = 10.0


class RecordingSink:
    """Records applies and drops in order; raises on the batches whose first block hash is in fail_on."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Owner, list[KVEvent]]] = []
        self.fail_on: set[int] = set()
        self._changed = asyncio.Event()

    def apply(self, owner: Owner, events: Sequence[KVEvent]) -> None:
        self._changed.set()
        if events and isinstance(events[0], BlockRemoved) and events[0].block_hashes[0] in self.fail_on:
            raise RuntimeError("the sink is broken")
        self.log.append(("apply", owner, list(events)))

    def drop(self, owner: Owner) -> None:
        self.log.append(("drop", owner, []))
        self._changed.set()

    def ids(self, owner: Owner = A0) -> list[int | str]:
        """Each applied batch as its first block hash (see batch()), each drop as "drop"."""
        return [
            "drop" if kind == "drop" else int(events[0].block_hashes[0])  # type: ignore[union-attr]
            for kind, who, events in self.log
            if who == owner
        ]

    async def wait_for(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(TIMEOUT_S):
            while not done():
                self._changed.clear()
                await self._changed.wait()

    async def wait_applied(self, count: int) -> None:
        await self.wait_for(lambda: sum(kind == "apply" for kind, _, _ in self.log) >= count)


def batch(n: int) -> list[KVEvent]:
    """A batch the tests can recognise by n."""
    return [BlockRemoved(block_hashes=[n], medium="GPU")]


class FakeEngine:
    """Publishes like vLLM, on XPUB so that a test can wait for the subscription; can hide batches from PUB
    (they stay in the replay buffer), send raw frames, and hold its replay answers until released."""

    def __init__(self, endpoint: str, replay_endpoint: str | None) -> None:
        self._encoder = EventEncoder()
        self._context = context = zmq.asyncio.Context()  # its own, like a separate engine process
        ipv6 = endpoint.startswith("tcp://[")
        self._pub = context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.IPV6, ipv6)
        self._pub.bind(endpoint)
        self._next_seq: dict[int, int] = {}
        self.buffer: list[tuple[int, bytes]] = []
        self.answer_replay = asyncio.Event()
        self.answer_replay.set()
        self.replay_asked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        if replay_endpoint is not None:
            replay = context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.setsockopt(zmq.IPV6, ipv6)
            replay.bind(replay_endpoint)
            self._task = asyncio.create_task(self._serve(replay))

    async def subscribed(self) -> None:
        """Until a subscriber joins; a leaving one's unsubscription is passed over."""
        async with asyncio.timeout(TIMEOUT_S):
            while await self._pub.recv() != b"\x01":
                pass

    def publish(
        self, events: list[KVEvent], rank: int | None = None, send: bool = True, ts: float | None = None
    ) -> int:
        seq = self._next_seq.get(rank or 0, 0)
        self._next_seq[rank or 0] = seq + 1
        payload = self._encoder.encode(time.time() if ts is None else ts, events, rank)
        self.buffer.append((seq, payload))
        if send:
            self.send([TOPIC, pack_seq(seq), payload])
        return seq

    def send(self, frames: Sequence[bytes]) -> None:
        self._pub.send_multipart(frames)

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            client, _, start = await sock.recv_multipart()
            self.replay_asked.set()
            await self.answer_replay.wait()
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await sock.send_multipart([client, b"", TOPIC, pack_seq(seq), payload])
            await sock.send_multipart([client, b"", b"", END_OF_REPLAY, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._context.destroy(linger=0)  # returns once the ports are released: a restart can bind them


class IndexingSink(RecordingSink):
    """Records as RecordingSink does, and keeps a real index."""

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex(BS)

    def apply(self, owner: Owner, events: Sequence[KVEvent]) -> None:
        self.index.apply(owner, events)
        super().apply(owner, events)

    def drop(self, owner: Owner) -> None:
        self.index.drop(owner)
        super().drop(owner)


class Harness:
    def __init__(
        self,
        replay: bool,
        replay_timeout_s: float = 2.0,
        max_message_bytes: int = 64 * 2**20,
        sink: RecordingSink | None = None,
        host: str = "127.0.0.1",
        block_size: int | None = None,
    ) -> None:
        port = free_port_block(2)
        self.endpoint = f"tcp://{host}:{port}"
        self.replay_endpoint = f"tcp://{host}:{port + 1}" if replay else None
        self.context = zmq.asyncio.Context()
        self.sink = sink or RecordingSink()
        self.metrics = RouterMetrics()
        self.subscriber = KVEventSubscriber(
            Source("a", self.endpoint, self.replay_endpoint),
            self.sink,
            self.metrics,
            self.context,
            SubscriberOptions(replay_timeout_s, max_message_bytes, block_size),
        )

    def engine(self) -> FakeEngine:
        return FakeEngine(self.endpoint, self.replay_endpoint)

    async def first_batch_applied(self, engine: FakeEngine) -> None:
        """Once the subscriber has connected and warmed up: the engine's first batch, published and applied."""
        await self.subscribed(engine)
        engine.publish(batch(0))
        await self.sink.wait_applied(1)

    async def subscribed(self, engine: FakeEngine) -> None:
        """Once the subscriber follows engine's events and its warm start is over: what engine publishes
        from now on comes live, not in the warm start's replay."""
        await engine.subscribed()
        await self.warmed()

    async def warmed(self) -> None:
        """Once the warm start's replay has ended (or failed): its batches are applied as they come, so their
        being applied does not tell that it is over, and its result is counted only at its end."""
        if self.replay_endpoint is None:
            return
        async with asyncio.timeout(TIMEOUT_S):
            while True:  # a metric to look at: no event tells of it
                if self.count("kvroute_kv_warm") or self.count("kvroute_kv_replays_total", result="failed"):
                    return
                await asyncio.sleep(0.005)

    def count(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, {"vllm_instance": "a", **labels})
        return value or 0.0

    def counts(self) -> dict[str, float]:
        return {
            "gaps": self.count("kvroute_kv_sequence_gaps_total"),
            "ok": self.count("kvroute_kv_replays_total", result="ok"),
            "failed": self.count("kvroute_kv_replays_total", result="failed"),
            "restarts": self.count("kvroute_kv_engine_restarts_total"),
            "malformed": self.count("kvroute_kv_malformed_messages_total"),
            "skipped": self.count("kvroute_kv_skipped_events_total"),
        }

    async def settled_counts(self, quiet_s: float = 0.2) -> dict[str, float]:
        """counts() once they stay the same for quiet_s: a replay the subscription made as it started may be
        counted a moment after the batch it brought is applied (later on a busy machine)."""
        counts = self.counts()
        while True:
            await asyncio.sleep(quiet_s)
            if (now := self.counts()) == counts:
                return counts
            counts = now

    def since(self, before: dict[str, float] | None = None) -> dict[str, float]:
        """The counts that changed (since the start, without before)."""
        before = before or {}
        return {
            name: value - before.get(name, 0.0)
            for name, value in self.counts().items()
            if value != before.get(name, 0.0)
        }

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[asyncio.Task[None]]:
        task = asyncio.create_task(self.subscriber.run())
        try:
            yield task
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.context.destroy(linger=0)


def _frames(path: Path) -> list[list[bytes]]:
    return msgspec.msgpack.decode(path.read_bytes())  # type: ignore[no-any-return]


@pytest.mark.parametrize("capture", ["events_int.msgpack", "events_bytes.msgpack"])
def test_real_vllm_frames_arrive_decoded_in_order(capture: str) -> None:
    frames = _frames(FIXTURES / capture)
    expected = [EventDecoder().decode(payload).events for _, _, payload in frames]

    async def main() -> None:
        harness = Harness(replay=False)
        engine = harness.engine()
        async with harness.running():
            await engine.subscribed()
            for frame in frames:
                engine.send(frame)
            await harness.sink.wait_applied(len(frames))
        await engine.close()
        assert harness.sink.log == [("apply", A0, events) for events in expected]
        assert any(isinstance(e, BlockStored) for events in expected for e in events)
        assert harness.count("kvroute_kv_events_total", type="BlockStored") > 0
        newest = EventDecoder().decode(frames[-1][2]).ts
        assert harness.count("kvroute_kv_last_event_timestamp_seconds") == newest
        assert harness.since() == {}

    asyncio.run(main())


def test_a_gap_is_filled_from_the_replay_buffer() -> None:
    async def main() -> None:
        harness = Harness(replay=True)
        engine = harness.engine()
        async with harness.running():
            await harness.first_batch_applied(engine)
            before = harness.counts()
            engine.publish(batch(1), send=False)
            engine.publish(batch(2))
            engine.publish(batch(3))
            await harness.sink.wait_applied(4)
        await engine.close()
        assert harness.sink.ids() == [0, 1, 2, 3]
        assert harness.since(before) == {"gaps": 1, "ok": 1}

    asyncio.run(main())


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
def test_an_engine_at_an_ipv6_address_is_followed_and_replayed() -> None:
    async def main() -> None:
        harness = Harness(replay=True, host="[::1]")
        engine = harness.engine()
        async with harness.running():
            await harness.first_batch_applied(engine)
            before = harness.counts()
            engine.publish(batch(1), send=False)  # a gap: the replay socket is asked for it
            engine.publish(batch(2))
            await harness.sink.wait_applied(3)
        await engine.close()
        assert harness.sink.ids() == [0, 1, 2]
        assert harness.since(before) == {"gaps": 1, "ok": 1}

    asyncio.run(main())


class TurnCountingSink(RecordingSink):
    """Records, with each batch, how many turns another task had had on the event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.turns = 0
        self.turns_at_apply: list[int] = []

    def apply(self, owner: Owner, events: Sequence[KVEvent]) -> None:
        self.turns_at_apply.append(self.turns)
        super().apply(owner, events)


def test_a_long_gap_is_filled_in_turns_with_the_rest_of_the_router() -> None:
    sink = TurnCountingSink()

    async def other_work() -> None:
        while True:
            sink.turns += 1
            await asyncio.sleep(0)

    async def main() -> None:
        harness = Harness(replay=True, sink=sink)
        engine = harness.engine()
        async with harness.running():
            await harness.first_batch_applied(engine)
            for n in range(1, 1000):
                engine.publish(batch(n), send=False)
            working = asyncio.create_task(other_work())
            engine.publish(batch(1000))
            await harness.sink.wait_applied(1001)
            working.cancel()
        await engine.close()
        assert harness.sink.ids() == list(range(1001))

    asyncio.run(main())
    filled = sink.turns_at_apply[1:1000]
    assert filled[-1] - filled[0] >= 3  # at least one turn in every 256 batches


def test_a_message_over_the_size_limit_never_reaches_the_decoder_and_leaves_a_gap() -> None:
    async def main() -> None:
        harness = Harness(replay=False, max_message_bytes=4096)
        engine = harness.engine()
        async with harness.running():
            await harness.first_batch_applied(engine)
            before = harness.counts()
            engine.publish([BlockRemoved(block_hashes=list(range(10, 3000)), medium="GPU")])  # ~9 KB
            # ZMQ drops the connection that carried it and reconnects; batches sent meanwhile are lost too.
            n = 3000
            async with asyncio.timeout(TIMEOUT_S):
                while not any(isinstance(i, int) and i >= 3000 for i in harness.sink.ids()):
                    engine.publish(batch(n))
                    n += 1
                    await asyncio.sleep(0.05)
        await engine.close()
        ids = harness.sink.ids()
        assert ids[:2] == [0, "drop"] and all(i == "drop" or i >= 3000 for i in ids[2:])  # never batch 10
        assert harness.since(before)["gaps"] >= 1

    asyncio.run(main())


@pytest.mark.parametrize("replay", ["none", "silent"])
def test_a_gap_that_cannot_be_replayed_drops_the_owner(replay: str) -> None:
    async def main() -> None:
        harness = Harness(replay=replay == "silent", replay_timeout_s=0.2)
        engine = harness.engine()
        engine.answer_replay.clear()
        async with harness.running():
            await harness.first_batch_applied(engine)
            before = harness.counts()
            engine.publish(batch(1), send=False)
            engine.publish(batch(2))
            await harness.sink.wait_applied(2)
        await engine.close()
        assert harness.sink.ids() == [0, "drop", 2]
        assert harness.since(before) == {"gaps": 1, "failed": 1}

    asyncio.run(main())


@pytest.mark.parametrize(
    ("missed", "newest", "counted"),
    [
        (0, 101, {"restarts": 1}),  # the new process's first batch arrives: its seq went backwards
        (1, 101, {"restarts": 1, "gaps": 1, "ok": 1}),  # its first batch is missed: replayed from 0
        (5, 105, {"restarts": 1, "gaps": 1, "ok": 1}),  # first seen past the old seq: hidden behind a gap
    ],
)
def test_an_engine_restart_drops_the_owner_once(missed: int, newest: int, counted: dict[str, float]) -> None:
    async def main() -> None:
        harness = Harness(replay=True)
        old = harness.engine()
        async with harness.running():
            await harness.subscribed(old)
            for n in range(3):
                old.publish(batch(n))
            await harness.sink.wait_applied(3)
            await old.close()
            before = harness.counts()
            new = harness.engine()
            await new.subscribed()
            for n in range(100, newest + 1):
                new.publish(batch(n), send=n >= 100 + missed)  # missed ones stay in the new buffer only
            await harness.sink.wait_applied(3 + newest - 99)
            await new.close()
        assert harness.sink.ids() == [0, 1, 2, "drop", *range(100, newest + 1)]
        assert harness.since(before) == counted

    asyncio.run(main())


def test_a_warm_start_recovers_what_was_published_before() -> None:
    async def main() -> None:
        harness = Harness(replay=True)
        assert harness.replay_endpoint is not None
        publisher = EventPublisher(harness.endpoint, harness.replay_endpoint, TOPIC.decode())
        publisher.start()
        for n in range(3):
            publisher.publish(batch(n))
        assert harness.count("kvroute_kv_warm") == 0
        async with harness.running():
            await harness.sink.wait_applied(3)
            await harness.warmed()
        await publisher.close()
        assert harness.sink.ids() == [0, 1, 2]
        assert harness.since() == {"ok": 1}
        assert harness.count("kvroute_kv_warm") == 1

    asyncio.run(main())


def test_live_copies_of_replayed_batches_are_ignored() -> None:
    async def main() -> None:
        harness = Harness(replay=True)
        engine = harness.engine()
        engine.answer_replay.clear()  # the warm start waits while the live batches queue up
        async with harness.running():
            await engine.subscribed()
            for n in range(3):
                engine.publish(batch(n))
            engine.answer_replay.set()
            await harness.sink.wait_applied(3)
            engine.publish(batch(3))
            await harness.sink.wait_applied(4)
        await engine.close()
        assert harness.sink.ids() == [0, 1, 2, 3]
        assert harness.since() == {"ok": 1}

    asyncio.run(main())


def test_garbage_is_counted_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    good = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    good_and_bad = msgspec.msgpack.encode([time.time(), [good, {"type": "Nope"}], 0])
    garbage: list[list[bytes]] = [
        [TOPIC, pack_seq(1)],  # two frames
        [TOPIC, pack_seq(1), good_and_bad, b"extra"],  # four
        [TOPIC, b"\x01", good_and_bad],  # a one-byte seq
        [TOPIC, END_OF_REPLAY, good_and_bad],  # the replay end marker, live
        [TOPIC, pack_seq(1), b"\xc1 not msgpack"],
        [TOPIC, pack_seq(1), msgspec.msgpack.encode([1.0, "not a list"])],
    ]

    async def main() -> None:
        harness = Harness(replay=False)
        engine = harness.engine()
        harness.sink.fail_on.add(2)
        async with harness.running() as task:
            await harness.first_batch_applied(engine)
            before = harness.counts()
            for frames in garbage:
                engine.send(frames)
            engine.send([TOPIC, pack_seq(1), good_and_bad])
            engine.publish(batch(1), send=False)  # keep the engine's numbering in step
            engine.publish(batch(2))  # the sink raises on this one
            engine.publish(batch(3))
            await harness.sink.wait_applied(3)
            assert not task.done()
        await engine.close()
        assert harness.sink.ids() == [0, 1, 3]
        assert harness.since(before) == {"malformed": len(garbage), "skipped": 1}
        assert "the KV event sink failed" in caplog.text

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())


def _sized(first: int, size: int, **fields: Any) -> BlockStored:
    """One stored block of size tokens."""
    return msgspec.structs.replace(stored(first, 1), block_size=size, token_ids=TOKENS[:size], **fields)


def _named(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "publishes KV blocks" in r.getMessage()]


def test_an_engine_of_another_block_size_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        harness = Harness(replay=False, block_size=BS * 2)
        engine = harness.engine()
        async with harness.running():
            await harness.first_batch_applied(engine)  # removals carry no block size
            for first in range(6):
                engine.publish([_sized(first, BS)])
            await harness.sink.wait_applied(7)
            assert harness.subscriber.foreign_block_size == BS
            harness.subscriber.engine_restarted()  # a new engine process, which may run another size
            assert harness.subscriber.foreign_block_size is None
        await engine.close()
        assert _named(caplog) == [
            f"a publishes KV blocks of {BS} tokens but block_size is {BS * 2}: the index cannot hold them, so "
            f"routing ignores what a has cached; set block_size: {BS} (the engines' --block-size)"
        ]

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())


def test_blocks_of_other_sizes_beside_the_engines_own_are_no_mismatch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM 0.32 publishes some in passing: partial blocks, an offloading connector's placeholders of size 0,
    other KV cache groups' blocks."""
    size = BS * 2

    async def main() -> None:
        harness = Harness(replay=False, block_size=size)
        engine = harness.engine()
        async with harness.running():
            await harness.first_batch_applied(engine)
            engine.publish([_sized(0, size)])
            for first in range(1, 9):
                engine.publish([_sized(first, 0), _sized(first, BS - 1), _sized(first, BS, group_idx=1)])
            await harness.sink.wait_applied(10)
        await engine.close()
        assert harness.subscriber.foreign_block_size is None
        assert _named(caplog) == []

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())


def test_data_parallel_ranks_are_tracked_and_owned_separately() -> None:
    async def main() -> None:
        harness = Harness(replay=True)
        engine = harness.engine()
        async with harness.running():
            await engine.subscribed()
            engine.publish(batch(10), rank=1)
            await harness.sink.wait_applied(1)
            before = await harness.settled_counts()
            engine.publish(batch(11), rank=1, send=False)  # rank 1 seq 1, only in the shared replay buffer
            for n, rank in enumerate([0, None, 0]):  # rank 0 seqs 0-2: the same numbers, another owner
                engine.publish(batch(n), rank=rank)
            engine.publish(batch(12), rank=1)
            await harness.sink.wait_applied(6)
        await engine.close()
        assert harness.sink.ids(("a", 0)) == [0, 1, 2]
        assert harness.sink.ids(("a", 1)) == [10, 11, 12]
        assert harness.since(before) == {"gaps": 1, "ok": 1}

    asyncio.run(main())


def test_a_rank_out_of_range_is_malformed_and_owns_nothing() -> None:
    async def main() -> None:
        harness = Harness(replay=False)
        engine = harness.engine()
        async with harness.running():
            await engine.subscribed()
            engine.publish(batch(5), rank=MAX_DATA_PARALLEL_RANK + 1)
            engine.publish(batch(6), rank=-1)
            engine.publish(batch(0), rank=MAX_DATA_PARALLEL_RANK)
            await harness.sink.wait_applied(1)
        await engine.close()
        assert harness.sink.ids(("a", MAX_DATA_PARALLEL_RANK)) == [0]
        assert {owner for _, owner, _ in harness.sink.log} == {("a", MAX_DATA_PARALLEL_RANK)}
        assert harness.since() == {"malformed": 2}

    asyncio.run(main())


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("sent", "ids", "counted"),
    [
        # The same batch again is a copy.
        ([(0, 1000.0, 0), (1, 1001.0, 1), (1, 1001.0, 1), (2, 1002.0, 2)], [0, 1, 2], {}),
        # A new process whose clock is behind its predecessor's: its first batch is no copy.
        ([(0, 1000.0, 0), (1, 1001.0, 1), (0, 500.0, 100)], [0, 1, "drop", 100], {"restarts": 1}),
        # An infinite timestamp is malformed: it cannot make a new process's batches look old ...
        ([(0, 1000.0, 0), (1, INF, 1), (0, 2000.0, 100)], [0, "drop", 100], {"restarts": 1, "malformed": 1}),
        # ... nor NaN, which equals nothing, make every batch look new.
        ([(0, NAN, 0), (0, NAN, 0), (0, 1000.0, 100)], [100], {"malformed": 2}),
    ],
)
def test_a_batch_numbered_behind_is_a_copy_only_with_the_timestamp_recorded_for_its_number(
    sent: list[tuple[int, float, int]], ids: list[int | str], counted: dict[str, float]
) -> None:
    async def main() -> None:
        harness = Harness(replay=False)
        engine = harness.engine()
        encoder = EventEncoder()
        async with harness.running():
            await engine.subscribed()
            for seq, ts, n in sent:
                engine.send([TOPIC, pack_seq(seq), encoder.encode(ts, batch(n))])
            await harness.sink.wait_for(lambda: len(harness.sink.log) >= len(ids))
        await engine.close()
        assert harness.sink.ids() == ids
        assert harness.since() == counted

    asyncio.run(main())


def test_a_clock_stepping_back_is_no_restart_when_a_gap_is_replayed() -> None:
    async def main() -> None:
        harness = Harness(replay=True)
        engine = harness.engine()
        async with harness.running():
            await harness.subscribed(engine)
            engine.publish(batch(0), ts=1000.0)
            engine.publish(batch(1), ts=900.0)  # the engine's clock was set back
            await harness.sink.wait_applied(2)
            before = harness.counts()
            engine.publish(batch(2), ts=901.0, send=False)
            engine.publish(batch(3), ts=902.0)
            await harness.sink.wait_applied(4)
        await engine.close()
        assert harness.sink.ids() == [0, 1, 2, 3]
        assert harness.since(before) == {"gaps": 1, "ok": 1}

    asyncio.run(main())


def test_a_session_started_again_goes_on_from_its_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its next batch replays what it missed; the whole buffer again would be older than the timestamps kept."""
    monkeypatch.setattr(kv_subscriber, "_REMEMBERED", 2)

    async def main() -> None:
        harness = Harness(replay=True)
        decode = harness.subscriber._decoder.decode

        def failing(payload: bytes) -> Any:
            if payload == b"boom":
                raise RuntimeError("the session fails")
            return decode(payload)

        monkeypatch.setattr(harness.subscriber._decoder, "decode", failing)
        engine = harness.engine()
        async with harness.running():
            await engine.subscribed()
            await asyncio.wait_for(
                engine.replay_asked.wait(), TIMEOUT_S
            )  # the warm start has its (empty) buffer
            for n in range(5):
                engine.publish(batch(n))
            await harness.sink.wait_applied(5)
            engine.send([TOPIC, pack_seq(5), b"boom"])
            await engine.subscribed()  # the next session's
            engine.publish(batch(5), send=False)  # published while it was down
            engine.publish(batch(6))
            await harness.sink.wait_applied(7)
        await engine.close()
        assert harness.sink.ids() == [0, 1, 2, 3, 4, 5, 6]
        assert harness.since() == {"ok": 2, "gaps": 1}  # the warm start, the gap

    asyncio.run(main())


def test_news_of_a_restart_the_subscriber_has_seen_keeps_the_new_processs_blocks() -> None:
    """The load scraper notices the new process after the subscriber did: what that process stored stays, and
    its next blocks chain onto it."""

    async def main() -> None:
        harness = Harness(replay=False, sink=IndexingSink())
        index = cast(IndexingSink, harness.sink).index
        old = harness.engine()
        async with harness.running():
            await old.subscribed()
            old.publish([stored(0, 2)])
            await harness.sink.wait_applied(1)
            await old.close()
            new = harness.engine()
            await new.subscribed()
            new.publish([stored(0, 2)])
            await harness.sink.wait_applied(2)
            harness.subscriber.engine_restarted()
            new.publish([stored(2, 2)])
            await harness.sink.wait_applied(3)
            await new.close()
        assert [kind for kind, _, _ in harness.sink.log] == ["apply", "drop", "apply", "apply"]
        assert index.match(prompt()) == {"a": TierMatch(gpu=4)}
        assert index.stats.orphaned == 0
        assert harness.since() == {"restarts": 1}

    asyncio.run(main())


@pytest.mark.parametrize("replay", [False, True])
def test_news_of_a_restart_the_subscriber_has_not_seen_drops_the_owner_at_once(replay: bool) -> None:
    """The old blocks go before the new process says anything; with a replay buffer, the next batch brings
    back what the process followed had stored (it may be the new one: nothing told it apart)."""

    async def main() -> None:
        harness = Harness(replay=replay)
        engine = harness.engine()
        async with harness.running():
            await harness.subscribed(engine)
            for n in range(3):
                engine.publish(batch(n))
            await harness.sink.wait_applied(3)
            before = harness.counts()
            harness.subscriber.engine_restarted()
            assert harness.sink.ids() == [0, 1, 2, "drop"]
            engine.publish(batch(3))
            await harness.sink.wait_for(lambda: harness.sink.ids()[-1] == 3)
        await engine.close()
        if replay:
            assert harness.sink.ids() == [0, 1, 2, "drop", 0, 1, 2, 3]
            assert harness.since(before) == {"restarts": 1, "gaps": 1, "ok": 1}
        else:
            assert harness.sink.ids() == [0, 1, 2, "drop", 3]
            assert harness.since(before) == {"restarts": 1}

    asyncio.run(main())


def test_news_of_a_restart_while_a_gap_is_replayed_restarts_from_the_buffer() -> None:
    async def main() -> None:
        harness = Harness(replay=True)
        engine = harness.engine()
        async with harness.running():
            await harness.first_batch_applied(engine)
            engine.answer_replay.clear()
            engine.replay_asked.clear()
            engine.publish(batch(1), send=False)
            engine.publish(batch(2))
            await asyncio.wait_for(engine.replay_asked.wait(), TIMEOUT_S)
            harness.subscriber.engine_restarted()
            engine.answer_replay.set()
            await harness.sink.wait_applied(4)
        await engine.close()
        assert harness.sink.ids() == [0, "drop", 0, 1, 2]

    asyncio.run(main())


def _complete(url: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def test_a_simulated_fleet_instance_produces_stored_blocks(model_dir: Path, tmp_path: Path) -> None:
    ports = FleetPorts.allocate(1)
    url = f"http://127.0.0.1:{ports.http}/v1/completions"

    def stored(sink: RecordingSink) -> bool:
        return any(isinstance(e, BlockStored) for _, _, events in sink.log for e in events)

    async def main() -> None:
        context = zmq.asyncio.Context()
        sink = RecordingSink()
        source = Source("fleet-0", f"tcp://127.0.0.1:{ports.events}", f"tcp://127.0.0.1:{ports.replay}")
        subscriber = KVEventSubscriber(source, sink, RouterMetrics(), context)
        task = asyncio.create_task(subscriber.run())
        try:
            async with asyncio.timeout(TIMEOUT_S * 3):
                attempt = 0
                while not stored(sink):  # each prompt is new, so it stores new blocks
                    prompt = f"attempt {attempt}: " + "the quick brown fox jumps over the lazy dog " * 20
                    answer = await asyncio.to_thread(_complete, url, prompt)
                    assert answer["choices"]
                    attempt += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sink.wait_for(lambda: stored(sink)), 0.5)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            context.destroy(linger=0)
        assert {owner for _, owner, _ in sink.log} == {("fleet-0", 0)}

    with running_fleet(ports, tmp_path, ["--prefill-tps", "200000", "--decode-tps", "1000"]):
        asyncio.run(main())


def test_news_of_a_restart_goes_to_the_instances_subscriber_or_drops_an_unfollowed_one() -> None:
    """The load scraper's news reaches the reloader: an instance whose events are followed is left to its
    subscriber (here it has applied nothing, so nothing of it is dropped); one without events loses its
    entries, as nothing else says what the new process holds."""
    port = free_port_block(1)
    config = parse_config(
        {
            "models": [{"name": "tiny-llama"}],
            "block_size": 4,
            "instances": [
                {"name": "followed", "url": "http://127.0.0.1:9", "events": f"tcp://127.0.0.1:{port}"},
                {"name": "unfollowed", "url": "http://127.0.0.1:10"},
            ],
        }
    )
    runtime = Runtime(config)
    index = runtime.index
    for name in ("followed", "unfollowed"):
        index.apply((name, 0), [stored(0, 2)])

    async def main() -> None:
        subscriptions = runtime.subscriptions
        subscriptions.subscribe(config.instances)
        try:
            subscriptions.engine_restarted("followed")
            subscriptions.engine_restarted("unfollowed")
        finally:
            await subscriptions.stop()

    asyncio.run(main())
    assert set(index.match(prompt())) == {"followed"}


def test_an_instance_given_new_models_keeps_its_subscriber_and_entries_new_events_endpoints_do_not() -> None:
    """An engine's replay buffer holds only its latest batches: an instance subscribed afresh could not learn
    again of blocks cached long ago, so a reload that leaves its events endpoints as they were keeps them."""
    ports = free_port_block(2)

    def config_with(models: list[str], events_port: int) -> RouterConfig:
        return parse_config(
            {
                "models": [{"name": "tiny-llama"}, {"name": "adapter", "lora_of": "tiny-llama"}],
                "block_size": 4,
                "instances": [
                    {
                        "name": "a",
                        "url": "http://127.0.0.1:9",
                        "models": models,
                        "events": f"tcp://127.0.0.1:{events_port}",
                    }
                ],
            }
        )

    first = config_with(["tiny-llama"], ports)
    runtime = Runtime(first)
    index = runtime.index

    async def main() -> tuple[bool, set[str], set[str]]:
        subscriptions = runtime.subscriptions
        subscriptions.subscribe(first.instances)
        index.apply(("a", 0), [stored(0, 2)])
        subscription = subscriptions._running["a"]
        try:
            with_adapter = config_with(["tiny-llama", "adapter"], ports)
            runtime.apply(with_adapter, "the test")
            kept = subscriptions._running["a"] is subscription and not subscription[1].done()
            after_models = set(index.match(prompt()))
            runtime.apply(config_with(["tiny-llama", "adapter"], ports + 1), "the test")
            after_events = set(index.match(prompt()))
        finally:
            await subscriptions.stop()
        return kept, after_models, after_events

    kept, after_models, after_events = asyncio.run(main())
    assert kept
    assert after_models == {"a"}
    assert after_events == set()
