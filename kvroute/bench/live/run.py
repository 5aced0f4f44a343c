"""``kvroute bench live``: the same workload through several routers in front of one fleet.

The workload is generated agent sessions or a request trace replayed open loop
(kvroute/bench/live/workloads.py). Targets run one after another against the same instances, each with content
of its own seed (its own system prompt too), so none is served from a cache another warmed; prefix caches are
also reset between targets where the instances allow it. Hit rates come from the engines' own counters
(``vllm:prefix_cache_*``), summed over instances, before and after each target. The benchmark starts every
router it measures on 127.0.0.1, in its own process group, and stops exactly those: kvroute, the real
vllm-router binary, SGLang's model gateway (kvroute/bench/live/smg.py). On a prefill/decode disaggregated
fleet (kvroute/bench/live/pd.py) vllm-router runs in its P/D mode, and each target's prompt tokens are told
apart by where they were computed. A trace of several flows (tenants) is also reported per
flow, and kvroute's routers get the objectives the simulator configures, so a flow's priority means the same
live as simulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import json
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table

from kvroute.agent_apis import Api
from kvroute.agent_sessions import SessionRun, TurnOutcome
from kvroute.bench.live.pd import (
    PD_TARGETS,
    Connector,
    NoPDMode,
    PDShape,
    is_disaggregated,
    pd_fleet_args,
    pd_paths,
    pd_router_config,
    render_pd_table,
    tokens_by_role,
    tokens_by_source,
    vllm_router_pd_args,
)
from kvroute.bench.live.plots import write_plots
from kvroute.bench.live.replicas import parse_replicas, running_replicas
from kvroute.bench.live.smg import find_smg, running_smg
from kvroute.bench.live.view import bench_view
from kvroute.bench.live.workloads import LiveWorkload, SessionWorkload, TraceWorkload
from kvroute.processes import (
    FleetPorts,
    StartupError,
    find_executable,
    free_port_block,
    running_fleet,
    running_peer_router,
    running_router,
)
from kvroute.simulate.policies import SIM_OBJECTIVES
from kvroute.trace_replay import ReplayPlan, ReplayRun, resolve_trace
from kvroute.traces import Trace
from kvroute.workload import AgentWorkload
from router.config import RouterConfig, load_config, parse_config
from tinymodel.vision import VISION_MODEL_NAME, ensure_files

DEFAULT_TARGETS = (
    "kvroute:round-robin",
    "kvroute",
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
    "vllm-router:kv_aware",
    "smg:cache_aware",
)
ROUND_ROBIN = {"scorers": [{"type": "round-robin"}]}
# A GPU's prefill rate on the trace's own token counts. Replayed with fewer tokens per hash id, the simulated
# fleet prefills that much slower, so a request costs the time it would at the trace's scale.
TRACE_PREFILL_TOKENS_PER_S = 32_000

_QUERIES = "vllm:prefix_cache_queries_total"
_HITS = "vllm:prefix_cache_hits_total"
_EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
_FINISHED = "vllm:request_success_total"
_ROUTER_METRICS = (
    "vllm_router_kv_placement_lookups_total",
    "vllm_router_kv_routing_inputs_total",
    "vllm_router_prefix_routing_decisions_total",
    "vllm_router_pd_prefill_requests_total",
    "kvroute_pd_requests_total",
    "smg_cache_aware_policy_branch_total",
    "vllm_router_agent_aware_transitions_total",
)
# vllm-router:kv_aware+VARIANT: kv_aware with one of vllm-router's agent options on. Both key on a request's
# session, which the sessions (and a trace with sessions) send in x-session-id, a header vllm-router reads.
VLLM_ROUTER_VARIANTS: dict[str, tuple[str, ...]] = {
    "affinity": ("--kv-aware-session-affinity-ttl-secs", "300"),
    # "auto": a session header makes a request part of a program, not only vllm_xargs.agentic_context
    "programs": (
        "--enable-program-scheduling",
        "--program-scheduling-config-json",
        json.dumps({"program_scheduling_enable_key": "auto"}),
    ),
}


class SkipTarget(Exception):
    """A target that cannot run here; the message says why."""


@dataclass(frozen=True)
class Target:
    label: str
    kind: str  # kvroute, vllm-router, smg or url
    policy: str = ""
    url: str = ""


def parse_targets(specs: Sequence[str], default_policy: str) -> list[Target]:
    """``kvroute``, ``kvroute:POLICY``, ``kvroute-replicas:N[+shared]``, ``vllm-router:POLICY``
    (``vllm-router:kv_aware+VARIANT``, a VLLM_ROUTER_VARIANTS key), ``smg:POLICY`` or ``NAME=URL`` (a router
    already running)."""
    targets = []
    for spec in (s.strip() for s in specs):
        if not spec:
            continue
        if "=" in spec:
            name, url = spec.split("=", 1)
            targets.append(Target(name, "url", url=url.rstrip("/")))
            continue
        kind, _, policy = spec.partition(":")
        if kind == "kvroute":
            policy = policy or default_policy
        elif kind == "kvroute-replicas":
            parse_replicas(policy)
        elif kind not in ("vllm-router", "smg") or not policy:
            raise ValueError(
                f"target {spec!r}: use kvroute[:POLICY], vllm-router:POLICY (e.g. round_robin), smg:POLICY "
                "(e.g. cache_aware) or NAME=URL"
            )
        if kind == "vllm-router" and "+" in policy:
            base, _, variant = policy.partition("+")
            if base != "kv_aware" or variant not in VLLM_ROUTER_VARIANTS:
                variants = ", ".join(f"kv_aware+{name}" for name in VLLM_ROUTER_VARIANTS)
                raise ValueError(f"target {spec!r}: vllm-router's variants are {variants}")
        targets.append(Target(f"{kind}:{policy}", kind, policy))
    return targets


@dataclass(frozen=True)
class LiveOptions:
    config: Path | None = None  # the fleet, as a router configuration; None: start a simulated fleet
    fleet_instances: int = 3
    fleet_args: tuple[str, ...] | None = None  # kvroute fleet options; None: scaled timings for a trace
    pd: tuple[int, int] | None = None  # a disaggregated simulated fleet: (prefill, decode) instances
    kv_connector: Connector = "nixl"  # the connector its instances speak
    targets: tuple[str, ...] | None = None  # None: DEFAULT_TARGETS, or PD_TARGETS on a disaggregated fleet
    sessions: int = 8
    turns: int = 8
    concurrency: int = 8
    time_limit_s: float = 300.0
    request_timeout_s: float = 120.0
    max_tokens: int = 16
    system_prompt_words: int = 400
    api: Api = "chat"  # the sessions' API: chat completions, OpenAI Responses or Anthropic Messages
    responses_chain: bool = False  # responses: each turn after the last by previous_response_id (stored)
    trace: str | None = None  # agentic, programs, mooncake, tenants, flows or a JSONL path: replayed
    rate: float = 5.0  # multiplies the trace's arrival rate
    requests: int | None = 400  # the trace's first N requests (None: all)
    block_tokens: int = 32  # real tokens per trace hash id
    max_prompt_tokens: int | None = None  # trace prompts longer than this are not sent
    seed: int = 1
    vllm_router: str | None = None  # the binary; default: found next to this Python or on PATH
    smg: str | None = None  # SGLang's model gateway, found the same way
    reset_caches: bool = True
    images_every: int = 0  # sessions: every this many turns a screenshot; the fleet serves the tiny Idefics3
    out: Path | None = None
    log_dir: Path | None = None


@dataclass(frozen=True)
class Fleet:
    config: RouterConfig
    raw: dict[str, Any]  # the YAML as written; the kvroute routers started get it with only the policy set
    args: tuple[str, ...] = ()  # the kvroute fleet options of a simulated fleet

    @property
    def model(self) -> str:
        return self.config.models[0].name


@dataclass(frozen=True)
class EngineCounters:
    """vLLM's cumulative token counters summed over instances, and finished requests per instance."""

    queries: float = 0.0
    hits: float = 0.0
    external_queries: float | None = None  # None: the engines have no KV connector (no pool)
    external_hits: float | None = None
    finished: dict[str, float] = field(default_factory=dict)
    by_source: dict[str, dict[str, float]] = field(default_factory=dict)  # instance -> tokens by source


