"""py-spy on a router while wrk loads it: raw stacks to a file, and the functions that hold most samples.

Sampling pauses the process (py-spy's default, so stacks are consistent), which slows the router down: the
cell's own numbers are not used when it is profiled, only its shares of time. py-spy counts a thread that
is not idle, not a thread on a CPU: one preempted right after its socket write woke wrk or nginx counts
there as busy. So the stacks are native too, and the samples in a system call (a socket's read or write,
a poll) are left out of the shares; the kernel's part of a request is the system CPU time measured instead.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

_LINE = re.compile(r":\d+\)")  # "f (file.py:12)" -> "f (file.py)": functions, not lines
# Threads that only wait (the tokenizer's pool, anyio's workers) would count as busy in blocking mode.
_IDLE_THREAD = "Thread._bootstrap"
# A native stack's top in one of these is in a system call (glibc's wrappers, by py-spy's names).
_SYSTEM_CALLS = frozenset(
    {"write", "writev", "send", "sendmsg", "sendto", "read", "readv", "recv", "recvmsg"}
)
_SYSTEM_CALL_PREFIXES = ("epoll", "__libc_", "__GI___libc_")


# Where a request's CPU goes, by the innermost frame in one of these (file path prefixes, in py-spy's
# spelling; the first stage that names a frame's file has it); frames of no stage (asyncio, numpy, the
# standard library, generated code) count for their caller's.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "prompt: chat template and tokens",
        ("router/prompt/", "transformers/", "jinja2/", "tokenizers/", "<template>"),
    ),
    ("flow control", ("router/dispatch/wait/",)),
    (
        "answer accounting: TTFT learning, metrics, A/B",
        (
            "scorers/ttft_model.py",  # its observations; what it predicts for a choice is compiled
            "router/dispatch/observe/outcome.py",
            "router/dispatch/observe/ab.py",
            "router/dispatch/observe/usage.py",
            "router/metrics.py",
            "prometheus_client/",
            "router/tracing/",
        ),
    ),
    ("index match and scoring", ("router/index/", "scorers/")),
    (
        "request handling: attempts, load and in-flight bookkeeping, decision's glue",
        (
            "router/dispatch/",
            "router/traffic_split.py",
            "router/upstreams/instances.py",
            "router/upstreams/inflight_blocks.py",
            "router/upstreams/circuit_breaker.py",
            "router/upstreams/room.py",
            "router/upstreams/context_residency.py",
        ),
    ),
    ("upstream HTTP client (aiohttp)", ("aiohttp/", "yarl/", "multidict/", "router/upstreams/")),
    (
        "front HTTP server (uvicorn, starlette), the event loop and kvroute's HTTP layer",
        ("uvicorn/", "starlette/", "router/http/"),
    ),
)
OTHER_STAGE = "elsewhere (no stage's frame on the stack)"
_FRAME_FILE = re.compile(r"\(([^:)]*)")
_FRAME_FILE_PY = re.compile(r"\((?:[^:)]*\.py|<[^>]*>):\d+\)$")  # a Python frame's "(path.py:12)"


@dataclass(frozen=True)
class StageShare:
    stage: str
    share: float  # of the samples of threads at work, outside system calls


@dataclass(frozen=True)
class Hotspot:
    function: str
    inclusive: float  # share of the samples with this function on the stack
    own: float  # share with this function on top


def find_py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def start_recording(binary: str, pid: int, duration_s: float, out: Path) -> subprocess.Popen[bytes]:
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        binary,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(int(duration_s), 1)),
        "--rate",
        "250",
        "--format",
        "raw",
        "--native",
        "--output",
        str(out),
    ]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish_recording(process: subprocess.Popen[bytes], timeout_s: float) -> str:
    """'' once py-spy wrote its file, else why not (ptrace not allowed, the process gone...)."""
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return "py-spy did not finish"
    return "" if process.returncode == 0 else stderr.decode(errors="replace").strip()[-300:]


def hotspots(raw: Path, top: int = 25) -> list[Hotspot]:
    """The Python functions holding most samples, outside system calls."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for frames, samples in working_stacks(raw):
        total += samples
        frames = [_LINE.sub(")", frame) for frame in frames]
        for frame in set(frames):
            inclusive[frame] += samples
        own[frames[-1]] += samples
    if not total:
        return []
    return [
        Hotspot(function, round(count / total, 4), round(own[function] / total, 4))
        for function, count in inclusive.most_common(top)
    ]


