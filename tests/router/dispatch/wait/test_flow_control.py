"""Flow control's queue: who waits, in what order requests leave, and what is refused."""

from __future__ import annotations

import math

import pytest

from router.dispatch.wait.flow_control import Demand, FlowControl, Refused
from router.dispatch.wait.flow_queue import FlowQueue, Queued
from router.dispatch.wait.saturation import Saturation
from router.dispatch.wait.settings import FlowControlConfig, ObjectiveConfig
from router.upstreams.instances import Instance, InstanceSetup
from tests.conftest import ManualClock


class Room:
    """Whether the fleet has room, as a test sets it: while open, for as much work let go and not yet placed
    as budget (predicted uncached tokens)."""

    def __init__(self, open_: bool = False, budget: float = math.inf) -> None:
        self.open, self.budget = open_, budget

    def __call__(self, extra_work: float, extra_tokens: int) -> bool:
        return self.open and extra_work < self.budget


def control(clock: ManualClock, **settings: object) -> FlowControl[str]:
    return FlowControl(FlowControlConfig(**settings), clock)  # type: ignore[arg-type]


def drain(flow: FlowControl[str], limit: int = 100) -> list[str]:
    """What leaves while the room stays open, each placed at once."""
    out: list[str] = []
    while len(out) < limit and (entry := flow.next_ready()) is not None:
        out.append(entry.item)
        flow.placed(entry)
    return out


def test_goes_at_once_while_there_is_room_and_nobody_waits() -> None:
    clock, room = ManualClock(), Room(True)
    flow = control(clock)
    assert flow.admit("a", Demand("m", "f", None, 100, 100), room) is None
    room.open = False
    assert flow.admit("b", Demand("m", "f", None, 100, 100), room) is not None
    room.open = True  # someone waits: a newcomer queues behind (and may pass) it, not around it
    assert flow.admit("c", Demand("m", "g", None, 10, 10), room) is not None
    assert flow.admit("d", Demand("m", "f", None, 1, 1), room) is not None
    assert drain(flow) == ["c", "b", "d"]  # within a flow, first come first served


@pytest.mark.parametrize(
    ("ordering", "expected"),
    [
        ("spt", ["short", "middle", "long"]),
        ("fcfs", ["long", "short", "middle"]),
        ("edf", ["long", "short", "middle"]),
    ],
)
def test_ordering_of_single_request_flows(ordering: str, expected: list[str]) -> None:
    """Each session (one flow) has one request waiting: spt takes the least uncached work first."""
    clock, room = ManualClock(), Room()
    flow = control(clock, ordering=ordering)
    for name, work in (("long", 30_000), ("short", 100), ("middle", 2_000)):
        flow.admit(name, Demand("m", f"session-{name}", None, work, work), room)
        clock.now += 0.001
    room.open = True
    assert drain(flow) == expected


def test_a_long_prompt_waits_a_bounded_time_for_later_short_ones() -> None:
    """At 10,000 tokens a second of aging, a 50,000-token prompt lets shorter ones that come within 5 s of it
    pass, not later ones."""
    clock, room = ManualClock(), Room()
    flow = control(clock, aging_tokens_per_s=10_000)
    flow.admit("long", Demand("m", "a", None, 50_000, 50_000), room)
    clock.now = 4.0
    flow.admit("within", Demand("m", "b", None, 10, 10), room)
    clock.now = 5.5
    flow.admit("after", Demand("m", "c", None, 10, 10), room)
    room.open = True
    assert drain(flow) == ["within", "long", "after"]


def test_a_backlogged_flow_cannot_crowd_out_another() -> None:
    """Flow "flood" queues 8 requests before "turns" queues 2 of the same size: they alternate."""
    clock, room = ManualClock(), Room()
    flow = control(clock, ordering="fcfs")
    for n in range(8):
        flow.admit(f"flood-{n}", Demand("m", "flood", None, 1000, 1000), room)
    for n in range(2):
        flow.admit(f"turn-{n}", Demand("m", "turns", None, 1000, 1000), room)
    room.open = True
    assert drain(flow, 4) == ["flood-0", "turn-0", "flood-1", "turn-1"]


def test_spt_shares_by_tokens_between_backlogged_flows() -> None:
    """Under spt a flow of long prompts gets fewer dispatches, not fewer tokens, than one of short ones."""
    clock, room = ManualClock(), Room()
    flow = control(clock)
    for n in range(20):
        flow.admit(f"long-{n}", Demand("m", "batch", None, 9_999, 9_999), room)
        flow.admit(f"short-{n}", Demand("m", "chat", None, 999, 999), room)
    room.open = True
    first = drain(flow, 22)
    assert sum(name.startswith("short") for name in first) == 20  # 20 x 1,000 tokens beside 2 x 10,000
    assert sum(name.startswith("long") for name in first) == 2


