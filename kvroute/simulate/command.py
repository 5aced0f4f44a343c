"""`kvroute bench simulate`: its arguments and entry point."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from fleet.request_queue import SCHEDULING_POLICIES
from kvroute.arguments import non_negative_int, parse_pd, positive_float, positive_int
from kvroute.extras import requires_extra
from kvroute.simulate.hardware import (
    ATTENTION_S_PER_PAIR,
    DECODE_S_PER_CONTEXT_TOKEN,
    LINK_PRESETS,
    POOL_PRESETS,
    EngineSpec,
    FleetSpec,
    PDSpec,
    PoolSpec,
)
from kvroute.simulate.profile import load_profile
from kvroute.traces import Trace, agentic_trace, load_trace, mooncake_trace

SWEEP_LOADS = (0.3, 0.45, 0.6, 0.75, 0.9)
SWEEP_INSTANCES = (4, 8, 16, 32)
SUITE_REQUESTS = 500
SUITE_WORKERS = 1


def add_simulate_parser(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    simulate = benches.add_parser("simulate", help="the fleet at scale, in simulated time")
    simulate.add_argument(
        "--trace",
        default=None,
        help="a JSONL trace (plain or .xz), `mooncake`, `agentic`, `programs` (the agentic sessions, "
        "each next turn no sooner than its tool call after the answer) or `images` (the agentic sessions, "
        "every fourth turn ending with a screenshot); default: the Mooncake conversation trace",
    )
    simulate.add_argument("--instances", type=positive_int, default=None, help="default: 8, or --pd's")
    simulate.add_argument(
        "--pd",
        type=parse_pd,
        default=None,
        metavar="P:D",
        help="a disaggregated fleet: P prefill and D decode instances (the hardware of "
        "P + D aggregated ones), routed by each router's P/D algorithm",
    )
    simulate.add_argument(
        "--pd-link",
        choices=sorted(LINK_PRESETS),
        default="rdma",
        help="with --pd: the link decode instances fetch the prompt's KV over",
    )
    simulate.add_argument(
        "--rate", type=positive_float, default=None, help="arrival rate multiplier (x2: twice as fast)"
    )
    simulate.add_argument(
        "--load",
        type=positive_float,
        default=0.7,
        help="without --rate: the offered load, prefill the ideal cache leaves / fleet prefill capacity",
    )
    simulate.add_argument("--policies", default=None, help="comma-separated; default: all")
    simulate.add_argument("--pool", choices=["on", "off"], default="on")
    simulate.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=None,
        help="the engines' (vLLM's --scheduling-policy; default: the profile's, else fcfs): priority orders "
        "their queues by the priority the routers that send one (kvroute, Dynamo) give each request",
    )
    simulate.add_argument("--pool-link", choices=sorted(POOL_PRESETS), default="rdma")
    simulate.add_argument(
        "--event-delay", type=float, default=0.05, help="seconds until KV events reach the index"
    )
    simulate.add_argument(
        "--attention-cost",
        choices=["on", "off"],
        default="off",
        help="on: a prompt token's prefill and a decode step also cost what reading their context does "
        "(an 8B model on an H100); off: flat per-token and per-step costs, the reference setup",
    )
    # The whole Mooncake trace (12,031 requests) x 8 policies takes ~30 min on 2 cores: the default keeps
    # a run within 15 minutes; 0 replays everything.
    simulate.add_argument(
        "--requests",
        type=non_negative_int,
        default=3000,
        help="only the first N requests of the trace (0: all)",
    )
    simulate.add_argument(
        "--skip",
        type=int,
        default=0,
        help="start after the trace's first N requests (another window of it; caches start empty)",
    )
    simulate.add_argument(
        "--sessions", type=positive_int, default=40, help="sessions of the agentic and programs traces"
    )
    simulate.add_argument(
        "--profile",
        help="an engine profile (JSON, `kvroute bench calibrate`'s): the engines' timing and memory instead "
        "of the reference H100 setup",
    )
    simulate.add_argument("--seed", type=int, default=0, help="seed of the agentic trace")
    simulate.add_argument(
        "--tie-seed",
        type=int,
        default=0,
        help="seed of the routers' random choice between equal scores (runs with one seed repeat exactly)",
    )
    simulate.add_argument(
        "--suite",
        action="store_true",
        help="every policy on a grid of workloads, fleets, loads and pool settings, "
        "kvroute against the best peer (docs/bench-simulate.md)",
    )
    simulate.add_argument(
        "--suite-cells",
        default=None,
        metavar="SPEC",
        help="implies --suite: AXIS=V1,V2 terms (workload, instances, load, pool) "
        "replacing the base grid's (every workload, 16, 0.7, on); AXIS=all, or `all`: "
        "the full grid",
    )
    simulate.add_argument(
        "--suite-requests",
        type=positive_int,
        default=SUITE_REQUESTS,
        help="the first N requests of each cell's workload",
    )
    simulate.add_argument(
        "--suite-workers",
        type=positive_int,
        default=SUITE_WORKERS,
        help="processes running the suite's simulations",
    )
    simulate.add_argument("--sweep", choices=["rate", "instances"], default=None)
    simulate.add_argument(
        "--sweep-requests", type=positive_int, default=3000, help="requests per sweep point"
    )
    simulate.add_argument(
        "--slo", type=positive_float, default=10.0, help="TTFT p99 SLO (s) for the sustainable rate"
    )
    simulate.add_argument(
        "--out", default="bench-results/simulate", help="directory for results.json and plots"
    )
    simulate.set_defaults(run=_run)


def _trace(args: argparse.Namespace) -> Trace:
    if args.trace == "agentic":
        return agentic_trace(seed=args.seed, sessions=args.sessions)
    if args.trace == "programs":  # the agentic sessions, each next turn after its tool call
        return agentic_trace(seed=args.seed, sessions=args.sessions, tool_calls=True, name="programs")
    if args.trace == "images":  # the agentic sessions, every fourth turn ending with a screenshot
        return agentic_trace(seed=args.seed, sessions=args.sessions, images_every=4, name="images")
    if args.trace in (None, "mooncake"):
        return mooncake_trace()
    return load_trace(Path(args.trace))


def _fleet(args: argparse.Namespace) -> FleetSpec | str:
    """The fleet the arguments describe, or what is wrong with them."""
    pd = None
    instances = args.instances or 8
    if args.pd is not None:
        prefill, decode = args.pd
        if args.instances not in (None, prefill + decode):
            return f"--pd {prefill}:{decode} is {prefill + decode} instances, not {args.instances}"
        if args.sweep == "instances":
            return "--sweep instances varies an aggregated fleet: not with --pd"
        pd, instances = PDSpec(prefill, decode, LINK_PRESETS[args.pd_link]), prefill + decode
    pool = PoolSpec(load_s_per_token=POOL_PRESETS[args.pool_link]) if args.pool == "on" else None
    engine = EngineSpec()
    if args.profile is not None:
        try:
            engine = load_profile(Path(args.profile)).engine
        except ValueError as exc:
            return str(exc)
    if args.attention_cost == "on":
        engine = replace(
            engine,
            attention_s_per_pair=ATTENTION_S_PER_PAIR,
            decode_s_per_context_token=DECODE_S_PER_CONTEXT_TOKEN,
        )
    if args.scheduling_policy is not None:
        engine = replace(engine, scheduling_policy=args.scheduling_policy)
    return FleetSpec(instances=instances, engine=engine, pool=pool, event_delay_s=args.event_delay, pd=pd)


def _run(args: argparse.Namespace) -> int:
    with requires_extra("bench"):
        from kvroute.simulate.registry import POLICIES, policies_for

    fleet = _fleet(args)
    if isinstance(fleet, str):
        print(fleet, file=sys.stderr)
        return 2
    known = policies_for(fleet)
    names = args.policies.split(",") if args.policies else list(POLICIES if fleet.pd is None else known)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(
            f"unknown policies: {', '.join(unknown)}; known{' with --pd' if fleet.pd else ''}: "
            f"{', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    if args.suite or args.suite_cells is not None:
        return _suite(args, fleet, names)
    try:
        trace = _trace(args).skip(args.skip)
    except (OSError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.requests:
        trace = trace.head(args.requests)
    if len(trace.requests) < 2:
        print("the trace needs at least two requests (after --skip)", file=sys.stderr)
        return 2
    with requires_extra("bench"):
        from kvroute.simulate.bench import Bench

    bench = Bench(fleet, names, Path(args.out), args.tie_seed)
    if args.sweep == "rate":
        bench.sweep_rate(trace.head(args.sweep_requests), SWEEP_LOADS, args.slo)
    elif args.sweep == "instances":
        bench.sweep_instances(trace.head(args.sweep_requests), SWEEP_INSTANCES, args.load, args.slo)
    else:
        bench.compare(trace, args.rate, args.load)
    return 0


def _suite(args: argparse.Namespace, fleet: FleetSpec, names: list[str]) -> int:
    with requires_extra("bench"):
        from kvroute.simulate.suite import parse_cells
        from kvroute.simulate.suite_bench import run_suite

    if fleet.pd is not None or args.sweep is not None:
        print("--suite compares policies on aggregated fleets: not with --pd or --sweep", file=sys.stderr)
        return 2
    try:
        cells = parse_cells(args.suite_cells)
    except ValueError as exc:
        print(f"--suite-cells: {exc}", file=sys.stderr)
        return 2
    pool = PoolSpec(load_s_per_token=POOL_PRESETS[args.pool_link])
    run_suite(
        cells,
        names,
        replace(fleet, pool=pool),
        args.suite_requests,
        args.suite_workers,
        Path(args.out),
        args.tie_seed,
    )
    return 0
