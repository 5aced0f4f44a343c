"""The profile's stages: each sample counts for the innermost frame that belongs to one."""

from __future__ import annotations

from pathlib import Path

from kvroute.bench.overhead.profiler import OTHER_STAGE, StageShare, stage_shares

_SERVER = "run (uvicorn/server.py:86);__call__ (router/http/proxy.py:40)"


def test_a_sample_counts_for_its_innermost_stage_and_idle_threads_for_none(tmp_path: Path) -> None:
    raw = tmp_path / "stacks.txt"
    raw.write_text(
        "\n".join(
            [
                # scoring called from the HTTP layer, through asyncio and generated code: scoring's
                f"{_SERVER};send (router/dispatch/routing.py:9);pick (scorers/policy.py:3);f (<string>:1) 6",
                # the flow gate's timeout, in asyncio: flow control's
                f"{_SERVER};wait (router/dispatch/flow_gate.py:70);timeout (asyncio/timeouts.py:5) 2",
                f"{_SERVER} 1",
                "main (<frozen runpy>:1) 1",
                "Thread._bootstrap (threading.py:995);_worker (concurrent/futures/thread.py:81) 40",
            ]
        )
        + "\n"
    )
    assert stage_shares(raw) == [
        StageShare("index match and scoring", 0.6),
        StageShare("flow control", 0.2),
        StageShare("front HTTP server (uvicorn, starlette), the event loop and kvroute's HTTP layer", 0.1),
        StageShare(OTHER_STAGE, 0.1),
    ]