@dataclass
class FlowResult:
    """One flow's requests through a target."""

    requests: int = 0
    ok: int = 0
    failed: int = 0
    rejected: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None


def flow_results(outcomes: Iterable[TurnOutcome]) -> dict[str, FlowResult]:
    """Outcomes by the flow they came from, in name order; empty when none has a flow."""
    by_flow: dict[str, list[TurnOutcome]] = {}
    for outcome in outcomes:
        if outcome.flow is not None:
            by_flow.setdefault(outcome.flow, []).append(outcome)
    results = {}
    for flow, flow_outcomes in sorted(by_flow.items()):
        ttfts = sorted(o.ttft_s for o in flow_outcomes if o.status == "ok")
        results[flow] = FlowResult(
            requests=len(flow_outcomes),
            ok=len(ttfts),
            failed=sum(o.status == "failed" for o in flow_outcomes),
            rejected=sum(o.status == "rejected" for o in flow_outcomes),
            ttft_p50_ms=_quantile(ttfts, 0.5) * 1000 if ttfts else None,
            ttft_p99_ms=_quantile(ttfts, 0.99) * 1000 if ttfts else None,
        )
    return results


@dataclass
class TargetResult:
    target: str
    kind: str
    policy: str
    seed: int
    skipped: str = ""
    caches_reset: bool = False
    sent: int = 0
    ok: int = 0
    failed: int = 0
    rejected: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    not_sent: int = 0  # trace prompts over max_prompt_tokens
    past_limit: int = 0  # trace turns whose tool call ended past the time limit, not sent
    late_s: float = 0.0  # how far the client fell behind the trace's schedule
    duration_s: float = 0.0
    requests_per_s: float = 0.0
    prompt_tokens: int = 0
    prompt_tokens_per_s: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    local_hit_rate: float | None = None
    pool_hit_rate: float | None = None
    requests_per_instance: dict[str, int] = field(default_factory=dict)
    # role -> prompt tokens its instances computed (local_compute), found in their prefix cache
    # (local_cache_hit) and fetched from a prefill instance (external_kv_transfer)
    prompt_tokens_by_role: dict[str, dict[str, int]] = field(default_factory=dict)
    pd_paths: dict[str, int] = field(default_factory=dict)  # the router's requests by P/D path
    errors: dict[str, int] = field(default_factory=dict)
    router_metrics: dict[str, float] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)  # every ok request's, in completion order
    flows: dict[str, FlowResult] = field(default_factory=dict)  # a trace's flows (tenants), if it has them


