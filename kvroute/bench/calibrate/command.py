"""`kvroute bench calibrate`: measure one real vLLM instance (the real stack's, started here, or a running
one) and write the engine profile the simulator loads (`kvroute bench simulate --profile PATH`), with the
simulator's per-request TTFT error on a fixed trace against the same engine; with --pool, also against two
engines sharing the Mooncake pool."""

from __future__ import annotations

import argparse

from kvroute.extras import requires_extra

# vLLM 0.32's defaults for the API server on a CPU (vllm/engine/arg_utils.py), which the CPU stack keeps.
CPU_MAX_BATCHED_TOKENS = 2048
CPU_MAX_NUM_SEQS = 128


def add_calibrate_parser(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    calibrate = benches.add_parser("calibrate", help="fit the simulator's engine to a real vLLM instance")
    calibrate.add_argument("--url", help="a running vLLM instance; default: start one from --config")
    calibrate.add_argument("--model", default="tiny-llama", help="with --url: its served model name")
    calibrate.add_argument(
        "--config", default="configs/stack-cpu.yaml", help="the stack its engine comes from"
    )
    calibrate.add_argument("--max-batched-tokens", type=int, default=CPU_MAX_BATCHED_TOKENS)
    calibrate.add_argument("--max-num-seqs", type=int, default=CPU_MAX_NUM_SEQS)
    calibrate.add_argument("--repeats", type=int, default=5, help="probes of each prompt length and batch")
    calibrate.add_argument(
        "--pool",
        action="store_true",
        help="also check the simulator on two instances sharing the stack's Mooncake pool (started here), a "
        "session's turns alternating between them; written as the profile's check.pool",
    )
    calibrate.add_argument(
        "--profile", help="with --pool: check this profile's engine instead of fitting one on instance 0"
    )
    calibrate.add_argument("--out", default="bench-results/engine-profile.json")
    calibrate.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    with requires_extra("bench"):
        from kvroute.bench.calibrate.run import run_calibrate
    return run_calibrate(args)
