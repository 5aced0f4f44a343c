"""Agent programs as the router follows them: working sets counted while a turn runs and through a tool call
within the time-to-live, and what each next turn found of the KV its program's last turn left."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from router.metrics import RouterMetrics
from router.programs.settings import ProgramsConfig
from router.programs.table import EXPIRY_BATCH, Programs, WorkingSets
from scorers.request import RoutingRequest, TierMatch
from tests.conftest import ManualClock

BLOCK = 16


def turn(key: str | None, tokens: int, matches: Mapping[str, TierMatch] | None = None) -> RoutingRequest:
    return RoutingRequest("m", key, tokens, tokens // BLOCK, BLOCK, matches or {})


def programs(**settings: float) -> tuple[Programs, ManualClock, RouterMetrics]:
    clock, metrics = ManualClock(100.0), RouterMetrics()
    return Programs(ProgramsConfig(**settings), metrics, clock), clock, metrics  # type: ignore[arg-type]


def turns(metrics: RouterMetrics, kv: str, tool_call: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvroute_program_turns_total", {"kv": kv, "tool_call": tool_call}
    )
    return value or 0.0


def test_a_program_is_counted_running_then_in_its_tool_call_until_the_time_to_live() -> None:
    table, clock, metrics = programs(ttl_prior_s=10)
    assert table.turn_started(turn("s", 1000), "a", clock.now) == "first"
    assert table.working_sets() == {"a": WorkingSets(running=1, tool_call=0, tokens=1000)}
    clock.now += 2
    table.turn_ended("s")
    assert table.working_sets() == {"a": WorkingSets(running=0, tool_call=1, tokens=1000)}
    labels = {"vllm_instance": "a", "state": "tool_call"}
    assert metrics.registry.get_sample_value("kvroute_programs", labels) == 1
    clock.now += 10.5  # past the time-to-live: its KV is no longer counted, though the program is known
    table.expire()
    assert table.working_sets() == {"a": WorkingSets()}
    assert metrics.registry.get_sample_value("kvroute_programs", labels) == 0
    assert (
        metrics.registry.get_sample_value("kvroute_program_working_set_tokens", {"vllm_instance": "a"}) == 0
    )
    assert len(table) == 1


def test_a_next_turn_that_finds_its_kv_at_its_instance_is_kept_within_the_time_to_live() -> None:
    table, clock, metrics = programs(ttl_prior_s=10)
    table.turn_started(turn("s", 1000), "a", clock.now)
    table.turn_ended("s")
    clock.now += 3
    held = {"a": TierMatch(gpu=1000 // BLOCK), "b": TierMatch(gpu=2)}
    assert table.turn_started(turn("s", 1300, held), "a", clock.now) == "kept"
    assert turns(metrics, "kept", "within_ttl") == 1 and turns(metrics, "first", "none") == 1
    assert metrics.registry.get_sample_value("kvroute_program_tool_call_seconds_count") == 1
    # The next turn's prompt is its working set from now on.
    assert table.working_sets() == {"a": WorkingSets(running=1, tool_call=0, tokens=1300)}


@pytest.mark.parametrize(
    ("matches", "found"),
    [
        ({"a": TierMatch(gpu=61)}, "kept"),  # all but the last block of the last prompt's 62
        ({"a": TierMatch(gpu=30, cpu=31)}, "kept"),  # offloaded to the instance's CPU: still there
        ({"a": TierMatch(gpu=30), "b": TierMatch(gpu=62)}, "elsewhere"),  # another instance holds it
        ({"a": TierMatch(gpu=30, pool=32)}, "elsewhere"),  # the pool holds the rest
        ({"a": TierMatch(gpu=30)}, "lost"),
        ({}, "lost"),
    ],
)
def test_what_a_next_turn_found_of_its_programs_kv(matches: dict[str, TierMatch], found: str) -> None:
    table, clock, metrics = programs(ttl_prior_s=10)
    table.turn_started(turn("s", 1000), "a", clock.now)  # 62 whole blocks
    table.turn_ended("s")
    clock.now += 20  # past the time-to-live
    assert table.turn_started(turn("s", 1500, matches), "b", clock.now) == found
    assert turns(metrics, found, "past_ttl") == 1


def test_a_prompt_routed_without_prefix_knowledge_found_what_nobody_can_tell() -> None:
    table, clock, _ = programs()
    table.turn_started(turn("s", 1000), "a", clock.now)
    table.turn_ended("s")
    assert table.turn_started(turn("s", 0), "a", clock.now) == "unknown"


def test_a_side_request_runs_beside_its_turn_and_moves_nothing() -> None:
    """A subagent or a title request of the same session, sent while its turn runs: no tool call ended, and
    its short prompt leaves the working set where the long one is."""
    table, clock, metrics = programs()
    table.turn_started(turn("s", 8000), "a", clock.now)
    assert table.turn_started(turn("s", 300), "b", clock.now) == "concurrent"
    table.turn_ended("s")
    assert table.working_sets() == {"a": WorkingSets(running=1, tool_call=0, tokens=8000)}
    table.turn_ended("s")
    assert table.working_sets() == {"a": WorkingSets(running=0, tool_call=1, tokens=8000)}
    assert metrics.registry.get_sample_value("kvroute_program_tool_call_seconds_count") in (None, 0)


def test_a_turn_without_a_session_is_no_program() -> None:
    table, clock, _ = programs()
    assert table.turn_started(turn(None, 1000), "a", clock.now) is None
    table.turn_ended(None)
    assert len(table) == 0 and table.working_sets() == {}


def test_programs_idle_past_their_end_or_beyond_the_most_followed_are_forgotten() -> None:
    table, clock, _ = programs(idle_end_s=60, max_programs=2)
    for key in ("s1", "s2", "s3"):
        table.turn_started(turn(key, 100), "a", clock.now)
        table.turn_ended(key)
    assert len(table) == 2  # s1 went: the least recently heard from
    assert table.turn_started(turn("s1", 100), "a", clock.now) == "first"
    clock.now += 61
    table.expire()
    assert len(table) == 0 and table.working_sets() == {"a": WorkingSets()}


def test_a_mass_lapse_is_spread_over_looks_but_a_program_looked_up_lapses_at_once() -> None:
    table, clock, metrics = programs(idle_end_s=100)
    batch, count = EXPIRY_BATCH, 4 * EXPIRY_BATCH
    for n in range(count):
        table.turn_started(turn(f"s{n}", 100), "a", clock.now)
        table.turn_ended(f"s{n}")
    clock.now += table.tool_calls.ttl_s + 1  # every tool call lapses at once: a batch a look
    table.expire()
    assert table.at("a") == WorkingSets(tool_call=3 * batch, tokens=3 * batch * 100)
    last = f"s{count - 1}"
    assert not table.alive(last)  # a batch more, and its own lapse, though earlier ones wait
    assert table.at("a") == WorkingSets(tool_call=2 * batch - 1, tokens=(2 * batch - 1) * 100)
    # A next turn past the time-to-live, counted as one, though a batch of lapses before its own still waits.
    assert table.turn_started(turn(f"s{count - 2}", 200), "a", clock.now) == "lost"
    assert turns(metrics, "lost", "past_ttl") == 1
    assert table.at("a") == WorkingSets(running=1, tool_call=batch - 2, tokens=200 + (batch - 2) * 100)
    table.expire()
    assert table.at("a") == WorkingSets(running=1, tokens=200)
    clock.now += 101  # idle past their end: forgotten a batch a look, one turning up again at once
    table.expire()
    assert len(table) == count - batch
    assert table.turn_started(turn(last, 100), "a", clock.now) == "first"


def test_a_turn_ended_for_a_program_forgotten_meanwhile_counts_nothing() -> None:
    table, clock, _ = programs(max_programs=1)
    table.turn_started(turn("s1", 100), "a", clock.now)
    table.turn_started(turn("s2", 100), "a", clock.now)  # s1 forgotten while its turn runs
    table.turn_ended("s1")
    assert table.working_sets() == {"a": WorkingSets(running=1, tool_call=0, tokens=100)}


def test_a_program_is_alive_while_its_turn_runs_and_through_its_tool_call_within_the_time_to_live() -> None:
    table, clock, _ = programs(ttl_prior_s=10)
    assert not table.alive("s")  # its first request starts it
    table.turn_started(turn("s", 1000), "a", clock.now)
    assert table.alive("s")
    table.turn_ended("s")
    clock.now += 9
    assert table.alive("s")
    clock.now += 2  # its tool call outlasted the time-to-live: its next turn starts it anew
    assert not table.alive("s") and len(table) == 1


def test_under_kv_pressure_programs_in_a_tool_call_are_paused_the_longest_in_it_first() -> None:
    table, clock, metrics = programs(ttl_prior_s=60, pause_above=0.95, pause_to=0.8)
    table.capacity = lambda name: 10_000
    for key, tokens in (("old", 3_000), ("mid", 3_000), ("new", 3_000)):
        table.turn_started(turn(key, tokens), "a", clock.now)
        clock.now += 1
        table.turn_ended(key)
    assert table.working_sets()["a"] == WorkingSets(tool_call=3, tokens=9_000)  # under 0.95: none paused
    table.turn_started(turn("s", 1_000), "a", clock.now)  # 10,000 passes 0.95 of the cache
    # The longest in its tool call gives its working set up: 7,000 is under 0.8.
    assert table.working_sets()["a"] == WorkingSets(running=1, tool_call=2, tokens=7_000, paused=1)
    assert not table.alive("old") and table.alive("mid") and table.alive("new")
    assert table.known("old")  # its next turn starts as a program back
    labels = {"vllm_instance": "a", "state": "paused"}
    assert metrics.registry.get_sample_value("kvroute_programs", labels) == 1
    table.turn_started(turn("old", 3_200), "a", clock.now)  # back, and 10,200 pauses "mid" in its place
    assert table.working_sets()["a"] == WorkingSets(running=2, tool_call=1, tokens=7_200, paused=1)
    assert not table.alive("mid") and table.alive("old")
    assert metrics.registry.get_sample_value("kvroute_program_pauses_total", {"vllm_instance": "a"}) == 2


def test_programs_are_taken_to_come_back_until_most_tool_calls_lapse_without_a_next_turn() -> None:
    """One-shot questions under session keys (a RAG user each) never send a next turn: once a majority of
    the latest tool calls lapsed, programs are no longer taken to grow; agents coming back turn it again."""
    table, clock, _ = programs(ttl_prior_s=10)
    for n in range(30):
        table.turn_started(turn(f"q{n}", 1000), "a", clock.now)
        table.turn_ended(f"q{n}")
    assert table.come_back  # the prior: nothing has lapsed yet
    clock.now += 11
    table.expire()
    assert not table.come_back
    for n in range(40):
        table.turn_started(turn(f"agent{n}", 1000), "a", clock.now)
        table.turn_ended(f"agent{n}")
        clock.now += 0.1
        table.turn_started(turn(f"agent{n}", 1200), "a", clock.now)
        table.turn_ended(f"agent{n}")
    assert table.come_back  # 40 came back, 30 lapsed


def test_a_program_is_placed_anew_when_new_lapsed_or_its_instance_outgrown() -> None:
    """While the working sets at its instance fit the KV cache a program's next turn stays where its context
    is; once they outgrow it, its programs evict one another every turn, and the next to come back of those
    no larger than the mean there is placed as a starting one, where there is room: a large one stays, since
    a move costs the mover its whole context."""
    table, clock, _ = programs(ttl_prior_s=10)
    table.capacity = {"a": 10_000, "b": 10_000}.get
    assert table.placed_anew("s")  # new
    table.turn_started(turn("s", 4000), "a", clock.now)
    table.turn_ended("s")
    assert not table.placed_anew("s")  # in its tool call, its context fits
    table.turn_started(turn("t", 5000), "a", clock.now)
    assert not table.placed_anew("s")  # 9,000 of 10,000
    table.turn_started(turn("u", 2000), "a", clock.now)
    table.turn_ended("u")
    # 11,000: outgrown; the mean is 3,667
    assert table.placed_anew("u") and not table.placed_anew("s") and not table.placed_anew("t")
    table.turn_started(turn("u", 2200), "b", clock.now)  # u moved: a holds 9,000
    assert not table.placed_anew("t") and not table.placed_anew("s") and not table.placed_anew("u")
    clock.now += 11
    assert table.placed_anew("s")  # its working set lapsed