@dataclass
class LiveReport:
    workload: dict[str, Any]
    instances: list[str]
    results: list[TargetResult]
    roles: list[str] = field(default_factory=list)  # each instance's: prefill, decode or both

    @property
    def disaggregated(self) -> bool:
        return any(role != "both" for role in self.roles)

    @property
    def has_flows(self) -> bool:
        return any(r.flows for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "instances": self.instances,
            "roles": self.roles,
            "targets": [dataclasses.asdict(r) for r in self.results],
        }


def run_live_bench(options: LiveOptions, console: Console | None = None) -> LiveReport:
    console = console or Console(width=None if Console().is_terminal else 160)
    if options.pd is not None and options.config is not None:
        raise ValueError("--pd starts a simulated fleet; a --config fleet's roles are its own")
    if options.trace is not None and options.api != "chat":
        raise ValueError("--api is the sessions' API; a trace is replayed as completions")
    if options.responses_chain and options.api != "responses":
        raise ValueError("--responses-chain needs --api responses")
    parse_targets(options.targets or (), default_policy="")  # a typo fails before anything starts
    trace = None if options.trace is None else resolve_trace(options.trace, options.requests, options.rate)
    fleet_args = () if options.config else (*VLLM_ROUTER_HASHING, *_fleet_args(options, trace))
    with contextlib.ExitStack() as stack:
        log_dir = options.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvlive-")))
        fleet = stack.enter_context(_fleet(options, fleet_args, log_dir, console))
        workload = _workload(options, fleet, trace)
        disaggregated = is_disaggregated(fleet.config)
        specs = options.targets or (PD_TARGETS if disaggregated else DEFAULT_TARGETS)
        targets = parse_targets(specs, fleet.config.default_policy)
        described = _describe(workload, options, fleet)
        instances = fleet.config.instances
        report = LiveReport(described, [i.name for i in instances], [], [i.role for i in instances])
        with bench_view(console, lambda: render_tables(report)) as view:
            for index, target in enumerate(targets):
                seed = options.seed + index
                progress = view.target(target.label, workload.size)
                result = _run_target(target, seed, workload, progress, fleet, options, log_dir)
                report.results.append(result)
                view.done(_summary(result))
    console.print(render_tables(report))
    if report.disaggregated:
        console.print(render_pd_table(report.results))
    for result in report.results:
        for key, value in result.router_metrics.items():
            console.print(f"  {result.target}: {key} {value:g}")
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        plots = write_plots(report.results, workload.title, options.out.with_suffix(""))
        console.print(f"results: {options.out}, plots: {', '.join(str(p) for p in plots)}")
    return report