def test_higher_priority_band_leaves_first_and_unknown_objective_is_default() -> None:
    clock, room = ManualClock(), Room()
    objectives = {"interactive": ObjectiveConfig(priority=10), "batch": ObjectiveConfig(priority=-10)}
    flow = control(clock, objectives=objectives)
    flow.admit("batch", Demand("m", "x", "batch", 1, 1), room)
    flow.admit("default", Demand("m", "x", "no-such-objective", 1, 1), room)
    flow.admit("interactive", Demand("m", "x", "interactive", 50_000, 50_000), room)
    room.open = True
    assert drain(flow) == ["interactive", "default", "batch"]


def test_queue_limit_refuses_and_deadline_expires() -> None:
    clock, room = ManualClock(), Room()
    flow = control(clock, objectives={"default": ObjectiveConfig(max_queued=2, max_queue_s=5.0)})
    a = flow.admit("a", Demand("m", "f", None, 1, 1), room)
    flow.admit("b", Demand("m", "f", None, 1, 1), room)
    with pytest.raises(Refused) as refused:
        flow.admit("c", Demand("m", "f", None, 1, 1), room)
    assert refused.value.code == "queue_full" and refused.value.retry_after_s == 5
    clock.now = 4.9
    assert flow.expired() == []
    clock.now = 5.0
    assert {e.item for e in flow.expired()} == {"a", "b"} and flow.queued() == 0
    assert a is not None and not a.live
    room.open = True
    assert drain(flow) == []


def test_a_client_that_leaves_is_dequeued() -> None:
    clock, room = ManualClock(), Room()
    flow = control(clock)
    gone = flow.admit("gone", Demand("m", "f", None, 1, 1), room)
    flow.admit("stays", Demand("m", "f", None, 2, 2), room)
    assert gone is not None
    flow.leave(gone)
    room.open = True
    assert drain(flow) == ["stays"]


def test_in_flight_limit_holds_a_flow_back_until_one_ends() -> None:
    clock, room = ManualClock(), Room(True)
    flow = control(clock, per_flow={"max_in_flight": 1})
    assert flow.admit("a1", Demand("m", "a", None, 1, 1), room) is None
    assert flow.admit("a2", Demand("m", "a", None, 1, 1), room) is not None  # a is at its limit: a2 waits
    assert flow.admit("b1", Demand("m", "b", None, 1, 1), room) is not None  # someone waits: b1 queues too
    assert drain(flow) == ["b1"]  # a2 is skipped, b1 is not held behind it
    flow.ended("a", "default")
    assert drain(flow) == ["a2"]


def test_tokens_per_second_refuses_with_retry_after() -> None:
    clock, room = ManualClock(), Room(True)
    flow = control(clock, per_flow={"tokens_per_s": 1000.0})
    assert (
        flow.admit("a", Demand("m", "f", None, 3000, 3000), room) is None
    )  # a burst may overdraw the bucket
    with pytest.raises(Refused) as refused:
        flow.admit("b", Demand("m", "f", None, 10, 10), room)
    assert refused.value.code == "rate_limited" and refused.value.retry_after_s == 2
    assert flow.admit("other", Demand("m", "g", None, 10, 10), room) is None  # another flow has its own
    clock.now = 2.0
    assert flow.admit("b", Demand("m", "f", None, 10, 10), room) is None


def test_let_go_while_the_room_holds_those_not_yet_placed() -> None:
    """Waiters let go count against the room until placed, so the room they take is not given twice; as many
    go at once as it holds. (One at a time, a queue that formed once stayed: every arrival found it non-empty
    and waited its turn while the instances had room.)"""
    clock, room = ManualClock(), Room(budget=2.5)
    flow = control(clock)
    for name in ("a", "b", "c", "d"):
        flow.admit(name, Demand("m", name, None, 1, 1), room)
    room.open = True
    let_go = [entry for _ in range(4) if (entry := flow.next_ready()) is not None]
    assert [entry.item for entry in let_go] == ["a", "b", "c"]  # 0, 1 and 2 tokens let go: within 2.5
    assert (
        flow.admit("e", Demand("m", "e", None, 1, 1), room) is not None
    )  # nor does an arrival jump the queue
    flow.placed(let_go[0])
    last = flow.next_ready()
    assert last is not None and last.item == "d" and flow.next_ready() is None
    for entry in [*let_go[1:], last]:
        flow.placed(entry)
    assert drain(flow) == ["e"]
    assert flow.admit("f", Demand("m", "f", None, 1, 1), room) is None  # all placed, nobody waits: at once


def test_a_queue_that_formed_empties_at_once_when_the_instances_have_room() -> None:
    clock, room = ManualClock(), Room()
    flow = control(clock)
    for n in range(50):
        flow.admit(f"r{n}", Demand("m", "f", None, 6, 460), room)
    room.open = True
    assert len([entry for _ in range(60) if (entry := flow.next_ready()) is not None]) == 50


