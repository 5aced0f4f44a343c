"""Routers in front of one fleet count each other's requests in flight: snapshots, sums, silence, the wire."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest
import zmq.asyncio

from kvroute.processes import free_port_block
from router.config import RouterConfig, parse_config
from router.metrics import RouterMetrics
from router.programs.settings import ProgramsConfig
from router.programs.shared import ProgramTurnsShared
from router.programs.table import Programs, WorkingSets
from router.upstreams.instances import Upstreams
from router.upstreams.peer_load import NO_PEER_LOAD, PeerLoad, PeerLoads, own_loads
from router.upstreams.peer_sync import MAX_PEERS, PeerEndpoints, PeerSync, PeerSyncError
from scorers.inflight_load import InflightLoadParams, InflightLoadScorer
from scorers.request import RoutingRequest
from scorers.ttft_features import memory_wait_s
from tests.conftest import ManualClock


def config() -> RouterConfig:
    instances = [{"name": "a", "url": "http://127.0.0.1:9001"}, {"name": "b", "url": "http://127.0.0.1:9002"}]
    return parse_config({"models": [{"name": "m"}], "instances": instances})


def test_peers_loads_add_to_what_scorers_read_and_never_to_what_is_published() -> None:
    fleet = Upstreams(config())
    a, b = fleet.instances
    a.start(prompt_tokens=1000, uncached_tokens=600)
    loads = PeerLoads(stale_after_s=1.0)
    loads.update("p", {"a": PeerLoad(2, 5000, 300), "b": PeerLoad(1, 100, 0), "gone": PeerLoad(9, 9, 9)})
    loads.update("q", {"a": PeerLoad(1, 1000, 0)})
    loads.apply(fleet.instances)
    assert (a.in_flight, a.active_tokens, a.pending_prefill_tokens) == (4, 7000, 900)
    assert (b.in_flight, b.active_tokens, b.pending_prefill_tokens) == (1, 100, 0)
    assert (a.own_in_flight, a.own_active_tokens, a.own_pending_prefill_tokens) == (1, 1000, 600)
    # What this router tells its peers is its own: a peer's requests never come back to it doubled.
    assert own_loads(fleet.instances) == {"a": PeerLoad(1, 1000, 600), "b": NO_PEER_LOAD}
    # The scorers see every router's requests: 4 in flight on a, 1 on b.
    assert InflightLoadScorer(InflightLoadParams()).score(None, [a, b]) == [0.0, 1.0]  # type: ignore[arg-type]


def test_a_peer_that_falls_silent_stops_counting() -> None:
    clock = ManualClock()
    fleet = Upstreams(config())
    a, _ = fleet.instances
    loads = PeerLoads(stale_after_s=1.0, clock=clock)
    loads.update("p", {"a": PeerLoad(3, 0, 0)})
    clock.now = 0.5
    loads.update("q", {"a": PeerLoad(1, 0, 0)})
    loads.apply(fleet.instances)
    assert a.in_flight == 4 and loads.peers == 2
    clock.now = 1.2
    assert loads.expire()
    loads.apply(fleet.instances)
    assert a.in_flight == 1 and loads.peers == 1
    clock.now = 1.6
    assert loads.expire() and loads.peers == 0
    loads.apply(fleet.instances)
    assert a.peers == NO_PEER_LOAD and not loads.expire()


def test_the_wait_for_memory_counts_the_peers_contexts() -> None:
    fleet = Upstreams(config())
    a, _ = fleet.instances
    a.kv_capacity_tokens = 100_000
    a.start(prompt_tokens=50_000, uncached_tokens=0)
    a.end(prompt_tokens=50_000)  # a hold time is known
    a.start(prompt_tokens=40_000, uncached_tokens=40_000)
    assert memory_wait_s(a, 50_000) == 0.0  # 40K in flight + 50K fit in 100K
    loads = PeerLoads(stale_after_s=1.0)
    loads.update("p", {"a": PeerLoad(1, 40_000, 0)})
    loads.apply(fleet.instances)
    assert memory_wait_s(a, 50_000) > 0.0  # 80K in flight: 30K have to leave first


def test_two_routers_hear_each_others_load_over_zmq_and_forget_a_silent_one() -> None:
    first_port = free_port_block(2)
    second_port = first_port + 1
    first_endpoint, second_endpoint = f"tcp://127.0.0.1:{first_port}", f"tcp://127.0.0.1:{second_port}"
    first_fleet, second_fleet = Upstreams(config()), Upstreams(config())
    timing = {"interval_s": 0.02, "stale_after_s": 0.3}

    async def main() -> None:
        context = zmq.asyncio.Context()
        first_metrics, second_metrics = RouterMetrics(), RouterMetrics()
        first = PeerSync(
            PeerEndpoints(first_endpoint, (second_endpoint,), **timing),
            first_fleet,
            first_metrics,
            context,
        )
        second = PeerSync(
            PeerEndpoints(second_endpoint, (first_endpoint,), **timing),
            second_fleet,
            second_metrics,
            context,
        )
        first.start()
        second.start()
        first_tasks = [asyncio.create_task(loop()) for loop in first.loops().values()]
        second_tasks = [asyncio.create_task(loop()) for loop in second.loops().values()]
        try:
            first_fleet.instances[0].start(prompt_tokens=2000, uncached_tokens=2000)
            second_fleet.instances[1].start(prompt_tokens=300, uncached_tokens=0)
            await _until(
                lambda: second_fleet.instances[0].in_flight == 1 and first_fleet.instances[1].in_flight == 1
            )
            a = second_fleet.instances[0]
            assert (a.own_in_flight, a.active_tokens, a.pending_prefill_tokens) == (0, 2000, 2000)
            assert second_metrics.registry.get_sample_value("kvroute_peer_routers") == 1
            # Garbage and a router's own snapshot are counted and skipped.
            second.receive(b"\x93not a snapshot")
            second.receive(msgspec.msgpack.encode({"router": "x", "instances": {"a": {"in_flight": -1}}}))
            second.receive(msgspec.msgpack.encode({"router": "x", "instances": {"a": {"in_flight": 2**41}}}))
            second.receive(second.snapshot())
            assert a.in_flight == 1
            counts = {
                s.labels["result"]: s.value
                for metric in second_metrics.registry.collect()
                if metric.name == "kvroute_peer_snapshots"
                for s in metric.samples
                if s.name.endswith("_total")
            }
            assert counts["malformed"] == 3 and counts["own"] == 1 and counts["applied"] >= 1
            for task in first_tasks:  # the first router stops
                task.cancel()
            await asyncio.gather(*first_tasks, return_exceptions=True)
            await _until(lambda: second_fleet.instances[0].in_flight == 0)
            assert second_metrics.registry.get_sample_value("kvroute_peer_routers") == 0
        finally:
            for task in first_tasks + second_tasks:
                task.cancel()
            await asyncio.gather(*first_tasks, *second_tasks, return_exceptions=True)
            first.close()
            second.close()
            context.destroy(linger=0)

    asyncio.run(main())


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "not within the time limit"
        await asyncio.sleep(0.01)


def test_a_follower_keeps_what_it_routes_to_forgets_in_time_and_bounds_its_peers() -> None:
    """No publish endpoint: the snapshots it hears still expire; instances it does not route to are left out;
    past MAX_PEERS new routers are skipped; every change is reported (held requests may now fit)."""
    clock = ManualClock()
    fleet = Upstreams(config())
    metrics = RouterMetrics()
    changes: list[int] = []
    settings = PeerEndpoints(subscribe=("tcp://127.0.0.1:5999",), interval_s=0.01, stale_after_s=1.0)
    sync = PeerSync(
        settings, fleet, metrics, zmq.asyncio.Context.instance(), lambda: changes.append(1), clock
    )
    assert list(sync.loops()) == ["peers-expire"]  # not started: nothing to publish or follow yet

    def snapshot(router: str, **loads: dict[str, int]) -> bytes:
        return msgspec.msgpack.encode({"router": router, "instances": loads})

    later = {"in_flight": 2, "active_tokens": 10, "a_field_of_a_later_version": 1}
    sync.receive(snapshot("p", a=later, unknown={"in_flight": 5}))
    a, b = fleet.instances
    assert (a.in_flight, a.active_tokens, b.in_flight) == (2, 10, 0) and changes == [1]
    for peer in range(MAX_PEERS):  # p and 63 more
        if peer:
            sync.receive(snapshot(f"r{peer}", a={"in_flight": 0}))
    sync.receive(snapshot("one too many", a={"in_flight": 100}))
    assert a.in_flight == 2 and sync.loads.peers == MAX_PEERS
    assert (
        metrics.registry.get_sample_value("kvroute_peer_snapshots_total", {"result": "too_many_peers"}) == 1
    )

    async def main() -> None:
        expiring = asyncio.create_task(sync.expire_stale())
        try:
            clock.now = 1.5  # every peer silent past stale_after_s
            await _until(lambda: a.in_flight == 0)
        finally:
            expiring.cancel()
            await asyncio.gather(expiring, return_exceptions=True)

    asyncio.run(main())
    assert sync.loads.peers == 0 and metrics.registry.get_sample_value("kvroute_peer_routers") == 0


def test_a_publish_endpoint_taken_already_is_named_at_start() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port_block(1)}"
    context = zmq.asyncio.Context()
    squatter = context.socket(zmq.PUB)
    squatter.bind(endpoint)
    sync = PeerSync(PeerEndpoints(publish=endpoint), Upstreams(config()), RouterMetrics(), context)
    try:
        with pytest.raises(PeerSyncError, match=f"{endpoint} cannot be bound"):
            sync.start()
    finally:
        sync.close()
        squatter.close(linger=0)
        context.destroy(linger=0)


class _Placements:
    """Stands in for the decider's session placements (router/runtime.py's _SessionsShared)."""

    def __init__(self, own: dict[str, str]) -> None:
        self.own = own
        self.told: list[dict[str, str]] = []

    def placed(self) -> dict[str, str]:
        placed, self.own = self.own, {}
        return placed

    def heard(self, placements: dict[str, str]) -> None:
        self.told.append(placements)


def test_snapshots_carry_the_sessions_placed_since_the_last_one_and_hand_peers_theirs() -> None:
    metrics, context = RouterMetrics(), zmq.asyncio.Context.instance()
    sender = PeerSync(PeerEndpoints(), Upstreams(config()), RouterMetrics(), context)
    receiver = PeerSync(PeerEndpoints(), Upstreams(config()), metrics, context)
    placed, heard = _Placements({"s1": "a", "s2": "gone"}), _Placements({})
    sender.share_sessions(placed)
    receiver.share_sessions(heard)
    first = sender.snapshot()
    receiver.receive(first)
    receiver.receive(first)  # heard again, over the other way a worker's snapshots come: applied once
    receiver.receive(sender.snapshot())  # told once: the next snapshot has none
    assert heard.told == [{"s1": "a"}]  # an instance the receiver does not route to is left out
    repeated = {"result": "repeated"}
    assert metrics.registry.get_sample_value("kvroute_peer_snapshots_total", repeated) == 1


def test_snapshots_carry_programs_turns_and_a_silent_peers_turns_end() -> None:
    clock = ManualClock(100.0)
    context = zmq.asyncio.Context.instance()
    sender = PeerSync(PeerEndpoints(), Upstreams(config()), RouterMetrics(), context, clock=clock)
    receiver = PeerSync(PeerEndpoints(), Upstreams(config()), RouterMetrics(), context, clock=clock)
    mine = Programs(ProgramsConfig(ttl_prior_s=10), RouterMetrics(), clock)
    theirs = Programs(ProgramsConfig(ttl_prior_s=10), RouterMetrics(), clock)
    sender.share_programs(ProgramTurnsShared(mine))
    receiver.share_programs(ProgramTurnsShared(theirs))
    mine.turn_started(RoutingRequest("m", "s1", 1000, 62, 16, {}), "a", clock.now)
    mine.turn_started(RoutingRequest("m", "s2", 500, 31, 16, {}), "gone", clock.now)
    receiver.receive(sender.snapshot())
    # an instance the receiver does not route to is left out
    assert theirs.working_sets() == {"a": WorkingSets(running=1, tokens=1000)}
    clock.now += 1.5  # the sender fell silent with its turn in flight: the turn ends here
    receiver.expire()
    assert theirs.working_sets() == {"a": WorkingSets(tool_call=1, tokens=1000)}


def test_a_nudge_sends_the_next_snapshot_without_waiting_for_the_interval() -> None:
    async def scenario() -> list[bytes]:
        sync = PeerSync(
            PeerEndpoints(interval_s=30.0),
            Upstreams(config()),
            RouterMetrics(),
            zmq.asyncio.Context.instance(),
        )
        sent: list[bytes] = []

        async def send(message: bytes) -> None:
            sent.append(message)

        sync.send_also(send)
        publishing = asyncio.create_task(sync.publish())
        await _until(lambda: len(sent) == 1)
        sync.nudge()
        await _until(lambda: len(sent) == 2, timeout_s=1.0)  # not 30 s
        publishing.cancel()
        return sent

    assert len(asyncio.run(scenario())) == 2