def _workload(options: LiveOptions, fleet: Fleet, trace: Trace | None) -> LiveWorkload:
    if trace is None:
        sessions = AgentWorkload(
            sessions=options.sessions,
            turns=options.turns,
            max_tokens=options.max_tokens,
            system_prompt_words=options.system_prompt_words,
            image_every=options.images_every,
        )
        return SessionWorkload(
            sessions,
            fleet.model,
            options.concurrency,
            options.time_limit_s,
            options.request_timeout_s,
            options.api,
            options.responses_chain,
        )
    plan = ReplayPlan(
        trace,
        fleet.model,
        block_tokens=options.block_tokens,
        max_tokens=options.max_tokens,
        max_prompt_tokens=options.max_prompt_tokens,
        time_limit_s=options.time_limit_s,
        request_timeout_s=options.request_timeout_s,
        session_header=fleet.config.traffic.session_header,
    )
    return TraceWorkload(plan, options.rate)


# What vllm-router asks of vLLM for kv_aware (sha256_cbor, whole 32-byte hashes, PYTHONHASHSEED 0 whatever
# this shell's): every target gets the fleet as vllm-router's documentation sets vLLM up.
VLLM_ROUTER_HASHING = (
    "--prefix-caching-hash-algo",
    "sha256_cbor",
    "--hash-type",
    "bytes",
    "--hash-seed",
    "0",
)


def _block_size(fleet_args: Sequence[str]) -> int:
    """The block size a simulated fleet started with these options has (its last --block-size, else 32)."""
    values = [fleet_args[i + 1] for i, arg in enumerate(fleet_args[:-1]) if arg == "--block-size"]
    return int(values[-1]) if values else 32


def _fleet_args(options: LiveOptions, trace: Trace | None) -> tuple[str, ...]:
    if options.fleet_args is not None or trace is None:
        return options.fleet_args or ()
    rate = TRACE_PREFILL_TOKENS_PER_S * options.block_tokens / trace.block_tokens
    return ("--prefill-tps", f"{rate:g}")


