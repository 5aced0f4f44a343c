"""A hostile KV-event publisher: a process with a PUB and a replay ROUTER on 127.0.0.1 that speaks vLLM's wire
format (router/index/events.py) and misuses it as a plan says.

`python -m tests.router.index.rogue_publisher '<plan as JSON>'` binds both sockets on free ports, prints
`{"events": ..., "replay": ...}` on a line, waits for a subscriber, sends the plan's live messages, prints
`{"sent": N}` and goes on answering replays until killed. Payloads are built before the subscriber is awaited:
a huge batch's encoding takes no time from what a test measures. `rogue()` runs one for a test.

Live messages, each a dict in the plan's "live" list:
- {"batch": n}: a small batch a test can recognise by n (a removal of block n);
- {"stored": blocks, "per_event": k, "block_size": b, "wide": w}: a chain of stored blocks in events of k
  blocks (wide: of five-byte token ids);
- {"nils": n}: a batch whose n events are each one byte (nil): an object apiece, were they decoded;
- {"flood": n}: n small batches back to back;
- {"garbage": n}: n messages that are no batch at all (random bytes, wrong frames, bad numbers, bad payloads);
each with an optional "seq" (the next one otherwise, counted from 0), "ts" (the time otherwise) and "repeat"
(its batch sent so many times, numbered on).

Replays ("replay" in the plan): "end" answers at once with the end marker (an empty buffer); "endless" with
batches of "replay_bytes" each, every "replay_interval_s", never ending (silent after "replay_limit"); "silent"
never answers. The first "replay_after" replays are answered as "end".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from router.index.events import END_OF_REPLAY, BlockRemoved, BlockStored, EventEncoder, KVEvent, pack_seq

TOPIC = b"kv@rogue@tiny"
_encoder = EventEncoder("array")


@dataclass
class Plan:
    live: list[dict[str, Any]] = field(default_factory=list)
    replay: str = "end"
    replay_bytes: int = 2**20
    replay_interval_s: float = 0.0
    replay_first: int = 1  # the first sequence number an endless replay sends, counting up from it
    replay_after: int = 0  # replays answered as "end" before the others are answered as replay says
    # An endless answer falls silent (without ending) after this many batches: a subscriber that holds all it
    # is sent (as one did) is then held to a size a test machine has, and fails by what it held.
    replay_limit: int = 1 << 62

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def small_batch(n: int) -> list[KVEvent]:
    return [BlockRemoved(block_hashes=[n], medium="GPU")]


def stored_chain(
    blocks: int, per_event: int, block_size: int, first_hash: int = 1 << 40, wide: bool = False
) -> list[KVEvent]:
    """blocks blocks of one prompt, chained, in events of per_event; one-byte token ids keep it compact, wide
    ones (five bytes, as a large vocabulary's) make it the costliest to decode."""
    tokens = [(100_000 if wide else 0) + (i * 7) % 100 for i in range(per_event * block_size)]
    events: list[KVEvent] = []
    parent: int | None = None
    for start in range(0, blocks, per_event):
        count = min(per_event, blocks - start)
        hashes: list[int | bytes] = list(range(first_hash + start, first_hash + start + count))
        events.append(
            BlockStored(hashes, parent, tokens[: count * block_size], block_size, None, "GPU", None)
        )
        parent = first_hash + start + count - 1
    return events


def nil_events(count: int, ts: float) -> bytes:
    """A batch payload of count one-byte events (msgpack nil): a well-formed array of no events at all."""
    return (
        b"\x93\xcb"
        + msgspec.msgpack.encode(ts)[1:]
        + b"\xdd"
        + count.to_bytes(4, "big")
        + b"\xc0" * count
        + b"\x00"
    )


def garbage(count: int, seed: int = 0) -> Iterator[list[bytes]]:
    rng = random.Random(seed)
    good = _encoder.encode(time.time(), small_batch(0))
    kinds = [
        lambda: [TOPIC, rng.randbytes(8), rng.randbytes(rng.randrange(1, 200))],  # random payloads
        lambda: [TOPIC, pack_seq(rng.randrange(1 << 60))],  # two frames
        lambda: [TOPIC, pack_seq(1), good, b"extra"],  # four
        lambda: [TOPIC, rng.randbytes(rng.randrange(0, 8)), good],  # a short sequence number
        lambda: [TOPIC, END_OF_REPLAY, good],  # the replay's end marker, live
        lambda: [TOPIC, pack_seq(1), msgspec.msgpack.encode([1.0, "no events"])],
        lambda: [TOPIC, pack_seq(1), msgspec.msgpack.encode([float("nan"), []])],
        lambda: [TOPIC, pack_seq(1), b"\x93\xcb" + rng.randbytes(8) + b"\xdd\xff\xff\xff\xff"],  # claims 4G
    ]
    for number in range(count):
        yield kinds[number % len(kinds)]()


class Rogue:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.XPUB)  # XPUB: the subscription can be awaited
        self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop: a flood is all delivered
        self._replay = self._context.socket(zmq.ROUTER)
        for sock in (self._pub, self._replay):
            sock.setsockopt(zmq.LINGER, 0)
        self.endpoints = {
            "events": f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}",
            "replay": f"tcp://127.0.0.1:{self._replay.bind_to_random_port('tcp://127.0.0.1')}",
        }
        self._seq = 0
        self._answering: set[asyncio.Task[None]] = set()
        self._messages = [frames for action in plan.live for frames in self._frames(action)]

    def _frames(self, action: dict[str, Any]) -> Iterator[list[bytes]]:
        ts = action.get("ts", time.time())
        if "garbage" in action:
            yield from garbage(action["garbage"])
            return
        if "flood" in action:
            for n in range(action["flood"]):
                yield self._numbered(None, _encoder.encode(ts, small_batch(n)))
            return
        if "nils" in action:
            payload = nil_events(action["nils"], ts)
        elif "stored" in action:
            per_event, block_size = action.get("per_event", 64), action.get("block_size", 4)
            events = stored_chain(action["stored"], per_event, block_size, wide=action.get("wide", False))
            payload = _encoder.encode(ts, events)
        else:
            payload = _encoder.encode(ts, small_batch(action["batch"]))
        yield self._numbered(action.get("seq"), payload)
        for _ in range(action.get("repeat", 1) - 1):  # the same payload again, numbered on
            yield self._numbered(None, payload)

    def _numbered(self, seq: int | None, payload: bytes) -> list[bytes]:
        seq = self._seq if seq is None else seq
        self._seq = seq + 1
        return [TOPIC, pack_seq(seq), payload]

    async def run(self) -> None:
        serving = asyncio.create_task(self._serve_replays())
        print(json.dumps(self.endpoints), flush=True)
        while await self._pub.recv() != b"\x01":  # a subscription, not a leaving subscriber's unsubscription
            pass
        for frames in self._messages:
            await self._pub.send_multipart(frames)
        print(json.dumps({"sent": len(self._messages)}), flush=True)
        await serving

    async def _serve_replays(self) -> None:
        for answered in range(1 << 62):
            client, _, _start = await self._replay.recv_multipart()
            mode = "end" if answered < self.plan.replay_after else self.plan.replay
            if mode == "end":
                await self._replay.send_multipart([client, b"", b"", END_OF_REPLAY, b""])
            elif mode == "endless":  # each in a task of its own: a cut replay's next one is answered at once
                task = asyncio.create_task(self._endless(client))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)

    async def _endless(self, client: bytes) -> None:
        """Batches of about replay_bytes each, numbered up from replay_first, without end."""
        blocks = max(1, self.plan.replay_bytes // 13)  # a block of 4 one-byte tokens is ~13 bytes
        payload = _encoder.encode(time.time(), stored_chain(blocks, blocks, 4))
        for seq in range(self.plan.replay_first, self.plan.replay_first + self.plan.replay_limit):
            await self._replay.send_multipart([client, b"", TOPIC, pack_seq(seq), payload])
            await asyncio.sleep(self.plan.replay_interval_s)


@contextlib.asynccontextmanager
async def rogue(plan: Plan) -> AsyncIterator[RogueProcess]:
    """A rogue publisher running plan in a process of its own, killed on leaving."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.router.index.rogue_publisher",
        plan.to_json(),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        endpoints = json.loads(await asyncio.wait_for(process.stdout.readline(), 30))
        yield RogueProcess(process, endpoints["events"], endpoints["replay"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


@dataclass
class RogueProcess:
    process: asyncio.subprocess.Process
    endpoint: str
    replay_endpoint: str

    async def sent(self, timeout_s: float = 60.0) -> int:
        """Once the plan's live messages are all sent: how many there were."""
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
        return int(json.loads(line)["sent"])


if __name__ == "__main__":
    asyncio.run(Rogue(Plan(**json.loads(sys.argv[1]))).run())
