"""Admission by program: new programs wait while the working sets alive fill every instance's KV cache,
programs back go first, and room let go is not handed out twice."""

from __future__ import annotations

from router.programs.admission import ProgramGate
from tests.conftest import ManualClock
from tests.router.programs.instances import instance


def gate(clock: ManualClock, start_below: float | None = 0.9, max_wait_s: float = 30.0) -> ProgramGate[str]:
    return ProgramGate[str](start_below, max_wait_s, clock)


def test_a_new_program_waits_only_while_every_instance_is_full() -> None:
    clock = ManualClock()
    full, roomy = instance("a", 10_000, 8_500), instance("b", 10_000, 4_000)
    assert gate(clock, start_below=None).goes_now(1_000, [full])  # off
    assert not gate(clock).goes_now(1_000, [full])  # 8,500 + 1,000 passes 0.9 of 10,000
    assert gate(clock).goes_now(1_000, [full, roomy])
    assert gate(clock).goes_now(1_000, [full, instance("c", None)])  # capacity not known yet
    assert gate(clock).goes_now(9_500, [full])  # larger than 0.9 of any cache: it would only wait


def test_programs_back_go_before_new_ones_and_a_smaller_one_passes() -> None:
    clock = ManualClock()
    fleet = [instance("a", 10_000, 9_000)]
    waiting = gate(clock)
    waiting.hold("new-big", "p1", 5_000, lambda: fleet, back=False)
    waiting.hold("new-small", "p2", 1_000, lambda: fleet, back=False)
    waiting.hold("back", "p3", 2_000, lambda: fleet, back=True)
    assert not waiting.goes_now(100, fleet)  # others wait: a newcomer takes its turn after them
    assert waiting.release() == [] and waiting.waiting() == {"back": 1, "new": 2}
    fleet[0].program_tokens = 5_000  # a program's working set lapsed: 4,000 free under 0.9
    assert waiting.release() == ["back", "new-small"]  # 2,000 then 1,000 of the 4,000; 5,000 waits
    assert waiting.waiting() == {"back": 0, "new": 1}


def test_room_let_go_counts_until_the_turn_is_counted() -> None:
    clock = ManualClock()
    fleet = [instance("a", 10_000, 4_000)]
    waiting = gate(clock)
    waiting.hold("x", "p1", 3_000, lambda: fleet, back=False)
    waiting.hold("y", "p2", 3_000, lambda: fleet, back=False)
    assert waiting.release() == ["x"]  # 4,000 + 3,000 under 9,000; y's 3,000 more would pass it
    waiting.counted("p1")  # x's turn started: its working set is in the instance's
    fleet[0].program_tokens = 7_000
    assert waiting.release() == []
    fleet[0].program_tokens = 4_000  # another program's working set lapsed
    assert waiting.release() == ["y"]


def test_no_program_waits_past_the_bound_and_stale_grants_lapse() -> None:
    clock = ManualClock()
    fleet = [instance("a", 10_000, 4_000)]
    waiting = gate(clock, max_wait_s=5.0)
    waiting.hold("x", "p1", 3_000, lambda: fleet, back=False)
    assert waiting.release() == ["x"]  # its client goes away: it is never counted
    assert not waiting.goes_now(3_000, fleet)
    clock.now += 5.0
    assert waiting.goes_now(3_000, fleet)  # x's grant lapsed with the bound
    fleet[0].program_tokens = 9_000
    waiting.hold("y", "p2", 3_000, lambda: fleet, back=False)
    clock.now += 4.9
    assert waiting.release() == []
    clock.now += 0.1
    assert waiting.release() == ["y"] and len(waiting) == 0
