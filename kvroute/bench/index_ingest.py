"""End-to-end ingest for ``kvroute bench index``: publishers over TCP, ZMQ, msgpack, the router's own
subscriber and its index, as a fleet's KV events reach a router.

Each publisher is a process of its own, bound on 127.0.0.1 as vLLM binds its PUB socket, with every message
encoded before the clock starts (vLLM's wire format: topic, 8-byte sequence number, a msgpack batch), so what
is timed is the router's side. Its send queue is unbounded: a router that falls behind delays messages rather
than losing them, and every block is counted in. The router's process measures its wall and CPU time from the
first block to the last, and its resident memory before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import random
import resource
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import zmq
import zmq.asyncio

from kvroute.bench.index_parts import BLOCK_SIZE, gpu_blocks
from kvroute.processes import free_port_block
from router.allocator import trim
from router.index.block_index import BlockIndex
from router.index.events import BlockStored, EventEncoder, KVEvent, pack_seq
from router.index.holdings import IndexStats, Owner
from router.index.subscriber import KVEventSubscriber, Source, SubscriberOptions
from router.metrics import RouterMetrics

VOCAB = 150_000
_TOKEN_LISTS = 64  # token lists reused by every publisher: parents make each block distinct
_HASH_SPACE = 1 << 40  # each publisher's block hashes start at its own multiple of this
SUBSCRIBED_WITHIN_S = 30.0
STARTED_WITHIN_S = 120.0  # the publisher processes, all of them
INGEST_WITHIN_S = 600.0  # a run that takes longer is reported as failed, not waited for


@dataclass(frozen=True)
class IngestResult:
    publishers: int
    blocks_per_message: int
    blocks: int
    wall_s: float
    cpu_s: float
    rss_growth_bytes: int
    index_entries: int

    @property
    def messages(self) -> int:
        return self.blocks // self.blocks_per_message

    def summary(self) -> dict[str, float]:
        return {
            "blocks": self.blocks,
            "blocks_per_message": self.blocks_per_message,
            "blocks_per_s": self.blocks / self.wall_s,
            "blocks_per_cpu_s": self.blocks / self.cpu_s,
            "messages_per_s": self.messages / self.wall_s,
            "messages_per_cpu_s": self.messages / self.cpu_s,
            "rss_bytes_per_block": self.rss_growth_bytes / max(1, self.index_entries),
            "index_entries": self.index_entries,
        }


def _payloads(publisher: int, messages: int, blocks_per_message: int, block_size: int) -> list[list[bytes]]:
    """A publisher's messages, ready to send: one chain of BlockStored events, each message continuing it."""
    rng = random.Random(publisher)
    tokens = [
        [rng.randrange(VOCAB) for _ in range(block_size * blocks_per_message)] for _ in range(_TOKEN_LISTS)
    ]
    encoder = EventEncoder()
    parent: int | None = None
    next_hash = (publisher + 1) * _HASH_SPACE
    frames = []
    for seq in range(messages):
        hashes = list(range(next_hash, next_hash + blocks_per_message))
        event: KVEvent = gpu_blocks(hashes, tokens[seq % _TOKEN_LISTS], parent, block_size)
        frames.append([b"", pack_seq(seq), encoder.encode(time.time(), [event])])
        parent, next_hash = hashes[-1], next_hash + blocks_per_message
    return frames


@dataclass(frozen=True)
class _Engines:
    """What one publisher process sends: engines instances' events, each on its own port from first_port."""

    first_port: int
    engines: int
    first_engine: int  # the number of its first engine among all: each engine's blocks are its own
    messages: int  # an engine's
    blocks_per_message: int
    block_size: int


def _publish(sent: _Engines, control: Connection) -> None:
    """A publisher process: encode, bind, say when every engine is subscribed to, send everything at the go
    (the engines' messages in turn), then wait to be stopped. An XPUB socket, which is PUB on the wire, tells
    when the subscription arrived: a PUB drops what it sends before."""
    engines = range(sent.first_engine, sent.first_engine + sent.engines)
    frames = [_payloads(n, sent.messages, sent.blocks_per_message, sent.block_size) for n in engines]
    context = zmq.Context()
    pubs = []
    for offset in range(sent.engines):
        pub = context.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, 0)  # unbounded: a slow subscriber delays messages, none is dropped
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{sent.first_port + offset}")
        pubs.append(pub)
    control.send("bound")
    for pub in pubs:
        pub.recv()  # the subscription
    control.send("subscribed")
    if control.recv() == "go":
        for messages in zip(*frames, strict=True):
            for pub, message in zip(pubs, messages, strict=True):
                pub.send_multipart(message, copy=False)
        control.recv()
    for pub in pubs:
        pub.close()
    context.term()


