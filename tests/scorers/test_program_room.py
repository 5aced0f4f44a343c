"""Program room: a request that starts an agent program scores each candidate by the KV its programs' working
sets leave free; any other request is left to the other scorers."""

from __future__ import annotations

import pytest

from scorers.program_room import ProgramRoomParams, ProgramRoomScorer, most_programs
from scorers.registry import SCORERS
from scorers.request import RoutingRequest, TierMatch
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


def starting(*cached: str, come_back: bool = True) -> RoutingRequest:
    """A request that starts a program, its prefix (the agents' instructions) cached at the instances named."""
    matches = {name: TierMatch(gpu=4) for name in cached}
    return RoutingRequest("m", "s", 100, matches=matches, new_program=True, programs_come_back=come_back)


def test_a_new_program_goes_to_no_instance_past_one_over_its_even_share_of_programs() -> None:
    """Sessions that start together while all are small must not all go where the instructions are cached:
    with the new one, 9 programs alive over 4 equal instances is 2.25 each, so 3 + 1 at most."""
    crowded = Fake("crowded", kv_capacity_tokens=400_000, program_tokens=20_000, programs_alive=4)
    at_most = Fake("at-most", kv_capacity_tokens=400_000, program_tokens=15_000, programs_alive=3)
    quiet = [Fake(name, kv_capacity_tokens=400_000, programs_alive=1) for name in ("c", "d")]
    request = starting("crowded", "at-most", "c")
    assert SCORER.score(request, [crowded, at_most, *quiet]) == [0.0, 1.0, 1.0, 1.0]


def test_only_a_cached_prefix_is_held_back() -> None:
    """What else pulls a program to a crowded instance (its load, its ties) is left to the other scorers."""
    crowded = Fake("crowded", kv_capacity_tokens=400_000, programs_alive=4)
    empty = Fake("empty", kv_capacity_tokens=400_000)
    assert SCORER.score(starting(), [crowded, empty]) == [1.0, 1.0]
    assert SCORER.score(starting("crowded"), [crowded, empty]) == [0.0, 1.0]


def test_programs_that_do_not_come_back_are_not_spread() -> None:
    """One-shot questions under session keys never grow: they go where their documents are cached."""
    crowded = Fake("crowded", kv_capacity_tokens=400_000, programs_alive=4)
    empty = Fake("empty", kv_capacity_tokens=400_000)
    assert SCORER.score(starting("crowded", come_back=False), [crowded, empty]) == [1.0, 1.0]


def test_a_second_program_still_joins_the_first_on_a_small_fleet() -> None:
    """Two programs over two instances: one over the even share lets a session go where another one's (and
    the agent's instructions') cache is."""
    holding = Fake("holding", kv_capacity_tokens=131_072, program_tokens=25_000, programs_alive=1)
    empty = Fake("empty", kv_capacity_tokens=131_072)
    assert SCORER.score(starting("holding"), [holding, empty]) == [1.0, 1.0]


def test_even_shares_follow_kv_capacity() -> None:
    """An instance with a third of the fleet's cache takes a third of the programs before it is passed over:
    8 with the new one, shares 6 and 2, so 7 and 3 at most (4 each with equal shares)."""
    large = Fake("large", kv_capacity_tokens=300_000, programs_alive=3)
    small = Fake("small", kv_capacity_tokens=100_000, programs_alive=4)
    assert SCORER.score(starting("large", "small"), [large, small]) == [1.0, 0.0]
    assert most_programs([large, Fake("unknown", programs_alive=4)], 1) == [5, 5]  # capacity not known: equal


def test_the_even_share_bound_can_be_turned_off() -> None:
    by_room = ProgramRoomScorer(ProgramRoomParams(over_even_share=None))
    crowded = Fake("crowded", kv_capacity_tokens=400_000, programs_alive=8)
    empty = Fake("empty", kv_capacity_tokens=400_000)
    assert by_room.score(starting("crowded"), [crowded, empty]) == [1.0, 1.0]


def test_the_yaml_type_is_registered() -> None:
    assert SCORERS["program-room"].params is ProgramRoomParams