@contextlib.contextmanager
def _fleet(options: LiveOptions, args: Sequence[str], log_dir: Path, console: Console) -> Iterator[Fleet]:
    if options.config is not None:
        config = load_config(options.config)  # names the problem if the file is unreadable or invalid
        yield Fleet(config, yaml.safe_load(options.config.read_text()))
        return
    shape = None if options.pd is None else PDShape(*options.pd, options.kv_connector)
    count = options.fleet_instances if shape is None else shape.instances
    bootstrap_port = 0
    if shape is not None:  # the options given after the P/D ones win
        bootstrap_port = free_port_block(shape.instances)
        args = (*pd_fleet_args(shape, bootstrap_port), *args)
    ports = FleetPorts.allocate(count)
    models: dict[str, object] = {}
    if options.images_every:  # a model whose images the engines and the router lay out alike
        files = str(ensure_files())
        args = ("--model", VISION_MODEL_NAME, "--tokenizer", files, *args)
        models = {"models": [{"name": VISION_MODEL_NAME, "tokenizer": files}]}
    console.print(f"starting {count} simulated vLLM instances ...")
    with running_fleet(ports, log_dir, args):
        raw = ports.router_config(block_size=_block_size(args), **models)
        if shape is not None:
            raw = pd_router_config(raw, shape, bootstrap_port)
        yield Fleet(parse_config(raw), raw, tuple(args))


def _run_target(
    target: Target,
    seed: int,
    workload: LiveWorkload,
    progress: Callable[[], None],
    fleet: Fleet,
    options: LiveOptions,
    log_dir: Path,
) -> TargetResult:
    result = TargetResult(target.label, target.kind, target.policy, seed)
    try:
        with _endpoint(target, fleet, options, log_dir) as (url, metrics_url):
            result.caches_reset = options.reset_caches and reset_prefix_caches(fleet.config)
            before = read_engine_counters(fleet.config)
            router_before = _router_samples(metrics_url)
            run = asyncio.run(workload.run(url, seed, target.label, progress))
            time.sleep(0.3)  # engines count a request's tokens as it finishes; let the last ones land
            after = read_engine_counters(fleet.config)
            router_after = _router_samples(metrics_url)
    except (SkipTarget, NoPDMode, StartupError) as exc:
        result.skipped = str(exc)
        return result
    _fill(result, run, before, after)
    if is_disaggregated(fleet.config):  # decode instances' external hits are KV fetched from prefill ones
        result.pool_hit_rate = None
    result.prompt_tokens_by_role = tokens_by_role(fleet.config, before.by_source, after.by_source)
    samples = [
        (name, dict(labels), value - router_before.get((name, labels), 0.0))
        for (name, labels), value in router_after.items()
    ]
    result.router_metrics = {
        name + "{" + ",".join(f"{k}={v}" for k, v in labels.items()) + "}": value
        for name, labels, value in samples
    }
    result.pd_paths = {path: round(count) for path, count in pd_paths(samples).items()}
    return result


@contextlib.contextmanager
def _endpoint(
    target: Target, fleet: Fleet, options: LiveOptions, log_dir: Path
) -> Iterator[tuple[str, str | None]]:
    """The target's base URL and, for routers with a separate metrics port, its metrics URL."""
    if target.kind == "url":
        yield target.url, None
    elif target.kind == "kvroute":
        config = kvroute_config(fleet, target.policy)
        with running_router(config, log_dir, name=f"kvroute-{target.policy}") as url:
            yield url, url
    elif target.kind == "kvroute-replicas":
        config = kvroute_config(fleet, fleet.config.default_policy)
        with running_replicas(config, target.policy, log_dir) as urls:
            yield urls
    elif target.kind == "smg":
        if is_disaggregated(fleet.config):
            raise SkipTarget("smg targets need an aggregated fleet (its P/D mode is not set up here)")
        if options.trace is not None:
            raise SkipTarget("smg 1.13 refuses a completion whose prompt is token ids, as a trace's are")
        binary = find_smg(options.smg)
        if binary is None:
            raise SkipTarget("smg is not installed (pip install 'kvroute[bench]')")
        with running_smg(binary, target.policy, fleet.config, log_dir) as urls:
            yield urls
    else:
        binary = find_vllm_router(options.vllm_router)
        if binary is None:
            raise SkipTarget("vllm-router is not installed (pip install 'kvroute[bench]')")
        with running_vllm_router(binary, target.policy, fleet, options, log_dir) as urls:
            yield urls


