"""`kvroute bench store`: the replicas' shared store, Redis against NATS, on what replicas do with it.

Three operations, each on both engines, from a client in this process to a server on 127.0.0.1:
- limit: take a tenant's in-flight slot if it has one left, atomically (Redis: one Lua script; NATS: a
  JetStream key-value read, then an update at the revision read, again on a conflict);
- fan-out: a replica's load snapshot (about 1 KB) published, received by two other replicas (the time from
  publish to the later receive);
- conversation: a stored response's conversation (20 KB) written, then read back (Redis SET with a TTL, GET;
  NATS key-value put, get).
Each is timed one at a time (latency, median and p99) and with 64 at once (operations a second), with the
client's CPU a operation; errors (a CAS given up after 32 tries) are counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvroute.store_servers import running_nats, running_redis

SNAPSHOT = os.urandom(512).hex().encode()  # a replica's load over 16 instances, as msgpack: about 1 KB
CONVERSATION = os.urandom(10_240).hex().encode()
_TAKE_SLOT = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], n + 1, 'EX', 60)
return 1
"""
_CAS_TRIES = 32


@dataclass
class Figure:
    engine: str
    operation: str
    p50_us: float
    p99_us: float
    ops_per_s: float  # with 64 at once
    cpu_us_per_op: float  # this process's, with 64 at once
    errors: int


async def _timed(operation: Callable[[int], Awaitable[bool]], count: int) -> tuple[list[float], int]:
    latencies, errors = [], 0
    for i in range(count):
        start = time.perf_counter()
        ok = await operation(i)
        latencies.append(time.perf_counter() - start)
        errors += not ok
    return latencies, errors


async def _throughput(operation: Callable[[int], Awaitable[bool]], count: int) -> tuple[float, float, int]:
    """ops a second and CPU µs an op with 64 at once; errors."""
    next_index = iter(range(count))
    errors = 0

    async def worker() -> None:
        nonlocal errors
        for i in next_index:
            errors += not await operation(i)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(64)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return count / wall, cpu / count * 1e6, errors


async def _figure(engine: str, name: str, operation: Callable[[int], Awaitable[bool]], count: int) -> Figure:
    await _timed(operation, min(count, 200))  # warm: connections, scripts, buckets
    latencies, errors = await _timed(operation, count)
    ops, cpu_us, more_errors = await _throughput(operation, count)
    ordered = sorted(latencies)
    return Figure(
        engine,
        name,
        round(statistics.median(ordered) * 1e6, 1),
        round(ordered[int(0.99 * (len(ordered) - 1))] * 1e6, 1),
        round(ops),
        round(cpu_us, 1),
        errors + more_errors,
    )


async def _redis_figures(url: str, count: int) -> list[Figure]:
    import redis.asyncio as redis

    client = redis.Redis.from_url(url, max_connections=128)
    subscribers = [redis.Redis.from_url(url) for _ in range(2)]
    take = client.register_script(_TAKE_SLOT)

    async def limit(i: int) -> bool:
        key = f"bench:flow:{i % 50}"
        if await take(keys=[key], args=[10**9]):
            return True
        return False

    async def conversation(i: int) -> bool:
        key = f"bench:conversation:{i}"
        await client.set(key, CONVERSATION, ex=60)
        return await client.get(key) == CONVERSATION

    pubsubs = [subscriber.pubsub() for subscriber in subscribers]
    for pubsub in pubsubs:
        await pubsub.subscribe("bench:load")
        await pubsub.get_message(timeout=1.0)  # the subscribe confirmation

    async def received(pubsub: Any) -> None:
        while (await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)) is None:
            pass

    lock = asyncio.Lock()

    async def fan_out(i: int) -> bool:
        async with lock:  # one snapshot in flight: its receive is its own
            receives = [asyncio.ensure_future(received(pubsub)) for pubsub in pubsubs]
            await client.publish("bench:load", SNAPSHOT)
            await asyncio.gather(*receives)
        return True

    figures = [
        await _figure("redis", "limit", limit, count),
        await _figure("redis", "fan-out", fan_out, count // 4),
        await _figure("redis", "conversation", conversation, count),
    ]
    for pubsub in pubsubs:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
    for connection in (client, *subscribers):
        await connection.aclose()
    return figures


async def _nats_figures(url: str, count: int) -> list[Figure]:
    import nats
    from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

    client = await nats.connect(url)
    stream = client.jetstream()
    flows = await stream.create_key_value(bucket="flows", history=1, ttl=60)
    conversations = await stream.create_key_value(bucket="conversations", history=1, ttl=60)

    async def limit(i: int) -> bool:
        key = f"flow{i % 50}"
        for _ in range(_CAS_TRIES):
            try:
                entry = await flows.get(key)
            except NotFoundError:
                try:
                    await flows.create(key, b"1")
                    return True
                except KeyWrongLastSequenceError:
                    continue
            try:
                await flows.update(key, str(int(entry.value or b"0") + 1).encode(), last=entry.revision)
                return True
            except KeyWrongLastSequenceError:
                continue
        return False

    async def conversation(i: int) -> bool:
        key = f"c{i}"
        await conversations.put(key, CONVERSATION)
        return (await conversations.get(key)).value == CONVERSATION

    subscribers = [await nats.connect(url) for _ in range(2)]
    queues: list[asyncio.Queue[bytes]] = [asyncio.Queue() for _ in subscribers]
    for subscriber, queue in zip(subscribers, queues, strict=True):

        async def put(message: Any, queue: asyncio.Queue[bytes] = queue) -> None:
            queue.put_nowait(message.data)

        await subscriber.subscribe("bench.load", cb=put)
        await subscriber.flush()
    lock = asyncio.Lock()

    async def fan_out(i: int) -> bool:
        async with lock:
            await client.publish("bench.load", SNAPSHOT)
            await client.flush()
            await asyncio.gather(*(queue.get() for queue in queues))
        return True

    figures = [
        await _figure("nats", "limit", limit, count),
        await _figure("nats", "fan-out", fan_out, count // 4),
        await _figure("nats", "conversation", conversation, count),
    ]
    for connection in (client, *subscribers):
        await connection.close()
    return figures


def run(count: int, out: str) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-store-") as scratch:
        logs = Path(scratch)
        with running_redis(logs) as redis_server:
            figures = asyncio.run(_redis_figures(redis_server.url, count))
        with running_nats(logs) as nats_server:
            figures += asyncio.run(_nats_figures(nats_server.url, count))
    header = f"{'engine':7} {'operation':13} {'p50 µs':>8} {'p99 µs':>8} {'ops/s (64)':>11} {'CPU µs/op':>10}"
    print(header, "errors")
    for f in figures:
        print(
            f"{f.engine:7} {f.operation:13} {f.p50_us:8.0f} {f.p99_us:8.0f} {f.ops_per_s:11.0f} "
            f"{f.cpu_us_per_op:10.1f} {f.errors}"
        )
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps([asdict(f) for f in figures], indent=2))
    return figures
