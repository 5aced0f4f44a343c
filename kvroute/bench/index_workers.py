"""Whole `kvroute serve` processes, measured from outside for ``kvroute bench index``.

- One index per host: the resident memory that blocks arriving over ZMQ add to a whole `kvroute serve
  --workers N` (the pool, its workers and its index host), beside a lone `kvroute serve` fed the same blocks
  in the same run. One copy of the index: the two grow alike; a copy per worker would make the first N times
  the second.
- Ingest: a lone `kvroute serve` fed a burst from 8 publisher processes, its CPU time (utime + stime from
  /proc) from the first message sent to the last block held (read once it went quiet, before the scrape
  that finds the blocks held: the harness's scrapes are not ingest), and its memory a block at that moment
  and a trim interval later: the figures of the in-process ingest rows, for the process a user runs.

The routers are real `kvroute serve` processes on 127.0.0.1, their instances the bench's publishers (their
HTTP URLs answer nothing: no request is routed). Memory is read from /proc for every process of the router's
process group, before the publishers start, once the router's /metrics reports every block held (the burst's
end), and again a trim interval later (router/allocator.py): what the router keeps while it holds them.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvroute.bench.index_ingest import SUBSCRIBED_WITHIN_S, Publishers, publishing
from kvroute.bench.index_parts import BLOCK_SIZE
from kvroute.bench.overhead.targets import cpu_seconds, group_pids, resident_bytes
from kvroute.processes import Child, free_port_block, http_ok, start
from router.allocator import TRIM_INTERVAL_S

SERVING_WITHIN_S = 120.0
HELD_WITHIN_S = 600.0
SETTLE_S = TRIM_INTERVAL_S + 1.0
QUIET_WITHIN_S, QUIET_WINDOW_S = 60.0, 0.5
HELD_QUIET_S = 0.25  # no more than a clock tick of CPU in it: the burst is over
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class RouterMemory:
    workers: int  # 0: a lone `kvroute serve`
    processes: int
    blocks: int
    rss_growth_bytes: int  # settle_s after the burst's end
    burst_rss_growth_bytes: int  # at the burst's end

    def summary(self) -> dict[str, float]:
        return {
            "workers": self.workers,
            "processes": self.processes,
            "blocks": self.blocks,
            "rss_growth_bytes": self.rss_growth_bytes,
            "rss_bytes_per_block": self.rss_growth_bytes / max(1, self.blocks),
            "burst_rss_bytes_per_block": self.burst_rss_growth_bytes / max(1, self.blocks),
        }


def measure_router_memory(
    blocks: int, workers: int, blocks_per_message: int = 32, settle_s: float = SETTLE_S
) -> RouterMemory:
    """blocks sent to a `kvroute serve` (with --workers, when more than 1), 8 publishers of
    blocks_per_message a message: what its processes grow by once it holds them all, and settle_s later."""
    with publishing(blocks, blocks_per_message) as sent, tempfile.TemporaryDirectory() as scratch:
        router, url = _serve(sent, Path(scratch), workers)
        try:
            wait_subscribed(sent, router)
            before = _group_rss(router.process.pid)
            for control in sent.controls:
                control.send("go")
            wait_held(url, sent.blocks)
            at_end = _group_rss(router.process.pid)
            time.sleep(settle_s)
            after = _group_rss(router.process.pid)
            growth, at_end_growth = (sum(rss.values()) - sum(before.values()) for rss in (after, at_end))
            return RouterMemory(workers, len(after), sent.blocks, growth, at_end_growth)
        finally:
            router.stop()


@dataclass(frozen=True)
class ServeIngest:
    blocks: int
    blocks_per_message: int
    block_size: int
    cpu_s: float  # the router's, from the burst's first message to its last block held
    wall_s: float
    burst_rss_growth_bytes: int  # at the last block held
    rss_growth_bytes: int  # settle_s later

    def summary(self) -> dict[str, float]:
        cpu_s = max(self.cpu_s, _TICK_S)  # /proc counts in clock ticks: a tiny burst may take none
        return {
            "blocks": self.blocks,
            "blocks_per_message": self.blocks_per_message,
            "block_size": self.block_size,
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "blocks_per_cpu_s": self.blocks / cpu_s,
            "messages_per_cpu_s": self.blocks / self.blocks_per_message / cpu_s,
            "burst_rss_bytes_per_block": self.burst_rss_growth_bytes / max(1, self.blocks),
            "rss_bytes_per_block": self.rss_growth_bytes / max(1, self.blocks),
        }


def measure_serve_ingest(
    blocks: int,
    blocks_per_message: int,
    block_size: int = BLOCK_SIZE,
    settle_s: float = SETTLE_S,
    instances: int = 8,
) -> ServeIngest:
    """blocks of block_size tokens sent to a lone `kvroute serve` by instances engines (from 8 publisher
    processes: a multiple of 8), blocks_per_message a message, as fast as ZMQ takes them: the router's CPU and
    memory, read from /proc."""
    if instances % 8:
        raise ValueError(f"{instances} instances: 8 publisher processes send them, a multiple of 8")
    with (
        publishing(blocks, blocks_per_message, block_size=block_size, engines_each=instances // 8) as sent,
        tempfile.TemporaryDirectory() as scratch,
    ):
        router, url = _serve(sent, Path(scratch), 1, block_size)
        try:
            wait_subscribed(sent, router)
            pid = router.process.pid
            wait_quiet(pid)
            rss_before, cpu_before, started = resident_bytes(pid), cpu_seconds(pid), time.monotonic()
            for control in sent.controls:
                control.send("go")
            cpu_at_end, ended = held_when_quiet(url, sent.blocks, pid)
            cpu_s, wall_s = cpu_at_end - cpu_before, ended - started
            at_end = resident_bytes(pid) - rss_before
            time.sleep(settle_s)
            settled = resident_bytes(pid) - rss_before
            return ServeIngest(sent.blocks, blocks_per_message, block_size, cpu_s, wall_s, at_end, settled)
        finally:
            router.stop()


def wait_subscribed(sent: Publishers, router: Child) -> None:
    for control in sent.controls:  # the router (its index host) subscribed to each
        if not control.poll(SUBSCRIBED_WITHIN_S) or control.recv() != "subscribed":
            raise RuntimeError(f"the router did not subscribe:\n{router.log_tail()}")


def wait_quiet(pid: int, within_s: float = QUIET_WITHIN_S) -> None:
    """Until the router's start-up work is done (its checks of each instance's tokenizer, the first
    health checks: with 2,000 instances a second or more of CPU), which is no part of what is measured: until
    it uses under a tenth of a CPU over QUIET_WINDOW_S."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(QUIET_WINDOW_S)
        if cpu_seconds(pid) - before < 0.1 * QUIET_WINDOW_S:
            return
    raise RuntimeError(f"the router was still busy {within_s:.0f} s after it subscribed")


