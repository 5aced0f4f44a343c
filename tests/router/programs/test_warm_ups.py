"""Warming a program's next turn: where (the instance foreseen, when it lacks the prompt; the roomiest other,
when the working sets at the instance that answered pass its KV cache), and never where it is busy, full, or
holds the prompt already; the program's working set follows the warm-up, and its next turn tells whether the
warm-up paid."""

from __future__ import annotations

from collections.abc import Mapping

from router.metrics import RouterMetrics
from router.programs.settings import ProgramsConfig
from router.programs.table import NO_PROGRAMS, Programs
from router.programs.warm_ups import WarmUp, WarmUps
from scorers.candidate import EngineLoad
from scorers.request import RoutingRequest, TierMatch
from tests.conftest import ManualClock
from tests.router.programs.instances import instance

BLOCK = 16
PROMPT = 1_600  # 100 blocks


def prompt(matches: Mapping[str, TierMatch], key: str = "agent", tokens: int = PROMPT) -> RoutingRequest:
    blocks = tokens // BLOCK
    return RoutingRequest("m", key, tokens, blocks, BLOCK, matches, chain=list(range(blocks)))


def answered(
    tokens: int = PROMPT, at: str = "a", enabled: bool = True
) -> tuple[WarmUps, Programs, ManualClock, RouterMetrics]:
    """A program whose turn of tokens was answered at instance at: in its tool call now."""
    clock, metrics = ManualClock(100.0), RouterMetrics()
    programs = Programs(ProgramsConfig(warm_up=enabled), metrics, clock)
    turn = prompt({}, tokens=tokens)
    programs.turn_started(turn, at, clock())
    programs.turn_ended("agent")
    return WarmUps(enabled, programs, metrics), programs, clock, metrics


# The prompt in a's cache and in the pool, which every instance loads from
HELD_AT_A = {name: TierMatch(gpu=100) if name == "a" else TierMatch(pool=100) for name in "abc"}


def test_a_program_foreseen_to_move_is_warmed_where_it_goes() -> None:
    warm_ups, _, _, _ = answered()
    a, b = instance("a"), instance("b")
    assert warm_ups.where(prompt(HELD_AT_A), "a", b, [a, b]) == WarmUp(b, "moves", 0)
    assert warm_ups.where(prompt(HELD_AT_A), "a", a, [a, b]) is None  # it stays, and a has room for it
    held_at_b = {"a": TierMatch(gpu=100), "b": TierMatch(gpu=99)}
    assert warm_ups.where(prompt(held_at_b), "a", b, [a, b]) is None  # b holds it already (but the last)
    pooled_but_the_last = {"a": TierMatch(gpu=100), "b": TierMatch(pool=99)}
    assert warm_ups.where(prompt(pooled_but_the_last), "a", b, [a, b]) == WarmUp(b, "moves", BLOCK)
    not_pooled = {"a": TierMatch(gpu=100)}
    assert warm_ups.where(prompt(not_pooled), "a", b, [a, b]) is None  # b would compute it all again


def test_a_program_whose_kv_its_instance_cannot_keep_is_warmed_at_the_roomiest_other() -> None:
    warm_ups, _, _, _ = answered(tokens=PROMPT)
    a = instance("a", capacity=1_000)  # the working sets there (1,600) pass its KV cache
    b, c = instance("b", program_tokens=6_000), instance("c", program_tokens=2_000)
    assert warm_ups.where(prompt(HELD_AT_A), "a", a, [a, b, c]) == WarmUp(c, "evicted", 0)
    assert warm_ups.where(prompt(HELD_AT_A), "a", a, [a]) is None  # nowhere else to go


def test_no_warm_up_goes_where_the_instance_is_busy_or_the_working_set_does_not_fit() -> None:
    warm_ups, _, _, _ = answered()
    a = instance("a")
    prefilling = instance("b")
    prefilling.start(500, 500)  # another prompt's prefill queued there
    assert warm_ups.where(prompt(HELD_AT_A), "a", prefilling, [a, prefilling]) is None
    waiting = instance("b")
    waiting.load = EngineLoad(waiting=1, running=4, kv_usage=0.5)
    assert warm_ups.where(prompt(HELD_AT_A), "a", waiting, [a, waiting]) is None
    full = instance("b", program_tokens=9_000)  # 9,000 + 1,600 pass its 10,000
    assert warm_ups.where(prompt(HELD_AT_A), "a", full, [a, full]) is None


def test_no_warm_up_when_off_or_for_a_program_not_in_its_tool_call() -> None:
    a, b = instance("a"), instance("b")
    off, _, _, _ = answered(enabled=False)
    assert off.where(prompt(HELD_AT_A), "a", b, [a, b]) is None
    assert not WarmUps(True, NO_PROGRAMS, RouterMetrics()).enabled
    warm_ups, _, clock, _ = answered()
    assert warm_ups.where(prompt(HELD_AT_A, key="stranger"), "a", b, [a, b]) is None
    clock.now += 60.0  # past the time-to-live: its KV is no longer counted on, nor warmed
    assert warm_ups.where(prompt(HELD_AT_A), "a", b, [a, b]) is None


def test_the_working_set_follows_the_warm_up_and_the_next_turn_tells_whether_it_paid() -> None:
    warm_ups, programs, clock, metrics = answered()
    b = instance("b")
    warm_ups.sent("agent", WarmUp(b, "moves", 0))
    sets = programs.working_sets()
    assert sets["a"].tokens == 0 and sets["b"].tool_call == 1 and sets["b"].tokens == PROMPT
    assert (
        metrics.registry.get_sample_value(
            "kvroute_program_warm_ups_total", {"vllm_instance": "b", "reason": "moves"}
        )
        == 1.0
    )
    clock.now += 2.0
    programs.turn_started(prompt({"b": TierMatch(gpu=100)}, tokens=PROMPT + 64), "b", clock())
    assert metrics.registry.get_sample_value("kvroute_program_warm_ups_found_total", {"kv": "kept"}) == 1.0
    clock.now += 60.0  # a program not in its tool call is not moved
    programs.turn_ended("agent")
    clock.now += 60.0
    assert not programs.moved("agent", "a")
