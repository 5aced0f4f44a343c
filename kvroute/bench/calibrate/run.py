"""`kvroute bench calibrate`'s run: the engine measured, the profile fitted, checked and written."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from kvroute.bench.calibrate.check import check, check_trace
from kvroute.bench.calibrate.fit import Measured, fit
from kvroute.bench.calibrate.probes import Engine, ProbeFailed, decode_steps, prefill_times
from kvroute.processes import free_port_block
from kvroute.simulate.profile import Profile
from kvroute.stack.config import load_stack_config
from kvroute.stack.run import Stack, StackPlan

PREFILL_LENGTHS = (32, 512, 1024, 2048, 3072, 4000)
DECODE_BATCHES = (1, 4, 8)
DECODE_TOKENS = 256


def run_calibrate(args: argparse.Namespace) -> int:
    with ExitStack() as stack:
        url, model = args.url, args.model
        if url is None:
            url, model = stack.enter_context(_one_engine(Path(args.config)))
        try:
            profile = asyncio.run(_calibrate(url, model, args))
        except (ProbeFailed, aiohttp.ClientError) as exc:
            print(f"calibrate: {exc}", file=sys.stderr)
            return 1
    profile.write(Path(args.out))
    engine, checked = profile.engine, profile.check
    print(
        f"prefill {engine.prefill_tokens_per_s:,.0f} tokens/s, step {engine.decode_step_s * 1000:.2f} ms "
        f"+ {engine.decode_step_s_per_seq * 1000:.3f} ms a decoding request, frontend "
        f"{engine.frontend_s * 1000:.1f} ms + {engine.frontend_s_per_token * 1e6:.2f} us a prompt token, "
        f"{engine.kv_blocks} blocks of {engine.block_size}"
    )
    print(
        f"check ({checked['requests']} requests of {checked['trace']}): TTFT median error "
        f"{checked['ttft_median_error']:.0%} (p90 {checked['ttft_p90_error']:.0%}); TTFT p50 "
        f"{checked['engine_ttft_p50_s'] * 1000:.0f} ms on the engine, "
        f"{checked['simulated_ttft_p50_s'] * 1000:.0f} ms simulated; preemptions "
        f"{checked['engine_preemptions']} and {checked['simulated_preemptions']}"
    )
    print(f"profile: {args.out}")
    return 0


async def _calibrate(url: str, model: str, args: argparse.Namespace) -> Profile:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        engine = Engine(http, url, model)
        blocks, block_size = await engine.cache()
        cold, warm = await prefill_times(engine, PREFILL_LENGTHS, args.repeats)
        decode = await decode_steps(engine, DECODE_BATCHES, DECODE_TOKENS, args.repeats)
        limits = (args.max_num_seqs, args.max_batched_tokens)
        measured = Measured(cold, warm, decode, blocks, block_size, *limits)
        spec = fit(measured)
        checked = await check(engine, spec, check_trace())
    when = datetime.now(UTC).strftime("%Y-%m-%d")
    source = f"{url} ({model}), measured {when} by kvroute bench calibrate"
    return Profile(spec, source, asdict(measured), checked)


@contextmanager
def _one_engine(config_path: Path) -> Iterator[tuple[str, str]]:
    """One vLLM instance of the stack's configuration, without the pool or a router, on free ports: its URL
    and served model name."""
    config = load_stack_config(config_path)
    vllm = config.vllm.model_copy(update={"instances": 1})
    config = config.model_copy(update={"pool": None, "vllm": vllm})
    config = config.with_ports(free_port_block(config.port_count()))
    with tempfile.TemporaryDirectory(prefix="kvroute-calibrate-") as run_dir:
        running = Stack(StackPlan(config, Path(run_dir)), with_router=False)
        try:
            running.up()
            yield running.instances[0].url, config.model.served_name
        finally:
            running.stop()
