"""Two router processes in front of one fleet, told about each other: they hear each other's load, and a
router that stops drops out of the other's count."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from kvroute.processes import FleetPorts, free_port_block, running_router
from tests.conftest import sample


def _eventually(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time limit"
        time.sleep(0.05)


def test_routers_hear_each_other_and_forget_one_that_stops(fleet: FleetPorts, tmp_path: Path) -> None:
    port = free_port_block(2)
    first, second = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    timing = {"interval_s": 0.05, "stale_after_s": 0.5}
    with contextlib.ExitStack() as routers:
        second_url = routers.enter_context(running_router(
            fleet.router_config(peers={"publish": second, "subscribe": [first], **timing}), tmp_path, "second"
        ))  # fmt: skip
        with running_router(
            fleet.router_config(peers={"publish": first, "subscribe": [second], **timing}), tmp_path, "first"
        ) as first_url:
            for url in (first_url, second_url):
                _eventually(lambda url=url: sample(url, "kvroute_peer_routers") == 1)  # type: ignore[misc]
            applied = sample(second_url, "kvroute_peer_snapshots_total", result="applied")
            assert applied is not None and applied > 0
            assert sample(second_url, "kvroute_peer_snapshots_total", result="malformed") in (None, 0.0)
        _eventually(lambda: sample(second_url, "kvroute_peer_routers") == 0)
