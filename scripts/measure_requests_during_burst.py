"""How long 1-token chats through a lone `kvroute serve` take while it ingests a burst of KV events, and
how much of that the router adds.

The router follows 8 publisher processes (kvroute bench index's, 32 blocks of 16 tokens a message) and routes
to one fake engine, a process of its own that answers at once; a client sends chats one after another, first
for 3 s while nothing is published, then while the publishers send BLOCKS as fast as ZMQ takes them. Each chat
through the router is followed by the same chat sent to the engine directly: on these 2 cores the publishers,
the client and the engine wait for a CPU as the router does, and the direct chat's time is what the router
did not add. Prints the p50, p99 and longest of the chats through the router, of the direct ones, and of the
time added (a chat's time less its direct twin's), idle and during the burst (the chats sent between its first
message and its last block held).

    .venv/bin/python scripts/measure_requests_during_burst.py --blocks 2000000
    .venv/bin/python scripts/measure_requests_during_burst.py --blocks 2000000 --router-cpu 0

With --router-cpu N the router runs alone on CPU N and the rest (the publishers, the client and the engine) on
the other CPUs, as a router deployed apart from its engines runs: what the chats then lose during the burst is
the router's ingest, not the publishers' share of the same cores. With --publishers-nice 19 as well, the
publishers take what CPU the client and the engine leave, as engines on machines of their own would: the
direct chats then keep their idle times. One cost of the shared cores is left: the router wakes the engine
from the other CPU, which a publisher then holds for up to a scheduler slice (~5 ms), where a direct chat
hands the engine the CPU its client gives up. With --engine-first as well, the engine and the client run
whenever they are ready (SCHED_FIFO), as on machines of their own: the time added is then the router's alone.

The followed instances answer /health and /metrics (empty) as engines that are up; with --followed-down their
HTTP ports are closed, as engines whose HTTP side is down while their events still come.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvroute.bench.index_ingest import Publishers, publishing  # noqa: E402
from kvroute.bench.index_workers import wait_held, wait_subscribed  # noqa: E402
from kvroute.processes import free_port_block, http_ok, spawn, start  # noqa: E402
from tests.support.fake_upstreams import healthy  # noqa: E402

PUBLISHERS = 8  # each the events of one instance
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
ANSWER = {
    "id": "c",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


async def answer(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response(ANSWER)


def _chat(url: str) -> float:
    sent = time.monotonic()
    request = urllib.request.Request(url + "/v1/chat/completions", CHAT, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        reply.read()
    return time.monotonic() - sent


def chats_for(
    url: str, engine: str, seconds: float, timed: list[tuple[float, float, float]], first: bool = False
) -> None:
    """(sent at, seconds taken through the router, seconds taken sent directly to the engine) of each pair of
    chats sent one after another for seconds; first: this thread before any other of its CPU's."""
    if first:
        run_first(threading.get_native_id())
    ends = time.monotonic() + seconds
    while True:
        sent = time.monotonic()
        routed = _chat(url)
        timed.append((sent, routed, _chat(engine)))
        if time.monotonic() >= ends:
            return
        time.sleep(0.002)