def test_reload_keeps_the_queue_and_takes_new_limits() -> None:
    clock, room = ManualClock(), Room()
    flow = control(clock)
    flow.admit("a", Demand("m", "f", None, 1, 1), room)
    flow.configure(FlowControlConfig(objectives={"default": ObjectiveConfig(max_queued=1)}))
    with pytest.raises(Refused):
        flow.admit("b", Demand("m", "f", None, 1, 1), room)
    room.open = True
    assert drain(flow) == ["a"]


def test_memory_of_flows_is_bounded() -> None:
    clock = ManualClock()
    queue = FlowQueue[int]("spt", clock=clock)
    for n in range(20_000):
        clock.now = n * 0.01
        entry = Queued(n, f"session-{n}", "default", 0, 10.0, clock.now, clock.now + 10.0)
        queue.add(entry)
        queue.remove(entry)
    assert len(queue) == 0 and not queue.by_flow
    queue.add(Queued(-1, "last", "default", 0, 10.0, clock.now, clock.now + 10.0))
    assert all(len(band.shares) <= 4097 for band in queue._bands.values())


def saturated_instance(pending_tokens: int, capacity: int | None = None, active: int = 0) -> Instance:
    instance = Instance(
        name="i", url="http://i", models=frozenset({"m"}), setup=InstanceSetup(kv_capacity_tokens=capacity)
    )
    instance.own_pending_prefill_tokens = pending_tokens
    if active:
        instance.start(active, 0)
    return instance


def test_saturation_by_queued_prefill_and_by_memory() -> None:
    saturation = Saturation(engine_queue_s=0.5, kv_usage=0.9)
    rate = saturated_instance(0).ttft_model.queue_rate  # seconds per queued token
    under, over = int(0.4 / rate), int(0.6 / rate)
    assert saturation.open(saturated_instance(under))
    assert not saturation.open(saturated_instance(over))
    assert not saturation.open(saturated_instance(0, capacity=1000, active=950))
    assert saturation.open(saturated_instance(0, capacity=1000, active=800))
    assert saturation.has_room([saturated_instance(over), saturated_instance(under)])
    assert not saturation.has_room([saturated_instance(over)])
    assert saturation.has_room([])  # nothing serves it: it goes on to be answered 503, not to wait


def test_a_flow_charged_for_requests_that_timed_out_is_not_starved_later() -> None:
    """Flow a queues far more than it is served and its requests time out; once flow b competes with it,
    they take turns: a's clock ran at most one queue limit ahead."""
    clock, room = ManualClock(), Room()
    flow = control(clock, objectives={"default": ObjectiveConfig(max_queue_s=20.0)})
    for n in range(100):
        flow.admit(f"old-{n}", Demand("m", "a", None, 10_000, 10_000), room)
    clock.now = 21.0
    assert len(flow.expired()) == 100
    for n in range(3):
        flow.admit(f"a-{n}", Demand("m", "a", None, 10_000, 10_000), room)
        flow.admit(f"b-{n}", Demand("m", "b", None, 10_000, 10_000), room)
    room.open = True
    assert drain(flow) == ["a-0", "b-0", "a-1", "b-1", "a-2", "b-2"]


def test_a_flow_over_its_rate_does_not_spend_its_objectives() -> None:
    clock, room = ManualClock(), Room(True)
    objectives = {"default": ObjectiveConfig(tokens_per_s=10_000)}
    flow = control(clock, objectives=objectives, per_flow={"tokens_per_s": 1_000.0})
    assert flow.admit("f1", Demand("m", "f", None, 3_000, 3_000), room) is None
    with pytest.raises(Refused):
        flow.admit("f2", Demand("m", "f", None, 10, 10), room)  # f's own bucket: refused, nothing charged
    assert flow.admit("g1", Demand("m", "g", None, 7_000, 7_000), room) is None
    assert (
        flow.admit("h1", Demand("m", "h", None, 10, 10), room) is None
    )  # the objective's 10,000 are not overdrawn
    with pytest.raises(Refused):
        flow.admit("h2", Demand("m", "h", None, 10, 10), room)


def test_a_request_refused_for_a_full_queue_spends_no_rate() -> None:
    clock, room = ManualClock(), Room()
    objectives = {"default": ObjectiveConfig(max_queued=1, tokens_per_s=10_000)}
    flow = control(clock, objectives=objectives)
    assert flow.admit("waits", Demand("m", "f", None, 6_000, 6_000), room) is not None
    with pytest.raises(Refused) as refused:
        flow.admit("full", Demand("m", "g", None, 6_000, 6_000), room)
    assert refused.value.code == "queue_full"
    room.open = True
    assert drain(flow) == ["waits"]
    # 4,000 left: the refused request took none (had it, the bucket would be 2,000 overdrawn)
    assert flow.admit("next", Demand("m", "h", None, 10, 10), room) is None
