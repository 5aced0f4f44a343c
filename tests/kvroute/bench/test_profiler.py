"""The profile's stages: each sample of a thread at work counts for its innermost stage's frame; samples in
a system call, and idle threads', count for none."""

from __future__ import annotations

from pathlib import Path

from kvroute.bench.overhead.profiler import OTHER_STAGE, StageShare, hotspots, stage_shares

_SERVER = "0x7f01 (libc.so.6);run (uvicorn/server.py:86);_PyEval (libpython3.11.so);__call__ (router/http/proxy.py:40)"
_SAMPLES = [
    # scoring called from the HTTP layer, through asyncio, generated code and the interpreter: scoring's
    f"{_SERVER};send (router/dispatch/conductor.py:9);pick (scorers/policy.py:3);f (<string>:1);add (libpython.so) 6",
    # the flow gate's timeout, in asyncio: flow control's
    f"{_SERVER};wait (router/dispatch/wait/flow_gate.py:70);timeout (asyncio/timeouts.py:5) 2",
    f"{_SERVER} 1",
    "main (<frozen runpy>:1) 1",
    # in the kernel: the system CPU time counts it, not the samples
    f"{_SERVER};send (uvicorn/protocols/http/httptools_impl.py:500);write (libc.so.6) 30",
    f"{_SERVER};run (asyncio/runners.py:118);uv__io_poll (uvloop.so);epoll_wait (libc.so.6) 50",
    "0x7f02 (libc.so.6);Thread._bootstrap (threading.py:995);_worker (concurrent/futures/thread.py:81) 40",
]


def test_a_sample_counts_for_its_innermost_stage_and_system_calls_and_idle_threads_for_none(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "stacks.txt"
    raw.write_text("\n".join(_SAMPLES) + "\n")
    assert stage_shares(raw) == [
        StageShare("index match and scoring", 0.6),
        StageShare("flow control", 0.2),
        StageShare("front HTTP server (uvicorn, starlette), the event loop and kvroute's HTTP layer", 0.1),
        StageShare(OTHER_STAGE, 0.1),
    ]
    top = hotspots(raw)
    assert {spot.function for spot in top} >= {"pick (scorers/policy.py)", "run (uvicorn/server.py)"}
    assert not [spot for spot in top if "libc" in spot.function or "libpython" in spot.function]
    assert next(spot for spot in top if spot.function == "pick (scorers/policy.py)").own == 0.0
