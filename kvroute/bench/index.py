"""``kvroute bench index``: the index and the routing decision, measured (a benchmark, not a test).

- ingest: BlockStored events of 32 blocks of 16 tokens, spread over 8 instances, applied as the subscriber
  does; blocks per second on one core, hashing included;
- memory: bytes the index holds per indexed block (its dicts and their key and value objects);
- lookup + score: index match plus a policy's scores over 8 instances for prompts of 1K, 10K and 100K tokens;
- the full routing decision (tokenize + hash + lookup + score + pick) for turn 30 of an agent session with
  ~80K tokens of history, cold and with the tokenization cache warm from turns 1-29;
- end to end (kvroute/bench/index_ingest.py): 8 publishers over ZMQ into the router's subscriber and index,
  at 32 and at 1 block a message, and the process's memory per block held; then the subscriber alone, into a
  sink that only counts blocks: the floor under the end-to-end figures;
- decisions over fleets of 8, 100 and 1,000 instances (kvroute/bench/index_decisions.py): an 80K-token
  turn's chain hashed, matched and chosen by the default policy;
- one index per host (kvroute/bench/index_workers.py): what the same blocks over ZMQ add to the memory of a
  lone `kvroute serve` and of a whole `kvroute serve --workers 4`, its index host included.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvroute.bench.index_decisions import measure_decisions
from kvroute.bench.index_ingest import measure_ingest_end_to_end
from kvroute.bench.index_parts import BLOCK_SIZE, durations, gpu_blocks
from kvroute.bench.index_workers import measure_router_memory, measure_serve_ingest
from router.apis.openai_body import ChatRequest
from router.dispatch.decide.decision import Decider, LocalTokenizer
from router.index.block_index import BlockIndex
from router.index.events import BlockHash, BlockStored
from router.metrics import RouterMetrics
from router.prompt import block_hashing
from router.upstreams.instances import Instance
from scorers.policy import Policy
from scorers.policy_config import PolicyConfig, ScorerSpec
from scorers.request import RoutingRequest

BLOCKS_PER_EVENT = 32
INSTANCES = 8
VOCAB = 150_000


@dataclass(frozen=True)
class BenchOptions:
    sizes: tuple[int, ...] = (1_000_000, 10_000_000)
    repeats: int = 200
    out: Path | None = None
    # end to end: blocks sent at 32 a message (each a memory figure too), and blocks sent one a message
    wire_blocks: tuple[int, ...] = (2_000_000, 10_000_000)
    wire_single_blocks: int = 200_000
    fleets: tuple[int, ...] = (8, 100, 1_000)
    # one index per host: blocks sent to a lone `kvroute serve` and to one with --workers host_workers (0: not
    # measured)
    host_blocks: int = 2_000_000
    host_workers: int = 4
    # a lone `kvroute serve`, measured from outside: blocks sent at 32 a message (16- and 32-token blocks),
    # and blocks sent one a message (0: not measured)
    serve_blocks: int = 2_000_000
    serve_single_blocks: int = 100_000
    serve_instances: int = 8  # the engines publishing to it (from 8 processes: a multiple of 8)


def _events(blocks: int, seed: int) -> Iterator[tuple[tuple[str, int], BlockStored]]:
    """Long chains per instance; token lists are reused, parents make every block distinct."""
    rng = random.Random(seed)
    pool = [[rng.randrange(VOCAB) for _ in range(BLOCK_SIZE * BLOCKS_PER_EVENT)] for _ in range(64)]
    parents: list[int | None] = [None] * INSTANCES
    next_hash = 1 << 62
    for number in range(blocks // BLOCKS_PER_EVENT):
        instance = number % INSTANCES
        hashes: list[BlockHash] = list(range(next_hash, next_hash + BLOCKS_PER_EVENT))
        next_hash += BLOCKS_PER_EVENT
        yield (
            (f"i{instance}", 0),
            gpu_blocks(hashes, pool[number % 64], parents[instance]),
        )
        parents[instance] = next_hash - 1


def measure_ingest(blocks: int) -> dict[str, float]:
    events = list(_events(blocks, seed=blocks))
    index = BlockIndex(BLOCK_SIZE, max_entries=blocks + 1)
    gc.collect()
    gc.disable()  # as in a long-running router, the collector is not what is measured
    slowest = 0.0  # the longest one event holds the event loop (a table moving to larger arrays at once did)
    try:
        started = time.perf_counter()
        for owner, event in events:
            before = time.perf_counter()
            index.apply(owner, (event,))
            slowest = max(slowest, time.perf_counter() - before)
        elapsed = time.perf_counter() - started
    finally:
        gc.enable()
    return {
        "blocks": index.entries,
        "blocks_per_s": blocks / elapsed,
        "bytes_per_block": index.footprint_bytes() / index.entries,
        "slowest_event_ms": slowest * 1e3,
    }


def _quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
    }


def _timed(action: Callable[[], object], repeats: int) -> dict[str, float]:
    return _quantiles(durations(action, repeats))


def _fleet_policy() -> tuple[list[Instance], Policy]:
    instances = [
        Instance(f"i{n}", f"http://127.0.0.1:{9000 + n}", frozenset({"m"})) for n in range(INSTANCES)
    ]
    policy = Policy(
        "precise",
        PolicyConfig(
            scorers=[
                ScorerSpec(type="precise-prefix", weight=2.0),
                ScorerSpec(type="inflight-load", weight=1.0),
            ]
        ),
    )
    return instances, policy


def measure_lookup(prompt_tokens: int, repeats: int) -> dict[str, float]:
    """Instance n holds the first (n+1)/8 of the prompt, so every lookup walks the whole chain."""
    rng = random.Random(prompt_tokens)
    tokens = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
    chain = block_hashing.chain(tokens, BLOCK_SIZE)
    index = BlockIndex(BLOCK_SIZE)
    for n in range(INSTANCES):
        held = len(chain) * (n + 1) // INSTANCES
        index.apply(
            (f"i{n}", 0),
            [gpu_blocks([(n << 48) + b for b in range(held)], tokens[: held * BLOCK_SIZE])],
        )
    instances, policy = _fleet_policy()

    def lookup_and_score() -> None:
        matches = index.match(chain)
        policy.choose(RoutingRequest("m", None, len(tokens), len(chain), BLOCK_SIZE, matches), instances)

    return {"blocks": len(chain), **_timed(lookup_and_score, repeats)}


def agent_conversation(turns: int = 30, target_tokens: int = 80_000) -> list[list[dict[str, str]]]:
    """The message lists of turns 1..turns of one session growing to about target_tokens."""
    rng = random.Random(30)
    words = "def return class import self assert error file value cache block token prefix route".split()
    tokens_per_word = 3.3  # measured with the tiny tokenizer on these words
    per_turn_words = int((target_tokens / tokens_per_word - 800) / turns) - 40
    messages = [
        {"role": "system", "content": "You are a coding agent. " + " ".join(rng.choices(words, k=800))}
    ]
    history = []
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"turn {turn}: " + " ".join(rng.choices(words, k=per_turn_words))}
        )
        history.append(list(messages))
        messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=40))})
    return history


def measure_decision(make_tokenizer: Callable[[], LocalTokenizer], repeats: int) -> dict[str, Any]:
    history = agent_conversation()
    instances, policy = _fleet_policy()
    metrics = RouterMetrics()

    # The engine holds turn 29's blocks, as its KV events would have told the index.
    previous = make_tokenizer().chat_ids(history[-2])
    held = len(previous) // BLOCK_SIZE * BLOCK_SIZE
    hashes: list[BlockHash] = list(range(1, held // BLOCK_SIZE + 1))
    stored = gpu_blocks(hashes, previous[:held])

    async def once(warm: bool) -> float:
        index = BlockIndex(BLOCK_SIZE)
        index.apply(("i3", 0), [stored])
        router = Decider(index, {"m": make_tokenizer()}, BLOCK_SIZE, metrics)
        if warm:
            for messages in history[:-1]:
                await router.prepare(ChatRequest(model="m", messages=messages), "s")
        body = ChatRequest(model="m", messages=history[-1])
        started = time.perf_counter()
        router.decide(await router.prepare(body, "s"), policy, instances)
        return time.perf_counter() - started

    results: dict[str, Any] = {}
    for label, warm in (("cold", False), ("cached", True)):
        results[label] = _quantiles([asyncio.run(once(warm)) for _ in range(max(3, repeats // 20))])
    results["prompt_tokens"] = len(make_tokenizer().chat_ids(history[-1]))
    return results


def run_bench(options: BenchOptions, make_tokenizer: Callable[[], LocalTokenizer]) -> dict[str, Any]:
    console = Console(width=None if Console().is_terminal else 120)
    report: dict[str, Any] = {
        "ingest": [],
        "lookup": {},
        "decision": {},
        "wire": [],
        "subscriber_alone": [],
        "fleets": {},
        "host_memory": [],
        "serve_ingest": [],
    }
    serve_runs = [(options.serve_blocks, 32, size) for size in (16, 32)] if options.serve_blocks else []
    serve_runs += [(options.serve_single_blocks, 1, 16)] if options.serve_single_blocks else []
    steps = len(options.sizes) + 3 + 1 + len(options.wire_blocks) + 1 + 2 + 1 + 2 + len(serve_runs)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("index benchmark", total=steps)
        for size in options.sizes:
            progress.update(task, description=f"ingest {size:,} blocks")
            report["ingest"].append(measure_ingest(size))
            progress.advance(task)
        for tokens in (1_000, 10_000, 100_000):
            progress.update(task, description=f"lookup+score {tokens:,}-token prompt")
            report["lookup"][str(tokens)] = measure_lookup(tokens, options.repeats)
            progress.advance(task)
        progress.update(task, description="routing decision, 80K-token agent turn")
        report["decision"] = measure_decision(make_tokenizer, options.repeats)
        progress.advance(task)
        for blocks, per_message in [*((b, 32) for b in options.wire_blocks), (options.wire_single_blocks, 1)]:
            progress.update(task, description=f"end to end, {blocks:,} blocks, {per_message} a message")
            report["wire"].append(measure_ingest_end_to_end(blocks, per_message).summary())
            progress.advance(task)
        # The subscriber alone, into a sink that counts: the first end-to-end run's blocks, and one a message.
        for blocks, per_message in ((options.wire_blocks[0], 32), (options.wire_single_blocks, 1)):
            progress.update(task, description=f"the subscriber alone, {per_message} a message")
            alone = measure_ingest_end_to_end(blocks, per_message, indexed=False).summary()
            report["subscriber_alone"].append(alone)
            progress.advance(task)
        progress.update(task, description="decisions over fleets of " + ", ".join(map(str, options.fleets)))
        report["fleets"] = measure_decisions(options.fleets)
        progress.advance(task)
        for workers in (1, options.host_workers) if options.host_blocks else ():
            progress.update(task, description=f"memory of kvroute serve, {workers} worker(s)")
            report["host_memory"].append(measure_router_memory(options.host_blocks, workers).summary())
            progress.advance(task)
        for blocks, per_message, block_size in serve_runs:
            progress.update(
                task, description=f"kvroute serve ingest, {per_message} a message of {block_size}"
            )
            run = measure_serve_ingest(blocks, per_message, block_size, instances=options.serve_instances)
            report["serve_ingest"].append({**run.summary(), "instances": options.serve_instances})
            progress.advance(task)
    console.print(_table(report))
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {options.out}")
    return report


def _table(report: dict[str, Any]) -> Table:
    table = Table(title="kvroute index benchmark (one core; 8 instances, 16-token blocks)")
    for column in ("measure", "result", "target"):
        table.add_column(column)
    for ingest in report["ingest"]:
        size = f"{ingest['blocks']:,} blocks"
        table.add_row(f"ingest, {size}", f"{ingest['blocks_per_s'] / 1e6:.2f} M blocks/s", ">= 1 M/s")
        table.add_row(f"slowest event of 32 blocks, {size}", f"{ingest['slowest_event_ms']:.1f} ms", "")
        table.add_row(f"memory, {size}", f"{ingest['bytes_per_block']:.0f} bytes/block", "<= 200")
    for tokens, lookup in report["lookup"].items():
        table.add_row(
            f"lookup+score, {int(tokens):,}-token prompt ({lookup['blocks']} blocks)",
            f"p50 {lookup['p50_ms']:.3f} ms, p99 {lookup['p99_ms']:.3f} ms",
            "p50 <= 1 ms at 10K" if tokens == "10000" else "",
        )
    for wire in report["wire"]:
        per_message = int(wire["blocks_per_message"])
        table.add_row(
            f"end to end, {int(wire['blocks']):,} blocks, {per_message} a message, 8 publishers",
            f"{wire['blocks_per_cpu_s'] / 1e6:.3f} M blocks/CPU-s, {wire['messages_per_cpu_s'] / 1e3:.1f}K "
            f"msg/CPU-s; {wire['rss_bytes_per_block']:.0f} B RSS/block",
            ">= 1 M blocks/s; <= 64 B" if per_message > 1 else ">= 100K msg/s",
        )
    for alone in report["subscriber_alone"]:
        per_message = int(alone["blocks_per_message"])
        table.add_row(
            f"the subscriber alone (receive, decode, bookkeeping), {per_message} a message",
            f"{alone['blocks_per_cpu_s'] / 1e6:.3f} M blocks/CPU-s, {alone['messages_per_cpu_s'] / 1e3:.1f}K "
            "msg/CPU-s",
            "the floor under end to end",
        )
    for size, fleet in report["fleets"].items():
        table.add_row(
            f"80K-token decision over {int(size):,} instances",
            f"{fleet['decision_ms']:.2f} ms (hash {fleet['hash_ms']:.2f}, match {fleet['match_ms']:.2f}, "
            f"choose {fleet['choose_ms']:.2f}; match from cold caches {fleet['cold_match_ms']:.2f}; "
            f"nearly full, choose {fleet['full_choose_ms']:.2f})",
            "<= 1 ms" if size == "1000" else "",
        )
    for host in report["host_memory"]:
        workers = int(host["workers"])
        router = "kvroute serve" if workers <= 1 else f"kvroute serve --workers {workers}"
        table.add_row(
            f"{router} ({int(host['processes'])} processes in all): RSS growth, {int(host['blocks']):,} "
            "blocks over ZMQ",
            f"{host['rss_growth_bytes'] / 2**20:,.0f} MiB, {host['rss_bytes_per_block']:.0f} B/block "
            f"({host['burst_rss_bytes_per_block']:.0f} at the burst's end)",
            "one copy: as kvroute serve's" if workers > 1 else "",
        )
    for serve in report["serve_ingest"]:
        per_message, block_size = int(serve["blocks_per_message"]), int(serve["block_size"])
        target = f">= {1 if block_size <= 16 else 0.6} M blocks; <= 96 B at the end, <= 64 B"
        table.add_row(
            f"kvroute serve from outside, {int(serve['blocks']):,} blocks of {block_size} tokens, "
            f"{per_message} a message, {int(serve['instances']):,} instances publishing",
            f"{serve['blocks_per_cpu_s'] / 1e6:.3f} M blocks/CPU-s, {serve['messages_per_cpu_s'] / 1e3:.1f}K "
            f"msg/CPU-s; {serve['burst_rss_bytes_per_block']:.0f} B RSS/block at the burst's end, "
            f"{serve['rss_bytes_per_block']:.0f} B settled",
            target if per_message > 1 else ">= 100K msg/CPU-s",
        )
    decision = report["decision"]
    for label in ("cold", "cached"):
        table.add_row(
            f"full decision, turn 30 ({decision['prompt_tokens']:,} tokens), {label}",
            f"p50 {decision[label]['p50_ms']:.2f} ms, p99 {decision[label]['p99_ms']:.2f} ms",
            "p50 <= 5 ms" if label == "cached" else "",
        )
    return table