def stage_shares(raw: Path) -> list[StageShare]:
    """Each STAGES' share of the samples outside system calls (OTHER_STAGE's too), largest first."""
    counts: collections.Counter[str] = collections.Counter()
    for frames, samples in working_stacks(raw):
        counts[_stage_of(frames)] += samples
    total = sum(counts.values())
    return [StageShare(stage, round(n / total, 4)) for stage, n in counts.most_common()] if total else []


def working_stacks(raw: Path) -> Iterator[tuple[list[str], int]]:
    """py-spy's samples of threads at work, outside system calls: their Python frames, and how many."""
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or _IDLE_THREAD in stack:
            continue
        frames = stack.split(";")
        top = frames[-1].partition(" (")[0]
        if top in _SYSTEM_CALLS or top.startswith(_SYSTEM_CALL_PREFIXES):
            continue
        python = [frame for frame in frames if _FRAME_FILE_PY.search(frame)]
        if python:
            yield python, int(count)


def _stage_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        found = _FRAME_FILE.search(frame)
        path = found.group(1) if found else ""
        for stage, prefixes in STAGES:
            if path.startswith(prefixes):
                return stage
    return OTHER_STAGE


@dataclass
class CellProfile:
    target: str
    concurrency: int
    size_bytes: int
    prompt: str
    raw: str  # py-spy's raw (collapsed) stacks: flamegraph.pl or speedscope read them
    error: str = ""
    hotspots: list[Hotspot] = field(default_factory=list)
    stages: list[StageShare] = field(default_factory=list)


class Profiler:
    """Records every kvroute router during the cells at the highest concurrency."""

    def __init__(self, binary: str, out_dir: Path, duration_s: float, concurrency: int) -> None:
        self._binary, self._dir, self._duration_s = binary, out_dir, duration_s
        self._concurrency = concurrency
        self.profiles: list[CellProfile] = []

    def start(
        self, target: str, kind: str, pid: int | None, concurrency: int, size_bytes: int, prompt: str
    ) -> _Recording | None:
        if kind != "kvroute" or pid is None or concurrency != self._concurrency:
            return None
        name = f"{target.replace(':', '-')}-c{concurrency}-{size_bytes}-{prompt}.txt"
        profile = CellProfile(target, concurrency, size_bytes, prompt, str(self._dir / name))
        return _Recording(self._binary, pid, self._duration_s, profile)

    def finish(self, recording: _Recording) -> None:
        recording.finish(self._duration_s + 30)
        profile = recording.profile
        if not profile.error:
            profile.hotspots = [h for h in hotspots(Path(profile.raw), 60) if h.inclusive < 0.99][:40]
            profile.stages = stage_shares(Path(profile.raw))
        self.profiles.append(profile)


class _Recording:
    """py-spy from 1 s into the wrk run to 1 s before its end: neither 64 connections opening (which py-spy
    sees as frames of coroutines just started) nor the router idle afterwards."""

    def __init__(self, binary: str, pid: int, duration_s: float, profile: CellProfile) -> None:
        self.profile = profile
        self._process: subprocess.Popen[bytes] | None = None
        args = (binary, pid, max(duration_s - 2, 1), Path(profile.raw))
        self._timer = threading.Timer(1.0, self._start, args)
        self._timer.start()

    def _start(self, binary: str, pid: int, duration_s: float, out: Path) -> None:
        self._process = start_recording(binary, pid, duration_s, out)

    def finish(self, timeout_s: float) -> None:
        self._timer.join()
        if self._process is None:
            self.profile.error = "py-spy did not start"
        else:
            self.profile.error = finish_recording(self._process, timeout_s)