def run_first(thread: int) -> None:
    """thread (a process's first thread: the process) takes its CPU whenever it is ready, as on a machine
    of its own: SCHED_FIFO, which needs CAP_SYS_NICE."""
    try:
        os.sched_setscheduler(thread, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        raise SystemExit("--engine-first needs CAP_SYS_NICE (root) for SCHED_FIFO") from None


def _serve_engine(port: int) -> None:
    """The fake engine's process."""
    app = web.Application()
    app.router.add_get("/health", healthy)
    app.router.add_post("/v1/chat/completions", answer)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def wait_answering(url: str, within_s: float = 30.0) -> None:
    """Until the router has found the engine up and routes a chat to it."""
    ends = time.monotonic() + within_s
    while True:
        try:
            _chat(url)
            return
        except urllib.error.HTTPError:
            if time.monotonic() > ends:
                raise
            time.sleep(0.2)


def summary(taken: list[float]) -> str:
    taken = sorted(taken)
    p99 = taken[max(0, round(len(taken) * 0.99) - 1)]
    p50, longest = statistics.median(taken), taken[-1]
    return f"p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms, longest {longest * 1000:.2f} ms"


def report(name: str, timed: list[tuple[float, float, float]]) -> None:
    print(f"{name}: {len(timed)} chats")
    print(f"  through the router: {summary([routed for _, routed, _ in timed])}")
    print(f"  to the engine directly: {summary([direct for _, _, direct in timed])}")
    print(f"  added by the router: {summary([routed - direct for _, routed, direct in timed])}")


def _serve_followed(first_port: int, count: int) -> None:
    """The followed instances' HTTP side, in a process of its own: up, with no load to report."""

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/health", healthy)
        app.router.add_get("/metrics", lambda _: web.Response(text=""))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for n in range(count):
            await web.TCPSite(runner, "127.0.0.1", first_port + n).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


def router_config(sent: Publishers, engine_port: int, followed_port: int) -> dict[str, object]:
    # Another model's instances, so that no chat is sent to them: only their events are followed.
    followed = [
        {
            "name": f"p{n}",
            "url": f"http://127.0.0.1:{followed_port + n}",
            "events": endpoint,
            "models": ["followed"],
        }
        for n, endpoint in enumerate(sent.endpoints)
    ]
    return {
        "models": [
            {"name": "m", "tokenizer": "builtin:tiny-llama"},
            {"name": "followed", "tokenizer": "builtin:tiny-llama"},
        ],
        "block_size": 16,
        "index": {"max_entries": sent.blocks + 1},
        "instances": [
            *followed,
            {"name": "engine", "url": f"http://127.0.0.1:{engine_port}", "models": ["m"]},
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2_000_000)
    parser.add_argument("--router-cpu", type=int, default=None, help="the router alone on this CPU")
    parser.add_argument("--publishers-nice", type=int, default=0, help="the publishers' niceness (0-19)")
    parser.add_argument("--followed-down", action="store_true", help="the followed instances' HTTP closed")
    parser.add_argument(
        "--engine-first",
        action="store_true",
        help="the engine and the client first on their CPU (SCHED_FIFO)",
    )
    args = parser.parse_args()
    if args.router_cpu is not None:  # before the publishers start: they keep this process's CPUs
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {args.router_cpu})
    engine_port = free_port_block(1)
    engine_process = multiprocessing.get_context("spawn").Process(target=_serve_engine, args=(engine_port,))
    engine_process.start()
    engine = f"http://127.0.0.1:{engine_port}"
    followed_port = free_port_block(PUBLISHERS)
    spawned = [engine_process]
    if not args.followed_down:
        spawned.append(
            multiprocessing.get_context("spawn").Process(
                target=_serve_followed, args=(followed_port, PUBLISHERS)
            )
        )
        spawned[-1].start()
    with (
        publishing(args.blocks, 32, PUBLISHERS) as sent,
        tempfile.TemporaryDirectory(prefix="kvroute-burst-") as scratch,
    ):
        if args.engine_first:
            for thread in os.listdir(f"/proc/{engine_process.pid}/task"):
                run_first(int(thread))
        for pid in sent.pids:  # every thread: ZMQ's sending thread is not the process's first
            for thread in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(thread), args.publishers_nice)
        path = Path(scratch) / "router.yaml"
        path.write_text(yaml.safe_dump(router_config(sent, engine_port, followed_port)))
        port = free_port_block(1)
        serve = ["serve", "--config", str(path), "--port", str(port)]
        if args.router_cpu is None:
            router = start("router", serve, Path(scratch))
        else:
            pinned = ["taskset", "-c", str(args.router_cpu), sys.executable, "-m", "kvroute.cli", *serve]
            router = spawn("router", pinned, Path(scratch))
        url = f"http://127.0.0.1:{port}"
        try:
            while not http_ok(url + "/metrics"):
                time.sleep(0.1)
            wait_subscribed(sent, router)
            wait_answering(url)
            idle: list[tuple[float, float, float]] = []
            chats_for(url, engine, 3.0, idle, args.engine_first)
            during: list[tuple[float, float, float]] = []
            client = threading.Thread(target=chats_for, args=(url, engine, 5.0, during, args.engine_first))
            client.start()
            time.sleep(0.3)
            began = time.monotonic()
            for control in sent.controls:
                control.send("go")
            wait_held(url, sent.blocks, every_s=0.5)
            ended = time.monotonic()
            client.join()
        except urllib.error.HTTPError as error:
            print(f"the router answered {error.code} {error.read()!r}:\n{router.log_tail()}", file=sys.stderr)
            return 1
        finally:
            router.stop()
            for process in spawned:
                process.terminate()
                process.join(10)
    report("idle", idle)
    report(
        f"during the burst of {sent.blocks:,} blocks ({ended - began:.2f} s)",
        [pair for pair in during if began <= pair[0] <= ended],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
