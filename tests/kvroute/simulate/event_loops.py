"""Running a simulated event loop part of the way: a router that ticks while programs wait never lets the
loop run dry by itself."""

from __future__ import annotations

import pytest

from kvroute.simulate.clock import EventLoop


class _Stop(Exception):
    pass


def run_until(loop: EventLoop, time_s: float) -> None:
    """Run the loop's events until time_s."""

    def stop() -> None:
        raise _Stop

    loop.at(time_s, stop)
    with pytest.raises(_Stop):
        loop.run()
