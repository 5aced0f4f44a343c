"""Program room: a request that starts an agent program scores each candidate by the KV its programs' working
sets leave free; any other request is left to the other scorers."""

from __future__ import annotations

import pytest

from scorers.program_room import ProgramRoomParams, ProgramRoomScorer
from scorers.registry import SCORERS
from scorers.request import RoutingRequest
from tests.scorers.candidates import Fake

SCORER = ProgramRoomScorer(ProgramRoomParams())


def test_a_new_program_scores_the_room_the_working_sets_leave() -> None:
    """Half the cache free is room enough (1); less scores its share of that half."""
    full = Fake("full", kv_capacity_tokens=1000, program_tokens=1000)
    most = Fake("most", kv_capacity_tokens=1000, program_tokens=750)
    half = Fake("half", kv_capacity_tokens=1000, program_tokens=500)
    empty = Fake("empty", kv_capacity_tokens=1000)
    over = Fake("over", kv_capacity_tokens=1000, program_tokens=1800)  # more than fits: already evicting
    unknown = Fake("unknown", program_tokens=10)  # its capacity not scraped yet
    request = RoutingRequest("m", "s", 100, new_program=True)
    assert SCORER.score(request, [full, most, half, empty, over, unknown]) == pytest.approx(
        [0, 0.5, 1, 1, 0, 0]
    )


def test_where_every_instance_has_room_the_other_scorers_decide() -> None:
    """A new session goes where the agents' shared instructions are cached, though that instance holds
    another session's working set, while it has room enough."""
    holding = Fake("holding", kv_capacity_tokens=131_072, program_tokens=25_000)
    empty = Fake("empty", kv_capacity_tokens=131_072)
    assert SCORER.score(RoutingRequest("m", "s", 100, new_program=True), [holding, empty]) == [1.0, 1.0]


def test_contexts_in_flight_beyond_the_working_sets_count_too() -> None:
    """Requests without a session hold KV as they run: the more of the two is what is taken."""
    busy = Fake("busy", kv_capacity_tokens=1000, active_tokens=750, program_tokens=100)
    idle = Fake("idle", kv_capacity_tokens=1000, program_tokens=500)
    assert SCORER.score(RoutingRequest("m", "s", 100, new_program=True), [busy, idle]) == [0.5, 1.0]


def test_the_room_enough_is_a_parameter() -> None:
    quarter = ProgramRoomScorer(ProgramRoomParams(room=0.25))
    most = Fake("most", kv_capacity_tokens=1000, program_tokens=750)
    assert quarter.score(RoutingRequest("m", "s", 100, new_program=True), [most]) == [1.0]


def test_any_other_request_scores_nothing_anywhere() -> None:
    candidates = [Fake("a", kv_capacity_tokens=1000, program_tokens=900), Fake("b", kv_capacity_tokens=1000)]
    assert SCORER.score(RoutingRequest("m", "s", 100), candidates) == [0.0, 0.0]


def test_a_fleet_full_everywhere_scores_nothing() -> None:
    candidates = [Fake(name, kv_capacity_tokens=1000, program_tokens=1200) for name in "ab"]
    assert SCORER.score(RoutingRequest("m", "s", 100, new_program=True), candidates) == [0.0, 0.0]


def test_the_yaml_type_is_registered() -> None:
    assert SCORERS["program-room"].params is ProgramRoomParams