def kvroute_config(fleet: Fleet, policy: str) -> dict[str, Any]:
    """The fleet's configuration with ``policy`` as the default (round-robin added if it is missing), and
    the objectives the simulator configures (kvroute/simulate/policies.py) beside any of its own, which win
    where they share a name: a trace's objectives mean the same live as simulated."""
    policies = {name: spec.model_dump(mode="json") for name, spec in fleet.config.policies.items()}
    policies.setdefault("round-robin", ROUND_ROBIN)
    if policy not in policies:
        raise SkipTarget(f"no policy {policy!r} in the configuration; defined: {', '.join(policies)}")
    config = copy.deepcopy(fleet.raw)
    config["policies"] = policies
    config["default_policy"] = policy
    flow_control = config.get("flow_control") or {}
    objectives = {**copy.deepcopy(SIM_OBJECTIVES), **(flow_control.get("objectives") or {})}
    config["flow_control"] = {**flow_control, "objectives": objectives}
    return config


def find_vllm_router(explicit: str | None) -> str | None:
    return find_executable("vllm-router", explicit)


def vllm_router_args(binary: str, policy: str, fleet: Fleet, port: int, metrics_port: int) -> list[str]:
    """vllm-router (0.1.17) in front of the fleet; kv_aware also subscribes to every instance's events, and
    ``kv_aware+VARIANT`` adds the variant's options. On a disaggregated fleet, its P/D mode
    (kvroute/bench/live/pd.py)."""
    policy, _, variant = policy.partition("+")
    args = [
        binary,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--worker-startup-timeout-secs",
        "120",
        "--worker-startup-check-interval",
        "1",
    ]
    if is_disaggregated(fleet.config):
        if variant:
            raise SkipTarget(f"{policy}+{variant} is set up for an aggregated fleet only")
        return args + vllm_router_pd_args(fleet.config, policy)
    if "/" in policy:
        raise SkipTarget(f"{policy}: a policy per stage (PREFILL/DECODE) needs a disaggregated fleet")
    instances = fleet.config.instances
    args += ["--worker-urls", *(i.url for i in instances), "--policy", policy]
    if policy == "kv_aware":
        missing = [i.name for i in instances if not i.events]
        if missing:
            raise SkipTarget(f"kv_aware needs every instance's events; missing: {', '.join(missing)}")
        for instance in instances:
            args += ["--kv-event-source", f"{instance.url}={instance.events}"]
            if instance.replay:
                args += ["--kv-event-replay-source", f"{instance.url}={instance.replay}"]
        args += ["--kv-event-block-size", str(fleet.config.block_size), "--kv-event-model", fleet.model]
    return [*args, *VLLM_ROUTER_VARIANTS[variant]] if variant else args


@contextlib.contextmanager
def running_vllm_router(
    binary: str, policy: str, fleet: Fleet, options: LiveOptions, log_dir: Path
) -> Iterator[tuple[str, str]]:
    name = f"vllm-router-{policy.replace('/', '-')}"
    args = functools.partial(vllm_router_args, binary, policy, fleet)
    # /health answers once every worker is healthy
    with running_peer_router(name, args, log_dir, "/health") as urls:
        yield urls