class _CountingSink:
    """A sink that only counts the blocks it is given: what the subscriber costs without the index (its
    receive, decoding and bookkeeping), the floor under the end-to-end figure."""

    def __init__(self) -> None:
        self.stats = IndexStats()
        self.entries = 0

    def apply(self, owner: Owner, events: Sequence[KVEvent]) -> None:
        self.stats.stored += sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))

    def drop(self, owner: Owner) -> None:
        pass


async def _ingest(
    endpoints: list[str], blocks: int, go: list[Connection], indexed: bool
) -> tuple[BlockIndex | _CountingSink, float, float]:
    """The router's side: a subscriber per publisher into one index (or a sink that counts, when not indexed),
    timed from the go to the last block."""
    index = BlockIndex(BLOCK_SIZE, max_entries=blocks + 1) if indexed else _CountingSink()
    metrics = RouterMetrics()
    context = zmq.asyncio.Context()
    subscribers = [
        KVEventSubscriber(
            Source(f"p{i}", endpoint), index, metrics, context, SubscriberOptions(block_size=BLOCK_SIZE)
        )
        for i, endpoint in enumerate(endpoints)
    ]
    tasks = [asyncio.create_task(subscriber.run()) for subscriber in subscribers]
    try:
        for control in go:
            said = await asyncio.wait_for(asyncio.to_thread(control.recv), SUBSCRIBED_WITHIN_S)
            if said != "subscribed":
                raise RuntimeError("a publisher was not subscribed to")
        wall, cpu = time.perf_counter(), time.process_time()
        for control in go:
            control.send("go")
        deadline = wall + INGEST_WITHIN_S
        while index.stats.stored < blocks:
            if time.perf_counter() > deadline:
                raise RuntimeError(
                    f"{index.stats.stored} of {blocks} blocks arrived in {INGEST_WITHIN_S:.0f} s"
                )
            await asyncio.sleep(0.005)
        return index, time.perf_counter() - wall, time.process_time() - cpu
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        context.term()


@dataclass(frozen=True)
class Publishers:
    """Publisher processes, bound and waiting: each says "subscribed" on its control once a subscriber is
    there, then sends everything when told "go"."""

    endpoints: list[str]
    controls: list[Connection]
    blocks: int  # what they send in all
    pids: tuple[int, ...] = ()


@contextlib.contextmanager
def publishing(
    blocks: int,
    blocks_per_message: int,
    publishers: int = 8,
    block_size: int = BLOCK_SIZE,
    engines_each: int = 1,
) -> Iterator[Publishers]:
    """About blocks of block_size tokens in messages of blocks_per_message, from publishers processes on
    127.0.0.1, each sending the events of engines_each instances, on a port each."""
    engines = publishers * engines_each
    messages = blocks // blocks_per_message // engines
    port = free_port_block(engines)
    spawn = multiprocessing.get_context("spawn")
    links = [spawn.Pipe() for _ in range(publishers)]
    processes = [
        spawn.Process(
            target=_publish,
            args=(
                _Engines(
                    port + i * engines_each,
                    engines_each,
                    i * engines_each,
                    messages,
                    blocks_per_message,
                    block_size,
                ),
                child,
            ),
            daemon=True,
        )
        for i, (_, child) in enumerate(links)
    ]
    for process in processes:
        process.start()
    controls = [parent for parent, _ in links]
    try:
        # Each a fresh interpreter importing the encoder: on two busy cores (engines starting beside them)
        # the eight take tens of seconds together.
        deadline = time.monotonic() + STARTED_WITHIN_S
        for control in controls:
            if not control.poll(max(0.0, deadline - time.monotonic())) or control.recv() != "bound":
                raise RuntimeError(f"a publisher did not start within {STARTED_WITHIN_S:.0f} s")
        endpoints = [f"tcp://127.0.0.1:{port + i}" for i in range(engines)]
        pids = tuple(process.pid for process in processes if process.pid is not None)
        yield Publishers(endpoints, controls, messages * blocks_per_message * engines, pids)
    finally:
        for control in controls:
            control.send("stop")
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def measure_ingest_end_to_end(
    blocks: int, blocks_per_message: int, publishers: int = 8, indexed: bool = True
) -> IngestResult:
    """blocks arriving from publishers over ZMQ into a router's index, blocks_per_message to a message; not
    indexed: into a sink that only counts them."""
    with publishing(blocks, blocks_per_message, publishers) as sent:
        gc.collect()
        trim()
        rss_before = _rss_bytes()
        index, wall, cpu = asyncio.run(_ingest(sent.endpoints, sent.blocks, sent.controls, indexed))
        gc.collect()
        trim()  # what a router gives back within a trim interval of the burst's end (router/allocator.py)
        rss_growth = _rss_bytes() - rss_before
        return IngestResult(publishers, blocks_per_message, sent.blocks, wall, cpu, rss_growth, index.entries)


def _rss_bytes() -> int:
    """This process's resident memory now (/proc), or its peak where /proc is not."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