def held_when_quiet(url: str, blocks: int, pid: int) -> tuple[float, float]:
    """The router's CPU seconds and the time when it held blocks: read when it went quiet, before the scrape
    that found them held. Only a quiet router is scraped, and what a scrape that finds too few costs is taken
    off, so no scrape counts as ingest (the whole exposition of a fleet of 2,000 costs the router 0.2
    CPU-seconds, its kvroute_index_blocks alone 0.04)."""
    deadline, scraped = time.monotonic() + HELD_WITHIN_S, 0.0
    while time.monotonic() < deadline:
        cpu, now = cpu_seconds(pid), time.monotonic()
        time.sleep(HELD_QUIET_S)
        if cpu_seconds(pid) - cpu > _TICK_S:
            continue
        if _blocks_held(url) >= blocks:
            return cpu - scraped, now
        scraped += cpu_seconds(pid) - cpu  # a pause in the burst: the scrape, and the quiet window's tick
    raise RuntimeError(f"the router held fewer than {blocks} blocks in {HELD_WITHIN_S} s")


def wait_held(url: str, blocks: int, every_s: float = 0.05) -> None:
    """Until the router's /metrics reports blocks held, read every every_s (a scrape of a large fleet's
    series costs the router tens of milliseconds: counted in its CPU time, so not read too often)."""
    deadline = time.monotonic() + HELD_WITHIN_S
    while _blocks_held(url) < blocks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router held fewer than {blocks} blocks in {HELD_WITHIN_S} s")
        time.sleep(every_s)


def _serve(sent: Publishers, scratch: Path, workers: int, block_size: int = BLOCK_SIZE) -> tuple[Child, str]:
    dead = free_port_block(len(sent.endpoints))  # the instances' HTTP: nothing listens, nothing is routed
    config = {
        "models": [{"name": "m", "tokenizer": "builtin:tiny-llama"}],
        "block_size": block_size,
        "index": {"max_entries": sent.blocks + 1},
        # Nothing answers there: probing it, or reading its load, is no part of ingest
        "health": {"interval_s": 60},
        "load": {"scrape_interval_s": 60},
        "instances": [
            {"name": f"p{i}", "url": f"http://127.0.0.1:{dead + i}", "events": endpoint}
            for i, endpoint in enumerate(sent.endpoints)
        ],
    }
    path = scratch / "router.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port_block(1)
    args = ["serve", "--config", str(path), "--port", str(port)]
    router = start("router", [*args, "--workers", str(workers)] if workers > 1 else args, scratch)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVING_WITHIN_S
    while not http_ok(url + "/metrics"):
        if router.process.poll() is not None or time.monotonic() > deadline:
            router.stop()
            raise RuntimeError(f"the router did not serve:\n{router.log_tail()}")
        time.sleep(0.1)
    return router, url


def _blocks_held(url: str) -> float:
    # Only the family read: the whole exposition of a fleet of 2,000 costs the router about 0.2 CPU-seconds
    with urllib.request.urlopen(url + "/metrics?name[]=kvroute_index_blocks", timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvroute_index_blocks"
        for sample in family.samples
    )


def _group_rss(group: int) -> dict[int, int]:
    """Resident bytes of each process in the process group."""
    found: dict[int, int] = {}
    for pid in group_pids(group):
        with contextlib.suppress(OSError):  # gone meanwhile
            found[pid] = resident_bytes(pid)
    return found


if __name__ == "__main__":  # a quick look: python -m kvroute.bench.index_workers
    for count in (1, 4):
        print(json.dumps(measure_router_memory(2_000_000, count).summary()))