def reset_prefix_caches(config: RouterConfig) -> bool:
    """Empty every instance's prefix cache; False if one does not allow it (vLLM needs dev mode)."""
    done = True
    for instance in config.instances:
        request = urllib.request.Request(instance.url + "/reset_prefix_cache", method="POST")
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except (urllib.error.URLError, OSError):
            done = False
    return done


def _scrape(url: str) -> Iterator[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    yield from samples_of(text)


def samples_of(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a /metrics page; of one with a malformed sample (vllm-router 0.1.17's program
    scheduling repeats a label), all the others."""
    try:
        return list(_samples(text))
    except ValueError:
        return [sample for line in text.splitlines() for sample in _line_samples(line)]


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, float(sample.value)


def _line_samples(line: str) -> list[tuple[str, dict[str, str], float]]:
    """The sample on one exposition line; none for a comment or a line the parser refuses."""
    if not line or line.startswith("#"):
        return []
    try:
        return list(_samples(line + "\n"))
    except ValueError:
        return []


def read_engine_counters(config: RouterConfig) -> EngineCounters:
    sums: dict[str, float] = dict.fromkeys((_QUERIES, _HITS, _EXTERNAL_QUERIES, _EXTERNAL_HITS), 0.0)
    seen: set[str] = set()
    finished: dict[str, float] = {}
    by_source: dict[str, dict[str, float]] = {}
    for instance in config.instances:
        finished[instance.name] = 0.0
        samples = list(_scrape(instance.url + "/metrics"))
        by_source[instance.name] = tokens_by_source(samples)
        for name, _, value in samples:
            if name in (_QUERIES, _HITS, _EXTERNAL_QUERIES, _EXTERNAL_HITS):
                sums[name] += value
                seen.add(name)
            elif name == _FINISHED:
                finished[instance.name] += value
    pool = _EXTERNAL_QUERIES in seen and _EXTERNAL_HITS in seen
    return EngineCounters(
        sums[_QUERIES],
        sums[_HITS],
        sums[_EXTERNAL_QUERIES] if pool else None,
        sums[_EXTERNAL_HITS] if pool else None,
        finished,
        by_source,
    )


_Labels = tuple[tuple[str, str], ...]


def _router_samples(url: str | None) -> dict[tuple[str, _Labels], float]:
    """The router's own counters this benchmark reports (kv_aware's lookups, P/D paths)."""
    if url is None:
        return {}
    values: dict[tuple[str, _Labels], float] = {}
    with contextlib.suppress(urllib.error.URLError, OSError):
        for name, labels, value in _scrape(url + "/metrics"):
            if name in _ROUTER_METRICS:
                values[name, tuple(sorted(labels.items()))] = value
    return values


def _fill(result: TargetResult, run: SessionRun, before: EngineCounters, after: EngineCounters) -> None:
    outcomes = run.outcomes
    ok = [o for o in outcomes if o.status == "ok"]
    result.sent = len(outcomes)
    result.ok = len(ok)
    result.failed = sum(o.status == "failed" for o in outcomes)
    result.rejected = sum(o.status == "rejected" for o in outcomes)
    result.errors = dict(Counter(o.error for o in outcomes if o.error).most_common(5))
    if isinstance(run, ReplayRun):
        result.not_sent, result.late_s, result.past_limit = run.not_sent, run.late_s, run.past_limit
    result.ttft_ms = [round(o.ttft_s * 1000, 2) for o in ok]
    result.flows = flow_results(outcomes)
    if ok:
        ttfts = sorted(o.ttft_s for o in ok)
        result.ttft_p50_ms = _quantile(ttfts, 0.5) * 1000
        result.ttft_p99_ms = _quantile(ttfts, 0.99) * 1000
        result.e2e_p50_ms = _quantile(sorted(o.e2e_s for o in ok), 0.5) * 1000
    result.duration_s = run.duration_s
    result.prompt_tokens = sum(o.prompt_tokens for o in ok)
    if run.duration_s > 0:
        result.requests_per_s = len(ok) / run.duration_s
        result.prompt_tokens_per_s = result.prompt_tokens / run.duration_s
    result.prefix_queries = after.queries - before.queries
    result.prefix_hits = after.hits - before.hits
    if result.prefix_queries > 0:
        result.local_hit_rate = result.prefix_hits / result.prefix_queries
        if after.external_hits is not None and before.external_hits is not None:
            external_queries = (after.external_queries or 0.0) - (before.external_queries or 0.0)
            if external_queries > 0:  # a connector that was never asked is no pool
                pool_hits = after.external_hits - before.external_hits
                result.pool_hit_rate = pool_hits / result.prefix_queries
    result.requests_per_instance = {
        name: round(after.finished.get(name, 0.0) - before.finished.get(name, 0.0)) for name in after.finished
    }


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def _describe(workload: LiveWorkload, options: LiveOptions, fleet: Fleet) -> dict[str, Any]:
    count = len(fleet.config.instances)
    return {
        **workload.describe(),
        "fleet_args": list(fleet.args),
        "title": workload.title,
        "config": str(options.config) if options.config else f"simulated fleet of {count}",
        "disaggregation": fleet.config.disaggregation.connector if is_disaggregated(fleet.config) else None,
    }


def _summary(result: TargetResult) -> str:
    if result.skipped:
        return f"[yellow]skipped: {escape(result.skipped.splitlines()[0])}"
    errors = f", errors: {result.errors}" if result.errors else ""
    not_sent = f", {result.not_sent} too long, not sent" if result.not_sent else ""
    if result.past_limit:
        not_sent += f", {result.past_limit} after a tool call past the time limit, not sent"
    return f"{result.ok}/{result.sent} ok in {result.duration_s:.1f} s{not_sent}{errors}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def render_tables(report: LiveReport) -> RenderableType:
    """The results table, and the table per flow when the trace has flows."""
    if not report.has_flows:
        return render_table(report)
    return Group(render_table(report), render_flow_table(report))


def render_flow_table(report: LiveReport) -> Table:
    """Each target's requests by flow (tenant): TTFT, and how many failed or were refused."""
    table = Table(title="per flow")
    for column in ("target", "flow", "requests", "ok", "failed", "rejected", "TTFT p50", "TTFT p99"):
        table.add_column(column, no_wrap=column == "target")
    for r in report.results:
        for flow, f in r.flows.items():
            table.add_row(
                r.target,
                flow,
                str(f.requests),
                str(f.ok),
                str(f.failed),
                str(f.rejected),
                _ms(f.ttft_p50_ms),
                _ms(f.ttft_p99_ms),
            )
    return table


def render_table(report: LiveReport) -> Table:
    table = Table(
        title=f"{report.workload['title']}, {len(report.instances)} instances, streaming",
        caption=f"requests per instance: {' / '.join(report.instances)}",
    )
    table.add_column("target", no_wrap=True)
    columns = (
        "sent",
        "ok",
        "failed",
        "rejected",
        "TTFT p50",
        "TTFT p99",
        "e2e p50",
        "req/s",
        "prompt tok/s",
        "local hit",
        "pool hit",
        "per instance",
    )
    for column in columns:
        table.add_column(column)
    for r in report.results:
        if r.skipped:
            table.add_row(r.target, *["-"] * 11, f"skipped: {escape(r.skipped.splitlines()[0])}")
            continue
        table.add_row(
            r.target,
            str(r.sent),
            str(r.ok),
            str(r.failed),
            str(r.rejected),
            _ms(r.ttft_p50_ms),
            _ms(r.ttft_p99_ms),
            _ms(r.e2e_p50_ms),
            f"{r.requests_per_s:.1f}",
            f"{r.prompt_tokens_per_s:.0f}",
            _rate(r.local_hit_rate),
            _rate(r.pool_hit_rate),
            " / ".join(str(count) for count in r.requests_per_instance.values()),
        )
    return table
