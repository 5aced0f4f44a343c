"""Slots of a limit in flight held on a real redis-server (router/shared/slots.py): the limit is one across
replicas whatever their timing, a slot given back is free at once, a dead replica's slots free with its lease,
and a replica cut off from the store lets requests go and writes what it holds once the store is back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.store_servers import StoreServer, running_redis, start_redis
from router.config import parse_config
from router.dispatch.wait.flow_control import Demand
from router.errors import OpenAIError
from router.metrics import RouterMetrics
from router.runtime import Runtime
from router.shared.settings import SharedConfig
from router.shared.slots import SharedSlots
from router.shared.store import SharedStore

TENANT = [("flow:tenant-a", 2)]
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def replica_slots(url: str, namespace: str, stale_after_s: float = 1.0) -> SharedSlots:
    config = SharedConfig(url=url, namespace=namespace, stale_after_s=stale_after_s, timeout_s=0.2)
    return SharedSlots(SharedStore(config, RouterMetrics()), uuid.uuid4().hex[:16])


def test_replicas_taking_at_once_get_no_more_slots_than_the_limit(redis_server: StoreServer) -> None:
    namespace = f"test-{uuid.uuid4().hex[:8]}"

    async def race() -> list[bool]:
        replicas = [replica_slots(redis_server.url, namespace) for _ in range(3)]
        # Every replica asks for 2 at the same moment: 6 asks for 2 slots.
        return list(await asyncio.gather(*(slots.take(TENANT) for slots in replicas for _ in range(2))))

    assert sorted(asyncio.run(race())) == [False] * 4 + [True] * 2


def test_a_slot_given_back_is_free_at_once_and_a_second_limit_is_all_or_nothing(
    redis_server: StoreServer,
) -> None:
    namespace = f"test-{uuid.uuid4().hex[:8]}"

    async def run() -> None:
        first, second = (replica_slots(redis_server.url, namespace) for _ in range(2))
        both = [("flow:tenant-a", 2), ("objective:batch", 1)]
        assert await first.take(both)
        # The objective is full: nothing of either is taken.
        assert not await second.take(both)
        assert await second.take(TENANT) and not await first.take(TENANT)
        first.give_back(["flow:tenant-a", "objective:batch"])
        await first.settled()
        assert first.held("flow:tenant-a") == 0
        assert await second.take(both)
        assert second.held("flow:tenant-a") == 2

    asyncio.run(run())


def test_a_dead_replicas_slots_free_with_its_lease_and_a_live_ones_are_kept(
    redis_server: StoreServer,
) -> None:
    namespace = f"test-{uuid.uuid4().hex[:8]}"

    async def run() -> float:
        dead, live, other = (replica_slots(redis_server.url, namespace, stale_after_s=0.2) for _ in range(3))
        assert await dead.take(TENANT) and await live.take(TENANT)
        gone = time.monotonic()
        # The live one renews; the dead one does not: only its slot frees, a lease later (0.6 s).
        while not await other.take(TENANT):
            await live.renew()
            assert time.monotonic() - gone < 5
            await asyncio.sleep(0.05)
        freed_s = time.monotonic() - gone
        assert not await other.take(TENANT)  # the live one's slot stays taken
        return freed_s

    assert 0.5 < asyncio.run(run()) < 2.0


def test_a_replica_cut_off_lets_requests_go_and_writes_its_slots_when_the_store_is_back(
    tmp_path: Path,
) -> None:
    server = start_redis(tmp_path / "redis")
    namespace = f"test-{uuid.uuid4().hex[:8]}"

    async def run() -> None:
        nonlocal server
        cut, other = (replica_slots(server.url, namespace) for _ in range(2))
        assert await cut.take(TENANT)
        server.child.stop()
        assert await cut.take(TENANT)  # on what it knows: the store is away
        assert not cut._store.up and cut.held("flow:tenant-a") == 2
        server = start_redis(tmp_path / "redis", port=server.port)  # back, and empty
        deadline = time.monotonic() + 10
        while not cut._store.up:  # the renewal loop's rounds
            await cut.renew()
            assert time.monotonic() < deadline
        assert not await other.take(TENANT)  # the 2 taken, one while the store was away, are written
        cut.give_back(["flow:tenant-a"])
        await cut.settled()
        assert await other.take(TENANT)

    try:
        asyncio.run(run())
    finally:
        server.child.stop()


def test_a_request_waits_for_another_replicas_slot_and_its_time_out_leaves_nothing_held(
    redis_server: StoreServer,
) -> None:
    """Through the flow gate of one replica while another holds the tenant's one slot: the request waits,
    goes once the slot is given back, and one that waits past its objective's queue time gets the 429 with
    nothing left counted here."""
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    raw = {
        "models": [{"name": MODEL}],
        "instances": [{"name": "a", "url": "http://127.0.0.1:9"}],
        "flow_control": {"per_flow": {"max_in_flight": 1}, "objectives": {"default": {"max_queue_s": 0.5}}},
    }
    runtime = Runtime(parse_config(raw))
    gate = runtime.flow_gate
    gate.slots = replica_slots(redis_server.url, namespace)

    async def run() -> None:
        other = replica_slots(redis_server.url, namespace)
        assert await other.take([("flow:tenant-a", 1)])
        waiting = asyncio.create_task(gate.wait(Demand(MODEL, "tenant-a", None, 10.0, 100)))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        other.give_back(["flow:tenant-a"])
        await other.settled()
        ticket = await asyncio.wait_for(waiting, 2)
        assert ticket is not None and ticket.slots == ("flow:tenant-a",)
        gate.leave(ticket)
        await asyncio.sleep(0.1)  # given back in a task of its own
        assert gate.slots is not None and gate.slots.held("flow:tenant-a") == 0

        assert await other.take([("flow:tenant-a", 1)])
        with pytest.raises(OpenAIError) as refused:
            await gate.wait(Demand(MODEL, "tenant-a", None, 10.0, 100))
        assert refused.value.status == 429
        other.give_back(["flow:tenant-a"])
        await other.settled()
        # Nothing of the refused one is left counted here: the next goes at once.
        ticket = await asyncio.wait_for(gate.wait(Demand(MODEL, "tenant-a", None, 10.0, 100)), 0.4)
        assert ticket is not None and ticket.slots == ("flow:tenant-a",)

    asyncio.run(run())
