"""Requests held in the router while no instance has KV memory for them: who waits, who goes, and when."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

from kvroute.processes import FleetPorts, running_fleet, running_router
from router.dispatch.wait.memory_gate import MemoryGate
from router.upstreams.instances import Instance, InstanceSetup
from tests.conftest import ManualClock, metric, sample
from tests.support.http import get_json, post


def instance(name: str, capacity: int | None, in_flight_tokens: int = 0) -> Instance:
    made = Instance(
        name=name,
        url=f"http://{name}",
        models=frozenset({"m"}),
        setup=InstanceSetup(kv_capacity_tokens=capacity),
    )
    if in_flight_tokens:
        made.start(in_flight_tokens, 0)
    return made


def holding(
    fleet: list[Instance], max_hold_s: float, clock: ManualClock, *requests: tuple[str, int]
) -> MemoryGate[str]:
    """A hold with these requests (name, prompt tokens) held, in order, for fleet."""
    hold = MemoryGate[str](max_hold_s, clock)
    for name, tokens in requests:
        hold.hold(name, tokens, lambda: fleet)
    return hold


def test_off_by_default_and_without_known_capacity() -> None:
    full = [instance("a", 1000, 1000)]
    assert not MemoryGate[str](0.0).must_wait(500, full)
    hold = MemoryGate[str](5.0)
    assert hold.must_wait(500, full)
    assert not hold.must_wait(500, [*full, instance("b", None)])  # its capacity not scraped yet
    assert not hold.must_wait(500, [*full, instance("c", 2000, 1500)])


def test_a_request_that_fits_passes_those_that_do_not() -> None:
    fleet = [instance("a", 10_000, 9_000)]
    hold = holding(fleet, 30.0, ManualClock(), ("big", 5_000), ("small", 800))
    assert hold.release() == ["small"]
    hold.started(800)
    fleet[0].start(800, 0)
    assert hold.release() == [] and len(hold) == 1
    fleet[0].end(9_000)  # memory freed up
    assert hold.release() == ["big"] and len(hold) == 0


def test_released_prompts_count_until_they_are_in_flight() -> None:
    fleet = [instance("a", 1_000)]
    hold = holding(fleet, 30.0, ManualClock(), ("first", 600), ("second", 600))
    assert hold.release() == ["first"]  # the second does not fit beside it, though it is not started yet
    assert hold.release() == []
    hold.started(600)
    fleet[0].start(600, 0)
    assert hold.release() == []
    assert not hold.must_wait(400, fleet)


def test_the_prefix_an_instance_holds_in_flight_takes_no_more_room_there() -> None:
    """A turn whose conversation so far is in flight on an instance needs room there only for what it adds,
    as the engine's prefix cache counts it; another prompt of the same length needs room for all of it."""
    block = 16
    conversation = list(range(1, 65))  # 1,024 tokens in whole blocks
    full = instance("a", 1_600)
    full.start(1_024, 0, chain=conversation)
    hold = MemoryGate[str](5.0)
    next_turn = [*conversation, *range(100, 132)]  # 512 tokens more
    assert not hold.must_wait(len(next_turn) * block, [full], next_turn)
    assert hold.must_wait(len(next_turn) * block, [full], list(range(200, 296)))
    held = holding([full], 5.0, ManualClock())
    held.hold("other", 1_536, lambda: [full], list(range(200, 296)))
    held.hold("turn", 1_536, lambda: [full], next_turn)
    assert held.release() == ["turn"]


def test_none_is_held_past_the_bound_and_a_leaver_is_dropped() -> None:
    clock = ManualClock()
    hold = holding([instance("a", 1_000, 1_000)], 5.0, clock, ("gone", 100), ("patient", 100))
    hold.drop("gone")
    clock.now = 4.9
    assert hold.release() == []
    clock.now = 5.0
    assert hold.release() == ["patient"] and len(hold) == 0


def test_the_proxy_holds_a_prompt_until_the_one_filling_memory_ends(tmp_path: Path) -> None:
    """One instance of 16 blocks of 32 tokens (512): a 300-token stream is in flight, so a second 300-token
    prompt, sharing none of its blocks, waits in the router, not at the engine, until the stream ends."""
    ports = FleetPorts.allocate(1)
    with running_fleet(ports, tmp_path, ["--kv-blocks", "16", "--decode-tps", "20"]):
        config = ports.router_config(admission={"memory_hold_s": 30})
        with running_router(config, tmp_path) as url:
            deadline = time.monotonic() + 30
            while get_json(url + "/dashboard/state")["instances"][0]["kv_capacity_tokens"] != 512:
                assert time.monotonic() < deadline, "the router never read the instance's KV capacity"
                time.sleep(0.1)
            stream = {"model": "tiny-llama", "prompt": [5] * 300, "max_tokens": 30, "stream": True}
            request = urllib.request.Request(
                url + "/v1/completions", json.dumps(stream).encode(), {"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=60) as streaming:
                streaming.readline()  # the stream has started: its context is in flight
                second = threading.Thread(
                    target=post,
                    args=(
                        url + "/v1/completions",
                        json.dumps(
                            {**stream, "prompt": [6] * 300, "stream": False, "max_tokens": 1}
                        ).encode(),
                    ),
                )
                second.start()
                time.sleep(0.5)
                assert second.is_alive()
                assert sample(url, "kvroute_memory_hold_seconds_count", model="tiny-llama") is None  # held
                streaming.read()
            second.join(timeout=30)
            assert not second.is_alive()
            assert metric(url, "kvroute_memory_hold_seconds_count", model="tiny-llama") == 1
            assert metric(url, "kvroute_memory_hold_seconds_sum", model="tiny-llama") > 0.3


def test_a_prompt_larger_than_every_instance_is_not_held() -> None:
    fleet = [instance("a", 1_000, 900), instance("b", 2_000, 1_900)]
    hold = MemoryGate[str](30.0)
    assert hold.must_wait(1_500, fleet)
    assert not hold.must_wait(2_500, fleet)  # no instance could ever take it: the engine says so at once
