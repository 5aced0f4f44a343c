"""Agent programs across replicas: each router's table follows the turns its peers start and end, as their
snapshots tell them (router/programs/shared.py), so a turn through another replica is a program's next turn
and every instance's working sets count every replica's programs."""

from __future__ import annotations

import msgspec

from router.metrics import RouterMetrics
from router.programs.settings import ProgramsConfig
from router.programs.shared import MAX_TOLD, ProgramTurnsShared
from router.programs.table import Programs, WorkingSets
from router.upstreams.peer_sync import PeerSnapshot, ProgramTurn
from scorers.request import RoutingRequest, TierMatch
from tests.conftest import ManualClock

BLOCK = 16


def turn(key: str, tokens: int, matches: dict[str, TierMatch] | None = None) -> RoutingRequest:
    return RoutingRequest("m", key, tokens, tokens // BLOCK, BLOCK, matches or {})


def replicas(count: int = 2) -> tuple[list[Programs], list[ProgramTurnsShared], ManualClock, RouterMetrics]:
    clock, metrics = ManualClock(100.0), RouterMetrics()
    tables = [Programs(ProgramsConfig(ttl_prior_s=10), RouterMetrics(), clock) for _ in range(count)]
    tables[0]._metrics = metrics  # the first replica's metrics are the ones looked at
    return tables, [ProgramTurnsShared(table) for table in tables], clock, metrics


def exchange(shared: list[ProgramTurnsShared]) -> None:
    """One snapshot interval: each replica's turns, heard by the others."""
    told = [replica.shared() for replica in shared]
    for number, replica in enumerate(shared):
        for peer, turns in enumerate(told):
            if peer != number:
                replica.heard(str(peer), turns)


def test_a_turn_through_another_replica_is_the_programs_next_turn_and_counted_once() -> None:
    (first, second), shared, clock, metrics = replicas()
    first.turn_started(turn("s", 1000), "a", clock.now)
    exchange(shared)
    assert second.alive("s")  # not a new program there: the program-room scorer leaves it be
    assert second.working_sets() == {"a": WorkingSets(running=1, tokens=1000)}
    clock.now += 2
    first.turn_ended("s")
    exchange(shared)
    assert second.working_sets() == {"a": WorkingSets(tool_call=1, tokens=1000)}
    clock.now += 3
    held = {"a": TierMatch(gpu=1000 // BLOCK)}
    assert second.turn_started(turn("s", 1300, held), "a", clock.now) == "kept"
    exchange(shared)
    # the first replica now counts the program where its turn through the second runs, once
    assert first.working_sets() == {"a": WorkingSets(running=1, tokens=1300)}
    second.turn_ended("s")
    exchange(shared)
    assert first.working_sets() == {"a": WorkingSets(tool_call=1, tokens=1300)}
    clock.now += 3
    # its next turn back through the first replica is a next turn there too, found kept
    assert first.turn_started(turn("s", 1500, {"a": TierMatch(gpu=1300 // BLOCK)}), "a", clock.now) == "kept"
    assert (
        metrics.registry.get_sample_value(
            "kvroute_program_turns_total", {"kv": "kept", "tool_call": "within_ttl"}
        )
        == 1
    )


def test_a_peer_gone_silent_leaves_no_program_running() -> None:
    (first, second), shared, clock, _ = replicas()
    first.turn_started(turn("s", 1000), "a", clock.now)
    first.turn_started(turn("t", 2000), "b", clock.now)
    exchange(shared)
    assert second.working_sets()["b"] == WorkingSets(running=1, tokens=2000)
    shared[1].forget("0")  # the first replica died with both turns in flight
    sets = second.working_sets()
    assert sets["a"].running == sets["b"].running == 0
    clock.now += 10.5  # and past the tool calls' time-to-live, nothing of them is counted
    assert second.working_sets() == {"a": WorkingSets(), "b": WorkingSets()}


def test_an_end_heard_without_its_start_changes_nothing() -> None:
    (_, second), shared, clock, _ = replicas()
    second.turn_started(turn("s", 1000), "a", clock.now)
    shared[1].shared()  # lost: the store was down
    shared[1].heard("0", [ProgramTurn("s", "", 0)])
    assert second.working_sets() == {"a": WorkingSets(running=1, tokens=1000)}


def test_the_turns_told_in_a_snapshot_are_bounded_and_survive_its_wire_format() -> None:
    (first, _), shared, clock, _ = replicas()
    for number in range(MAX_TOLD + 10):
        first.turn_started(turn(f"s{number}", 100), "a", clock.now)
    told = shared[0].shared()
    assert len(told) == MAX_TOLD and told[-1].key == f"s{MAX_TOLD + 9}"
    assert shared[0].shared() == []
    wire = msgspec.msgpack.encode(PeerSnapshot("r", {}, programs=told[:2]))
    assert msgspec.msgpack.decode(wire, type=PeerSnapshot).programs == told[:2]
