"""The subscribers' shared turns (router/index/ingest_turns.py): while several instances' events wait, one
run of ingest goes a turn of the event loop, so a request's every await waits for one run, not one each."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.index.ingest_turns import IngestTurns


def test_waiting_subscribers_take_one_run_a_turn_and_a_request_goes_between() -> None:
    turns = IngestTurns(slice_s=0.001)
    order: list[str] = []

    async def subscriber(name: str) -> None:
        for _ in range(4):
            await turns.take()
            started = time.perf_counter()
            while time.perf_counter() - started < 0.002:  # a run past its slice
                pass
            order.append(name)
            turns.spent(started)

    async def request() -> None:
        for _ in range(16):
            order.append("request")
            await asyncio.sleep(0)  # one turn of the loop

    async def main() -> None:
        await asyncio.gather(subscriber("a"), subscriber("b"), subscriber("c"), request())

    asyncio.run(main())
    runs_between = [len(part.split()) for part in " ".join(order).split("request")[1:-1]]
    assert sorted(order.count(name) for name in "abc") == [4, 4, 4]
    assert max(runs_between) == 1, order  # each subscriber's run a turn of its own: without turns, three


def test_a_lone_subscriber_goes_on_while_its_turn_has_time() -> None:
    turns = IngestTurns(slice_s=1.0)

    async def main() -> int:
        runs = 0
        for _ in range(100):
            await turns.take()
            started = time.perf_counter()
            runs += 1
            turns.spent(started)
        return runs

    assert asyncio.run(asyncio.wait_for(main(), 1.0)) == 100


def test_runs_let_into_one_turn_share_its_slice() -> None:
    turns = IngestTurns(slice_s=0.004)
    budgets: list[float] = []

    async def subscriber() -> None:
        await turns.take()
        started = time.perf_counter()
        ends = turns.run_ends(started)
        budgets.append(ends - started)
        while time.perf_counter() < ends:  # a burst's run: as long as it may
            pass
        turns.spent(started)

    async def main() -> None:
        for _ in range(50):  # short runs before (a message each, as before a burst)
            turns.spent(time.perf_counter() - 0.00001)
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # a turn of its own: the slice starts afresh
        # The first takes this turn's slice; the next turn lets the four others in at once.
        await asyncio.gather(*(subscriber() for _ in range(5)))

    asyncio.run(main())
    assert budgets[0] == pytest.approx(0.004)
    # Their budgets add up to about one slice, not four.
    assert len(budgets) == 5 and sum(budgets[1:]) <= 0.004 * 1.5, budgets


def test_turns_are_short_while_the_router_has_requests_and_for_a_while_after() -> None:
    requests = [1]
    # A hold long enough that a loaded machine's stall between two turns does not outlast it
    turns = IngestTurns(slice_s=0.004, busy_slice_s=0.001, busy=lambda: requests[0] > 0, busy_hold_s=0.5)

    async def next_turn() -> float:
        turns.spent(time.perf_counter())  # a run ended: the next turn's slice is set at its start
        await asyncio.sleep(0)
        return turns.slice_s

    async def main() -> list[float]:
        slices = [await next_turn()]
        requests[0] = 0
        slices.append(await next_turn())  # the last request just ended: still short
        await asyncio.sleep(0.6)
        slices.append(await next_turn())
        return slices

    assert asyncio.run(main()) == [0.001, 0.001, 0.004]
