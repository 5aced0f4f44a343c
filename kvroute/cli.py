"""The ``kvroute`` command: serve, epp, fleet, demo, check-config, build-model."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.request_queue import SCHEDULING_POLICIES
from kvroute.arguments import MAX_PORT, parse_pd, port, positive_float, positive_int, positive_ints
from kvroute.extras import requires_extra

if TYPE_CHECKING:
    from router.config import RouterConfig
    from router.prompt.tokenization import PromptTokenizer


log = logging.getLogger(__name__)


def _load_config(path: str) -> RouterConfig | None:
    """The configuration, or None after printing why it cannot be used."""
    from router.config import ConfigError, load_config

    try:
        config = load_config(Path(path))
        config.require_api_keys(path)
        config.require_tokenizers(path)
        for warning in config.tokenizer_warnings():
            log.warning("%s: %s", path, warning)
        return config
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    from router.http.server import run_server
    from router.http.workers import run_workers

    path = Path(args.config) if args.config else _config_from_workers(args)
    if path is None:
        return 2
    config = _load_config(str(path))
    if config is None:
        return 2
    if args.workers > 1:
        return run_workers(config, path, args.host, args.port, args.workers)
    run_server(config, args.host, args.port, path)
    return 0


def _config_from_workers(args: argparse.Namespace) -> Path | None:
    """--worker-urls: the configuration the instances describe, printed and written to a file of its own
    (the workers and a reload read it there); None after printing why it cannot be made."""
    import tempfile

    import yaml

    from kvroute.worker_urls import WorkersUnreadable, config_from_workers

    try:
        config = config_from_workers(args.worker_urls, args.kv_events or (), args.kv_replay or ())
    except WorkersUnreadable as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return None
    text = yaml.safe_dump(config, sort_keys=False)
    path = Path(tempfile.mkdtemp(prefix="kvroute-")) / "router.yaml"
    path.write_text(text)
    print(
        f"# the configuration of these instances ({path}); keep it and start with --config:\n{text}",
        flush=True,
    )
    return path


def _epp(args: argparse.Namespace) -> int:
    from router.epp.server import Listen, run_epp

    config = _load_config(args.config)
    if config is None:
        return 2
    run_epp(config, Listen(args.host, args.port, args.metrics_port), args.fallbacks, Path(args.config))
    return 0


def _check_config(args: argparse.Namespace) -> int:
    config = _load_config(args.config)
    if config is None:
        return 2
    print(f"{args.config}: ok ({len(config.instances)} instances, policies: {', '.join(config.policies)})")
    return 0


def _roles(value: str) -> tuple[str, ...]:
    roles = tuple(role.strip() for role in value.split(","))
    if unknown := [role for role in roles if role not in ("prefill", "decode", "both")]:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: a role is prefill, decode or both")
    return roles


def _fleet(args: argparse.Namespace) -> int:
    with requires_extra("fleet"):
        import uvloop

        from fleet.engine import EngineTiming
        from fleet.launcher import FleetOptions, run_fleet

    engines = args.instances * args.data_parallel_size
    if args.roles and len(args.roles) != args.instances:
        print(
            f"kvroute fleet: --roles names {len(args.roles)} roles for {args.instances} instances",
            file=sys.stderr,
        )
        return 2
    last = max(args.port + args.instances, args.event_port + engines, args.replay_port + engines) - 1
    if last > MAX_PORT:
        print(
            f"kvroute fleet: {args.instances} instances need ports up to {last}, past {MAX_PORT}",
            file=sys.stderr,
        )
        return 2
    try:
        tokenizer = _tokenizer(args.tokenizer)
    except (OSError, ValueError) as exc:
        print(f"kvroute fleet: --tokenizer {args.tokenizer}: {exc}", file=sys.stderr)
        return 2
    options = FleetOptions(
        tokenizer_path=tokenizer.path,
        instances=args.instances,
        host=args.host,
        port=args.port,
        event_port=args.event_port,
        replay_port=args.replay_port,
        model_name=args.model,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        max_model_len=args.max_model_len,
        event_encoding=args.event_encoding,
        int_hashes=args.hash_type == "int",
        hash_algorithm=args.prefix_caching_hash_algo,
        hash_seed=args.hash_seed,
        name_prefix=args.name_prefix,
        first_index=args.first_index,
        drop_events=args.drop_events,
        events_topic=args.kv_events_topic,
        lora_modules=tuple((name, path) for name, _, path in (m.partition("=") for m in args.lora_modules)),
        api_key=args.api_key,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        max_new_tokens=args.max_new_tokens,
        eos_after=args.eos_after,
        auto_tool_choice=args.enable_auto_tool_choice,
        responses_store=args.enable_responses_api_store,
        responses_store_capacity=args.responses_store_capacity,
        data_parallel_size=args.data_parallel_size,
        timing=EngineTiming(
            prefill_tokens_per_s=args.prefill_tps,
            decode_s_per_token=1.0 / args.decode_tps,
            max_num_seqs=args.max_num_seqs,
            max_batched_tokens=args.max_batched_tokens,
            transfer_tokens_per_s=args.transfer_tps,
            scheduling_policy=args.scheduling_policy,
        ),
        roles=args.roles,
        kv_connector=args.kv_connector,
        bootstrap_port=args.bootstrap_port,
    )
    uvloop.run(run_fleet(options, tokenizer))
    return 0


def _tokenizer(spec: str) -> PromptTokenizer:
    """spec's tokenizer (a directory or builtin:NAME); OSError or ValueError saying why there is none."""
    from router.prompt.tokenization import PromptTokenizer, resolve_tokenizer_path

    path = resolve_tokenizer_path(spec)
    if not path.is_dir():  # transformers would take it for a hub repository's name, and say that
        raise NotADirectoryError("not a directory")
    return PromptTokenizer(path)


def _demo(args: argparse.Namespace) -> int:
    with requires_extra("fleet"):
        from kvroute.demo.run import DemoOptions, run_demo

    options = DemoOptions(sessions=args.sessions, turns=args.turns, instances=args.instances, api=args.api)
    return run_demo(options)


def _bench_index(args: argparse.Namespace) -> int:
    with requires_extra("bench"):
        from kvroute.bench.index import BenchOptions, run_bench
    from router.prompt.token_cache import CachedChatTokenizer
    from router.prompt.tokenization import PromptTokenizer, resolve_tokenizer_path

    if args.serve_instances % 8:
        print(
            "bench index: --serve-instances: 8 publisher processes send them, a multiple of 8",
            file=sys.stderr,
        )
        return 2
    tokenizer = PromptTokenizer(resolve_tokenizer_path("builtin:tiny-llama"))
    out = Path(args.out) if args.out else None
    options = BenchOptions(
        args.sizes,
        args.repeats,
        out,
        args.wire_blocks,
        args.wire_single_blocks,
        args.fleets,
        args.host_blocks,
        args.host_workers,
        args.serve_blocks,
        args.serve_single_blocks,
        args.serve_instances,
    )
    run_bench(options, lambda: CachedChatTokenizer(tokenizer))
    return 0


def _bench_store(args: argparse.Namespace) -> int:
    with requires_extra("bench"):
        from kvroute.bench.store import run

    run(args.operations, args.out)
    return 0


def _bench_live(args: argparse.Namespace) -> int:
    import shlex

    with requires_extra("bench"):
        from kvroute.bench.live.run import LiveOptions, run_live_bench
    from kvroute.processes import StartupError
    from router.config import ConfigError

    options = LiveOptions(
        config=Path(args.config) if args.config else None,
        fleet_instances=args.fleet,
        fleet_args=None if args.fleet_args is None else tuple(shlex.split(args.fleet_args)),
        pd=args.pd,
        kv_connector=args.kv_connector,
        targets=tuple(args.targets.split(",")) if args.targets else None,
        sessions=args.sessions,
        turns=args.turns,
        concurrency=args.concurrency,
        time_limit_s=args.time_limit,
        request_timeout_s=args.request_timeout,
        max_tokens=args.max_tokens,
        system_prompt_words=args.system_words,
        api=args.api,
        responses_chain=args.responses_chain,
        trace=args.trace,
        rate=args.rate,
        requests=args.requests or None,
        block_tokens=args.block_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed,
        vllm_router=args.vllm_router,
        smg=args.smg,
        reset_caches=not args.no_reset,
        images_every=args.images_every,
        out=Path(args.out) if args.out else None,
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )
    try:
        report = run_live_bench(options)
    except (ConfigError, StartupError, ValueError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0 if any(r.ok for r in report.results) else 1


def _build_model(args: argparse.Namespace) -> int:
    from tinymodel.builder import ensure_model

    print(ensure_model())
    return 0


def _stack(args: argparse.Namespace) -> int:
    from kvroute.processes import StartupError
    from kvroute.stack.config import StackConfigError, load_stack_config
    from kvroute.stack.run import stack_down, stack_status, stack_up

    run_dir = Path(args.run_dir)
    if args.action == "down":
        stopped = stack_down(run_dir)
        print(f"stopped: {', '.join(stopped)}" if stopped else f"nothing running from {run_dir}")
        return 0
    if args.action == "status":
        processes = stack_status(run_dir)
        for name, alive, healthy in processes:
            print(f"{name:<18} {'alive' if alive else 'dead':<6} {'healthy' if healthy else 'unhealthy'}")
        return 0 if processes and all(healthy for _, _, healthy in processes) else 1
    try:
        stack = stack_up(load_stack_config(Path(args.config)), run_dir, with_router=not args.no_router)
    except (StackConfigError, StartupError) as exc:
        print(exc, file=sys.stderr)
        return 2
    timings = ", ".join(f"{k} {v:.0f}s" for k, v in stack.timings.items())
    router = f"router {stack.router_url}, " if stack.with_router else ""
    print(f"{router}instances {' '.join(i.url for i in stack.instances)} ({timings})")
    for instance in stack.instances:
        print(f"  {instance.name}: {instance.url}, KV events {instance.events}, replay {instance.replay}")
    print(f"state and logs in {run_dir}; stop with: kvroute stack down --run-dir {run_dir}")
    return 0


class _DefaultsShown(argparse.HelpFormatter):
    """Help that names each option's default, when it has one worth naming and does not name it itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if not text or "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _parser() -> argparse.ArgumentParser:
    from kvroute.bench.calibrate.command import add_calibrate_parser
    from kvroute.bench.overhead.command import add_overhead_parser
    from kvroute.simulate.command import add_simulate_parser

    parser = argparse.ArgumentParser(prog="kvroute", description="Cache-aware router for vLLM fleets")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True)

    with_defaults = _DefaultsShown
    serve = commands.add_parser("serve", help="run the router", formatter_class=with_defaults)
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="routing configuration (YAML)")
    source.add_argument(
        "--worker-urls",
        nargs="+",
        metavar="URL",
        help="instead of --config: the vLLM instances' URLs; what they serve, their block size and the "
        "tokenizer are read from them, and the configuration made is printed",
    )
    serve.add_argument(
        "--kv-events",
        nargs="+",
        metavar="URL",
        help="with --worker-urls: each instance's KV events endpoint (tcp://HOST:PORT), in the same order",
    )
    serve.add_argument(
        "--kv-replay",
        nargs="+",
        metavar="URL",
        help="with --worker-urls: each instance's KV events replay endpoint, in the same order",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=8000, help="port to listen on")
    serve.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="router processes sharing the port and one block index (held by one more process, the index "
        "host), counting each other's requests in flight (docs/operations.md: Several workers on one host)",
    )
    serve.set_defaults(run=_serve)

    epp = commands.add_parser(
        "epp", help="run as a gateway's endpoint picker (Envoy ext_proc, gRPC)", formatter_class=with_defaults
    )
    epp.add_argument("--config", required=True, help="routing configuration (YAML)")
    epp.add_argument("--host", default="127.0.0.1", help="address to listen on")
    epp.add_argument("--port", type=port, default=9002, help="gRPC port: ext_proc and health")
    epp.add_argument("--metrics-port", type=port, default=9090, help="HTTP port: /metrics and /health")
    epp.add_argument(
        "--fallbacks",
        type=int,
        default=2,
        choices=range(8),
        metavar="N",
        help="endpoints after the chosen one the gateway may try in turn (0: one endpoint only, as an "
        "ORIGINAL_DST cluster reads)",
    )
    epp.set_defaults(run=_epp)

    check = commands.add_parser("check-config", help="validate a configuration file without starting")
    check.add_argument("config")
    check.set_defaults(run=_check_config)

    fleet = commands.add_parser(
        "fleet", help="run simulated vLLM instances (no GPU needed)", formatter_class=with_defaults
    )
    fleet.add_argument("--instances", type=positive_int, default=3, help="simulated vLLM instances")
    fleet.add_argument("--host", default="127.0.0.1", help="address every instance listens on")
    fleet.add_argument("--port", type=port, default=8101, help="HTTP port of the first instance")
    fleet.add_argument(
        "--event-port", type=port, default=5601, help="KV event PUB port of the first instance"
    )
    fleet.add_argument(
        "--replay-port", type=port, default=5701, help="KV event replay port of the first instance"
    )
    fleet.add_argument("--model", default="tiny-llama", help="served model name")
    fleet.add_argument(
        "--tokenizer", default="builtin:tiny-llama", help="tokenizer directory or builtin:NAME"
    )
    fleet.add_argument("--block-size", type=positive_int, default=32, help="tokens per KV block")
    fleet.add_argument(
        "--kv-blocks", type=positive_int, default=2048, help="KV cache capacity in blocks per instance"
    )
    fleet.add_argument("--max-model-len", type=positive_int, default=32768, help="longest prompt and answer")
    fleet.add_argument(
        "--max-new-tokens",
        type=positive_int,
        help="the output budget of a request that names none (else the rest of the context), as vLLM's "
        "--override-generation-config '{\"max_new_tokens\": N}'",
    )
    fleet.add_argument(
        "--eos-after",
        type=positive_int,
        help="the simulated model samples its end-of-sequence token after N tokens: a longer budget ends "
        "there, as a finished answer (finish_reason stop, Anthropic's end_turn); default: never, every "
        "answer runs to its budget",
    )
    fleet.add_argument("--prefill-tps", type=positive_float, default=8000.0, help="prefill tokens per second")
    fleet.add_argument(
        "--decode-tps", type=positive_float, default=100.0, help="decode steps (tokens) per second"
    )
    fleet.add_argument(
        "--max-num-seqs", type=positive_int, default=16, help="concurrent sequences per instance"
    )
    fleet.add_argument(
        "--max-batched-tokens", type=positive_int, default=2048, help="token budget of one engine step"
    )
    fleet.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="as vLLM's: fcfs, or priority (the waiting queue by each request's `priority`, lowest first, "
        "and the lowest-ranked request preempted)",
    )
    fleet.add_argument(
        "--event-encoding", choices=["map", "array"], default="map", help="KV events' msgpack form"
    )
    fleet.add_argument("--hash-type", choices=["int", "bytes"], default="int", help="KV events' block hashes")
    fleet.add_argument(
        "--prefix-caching-hash-algo",
        choices=["sha256", "sha256_cbor"],  # fleet/block_pool.py's HASH_ALGORITHMS
        default="sha256",
        help="block hash algorithm, as vLLM's option",
    )
    fleet.add_argument(
        "--hash-seed",
        default=os.environ.get("PYTHONHASHSEED", "0"),
        help="what NONE_HASH hashes, as vLLM's PYTHONHASHSEED; default: PYTHONHASHSEED when set, else 0 "
        "(a real vLLM without it uses vllm-none-hash)",
    )
    fleet.add_argument("--name-prefix", default="fleet-", help="instance names: PREFIX0, PREFIX1, ...")
    fleet.add_argument("--first-index", type=int, default=0, help="index of the first instance's name")
    fleet.add_argument(
        "--kv-events-topic",
        default="",
        help="ZMQ topic of the KV event frames, {instance} and {model} filled in; default: empty, as vLLM's "
        "(vllm-router's kv_aware reads no other); llm-d's indexer expects kv@{instance}@{model}",
    )
    fleet.add_argument(
        "--drop-events",
        type=float,
        default=0.0,
        help="share of KV event batches not published live (replay still has them), to test gap handling",
    )
    fleet.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME[=PATH]",
        help="LoRA adapters every instance serves, named as vLLM's option names them (no weights here)",
    )
    fleet.add_argument("--api-key", help="required on /v1 requests (Authorization: Bearer), as vLLM's option")
    fleet.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='render a chat whose tool_choice is "none" without its tools, as vLLM\'s option',
    )
    fleet.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details in answers (cached_tokens: the prompt tokens found cached), as "
        "vLLM's option; the router's A/B reads its engine hit rate there",
    )
    fleet.add_argument(
        "--enable-responses-api-store",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep Responses API responses (previous_response_id, background, retrieve, cancel), as vLLM "
        "with VLLM_ENABLE_RESPONSES_API_STORE=1; each instance keeps its newest --responses-store-capacity",
    )
    fleet.add_argument(
        "--responses-store-capacity", type=positive_int, default=1024, help="responses kept per instance"
    )
    fleet.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="take chats and Anthropic bodies with tools, as vLLM with --enable-auto-tool-choice and a "
        "--tool-call-parser",
    )
    fleet.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        help="engines per instance behind its API server, as vLLM's option; rank R of instance I publishes "
        "at the event and replay ports + I x size + R",
    )
    fleet.add_argument(
        "--roles",
        type=_roles,
        default=(),
        metavar="ROLE,...",
        help="each instance's role, prefill, decode or both (prefill/decode disaggregation); default: all "
        "both",
    )
    fleet.add_argument(
        "--kv-connector",
        choices=["nixl", "mooncake"],
        default="nixl",
        help="the prefill-to-decode connector the instances speak (kv_transfer_params as vLLM's)",
    )
    fleet.add_argument(
        "--bootstrap-port",
        type=port,
        default=8998,
        help="MooncakeConnector's bootstrap port of the first instance (instance i: + i), as decode legs "
        "name it",
    )
    fleet.add_argument(
        "--transfer-tps",
        type=positive_float,
        default=100_000.0,
        help="KV tokens a decode instance fetches a second",
    )
    fleet.set_defaults(run=_fleet)

    demo = commands.add_parser("demo", help="fleet + router + an agentic workload, for every policy")
    demo.add_argument("--sessions", type=positive_int, default=8)
    demo.add_argument("--turns", type=positive_int, default=6)
    demo.add_argument("--instances", type=positive_int, default=3)
    demo.add_argument(
        "--api",
        choices=("chat", "responses", "messages"),
        default="chat",
        help="the sessions' API: /v1/chat/completions, /v1/responses (as Codex), /v1/messages (as Claude "
        "Code)",
    )
    demo.set_defaults(run=_demo)

    bench = commands.add_parser("bench", help="benchmarks")
    benches = bench.add_subparsers(dest="bench", required=True)
    index = benches.add_parser("index", help="index ingest, memory, lookup and the routing decision")
    index.add_argument(
        "--sizes",
        type=positive_ints,
        default=(1_000_000, 10_000_000),
        help="index sizes for ingest and memory, comma-separated (default: 1000000,10000000)",
    )
    index.add_argument("--repeats", type=positive_int, default=200)
    index.add_argument(
        "--wire-blocks",
        type=positive_ints,
        default=(2_000_000, 10_000_000),
        help="end to end over ZMQ, 32 blocks a message: blocks sent (each also a memory figure)",
    )
    index.add_argument(
        "--wire-single-blocks",
        type=positive_int,
        default=200_000,
        help="end to end over ZMQ, one block a message: blocks sent",
    )
    index.add_argument(
        "--fleets", type=positive_ints, default=(8, 100, 1_000), help="instances of the fleets decided over"
    )
    index.add_argument(
        "--host-blocks",
        type=int,
        default=2_000_000,
        help="one index per host: blocks sent over ZMQ to a lone kvroute serve and to --host-workers "
        "workers, whose memory growth is compared (0: not measured)",
    )
    index.add_argument("--host-workers", type=positive_int, default=4)
    index.add_argument(
        "--serve-blocks",
        type=int,
        default=2_000_000,
        help="a lone kvroute serve measured from outside (CPU and RSS from /proc): blocks sent at 32 a "
        "message, of 16 and of 32 tokens (0: not measured)",
    )
    index.add_argument(
        "--serve-single-blocks", type=int, default=100_000, help="the same, blocks sent one a message"
    )
    index.add_argument(
        "--serve-instances",
        type=positive_int,
        default=8,
        help="the instances publishing to it, from 8 processes (a multiple of 8)",
    )
    index.add_argument("--out", default="bench-results/index.json", help="JSON results ('' for none)")
    index.set_defaults(run=_bench_index)
    live = benches.add_parser("live", help="agent sessions or a trace through several routers, one fleet")
    live.add_argument("--config", help="router configuration (YAML) naming the instances; default: --fleet")
    live.add_argument("--fleet", type=int, default=3, help="without --config: simulated instances to start")
    live.add_argument("--fleet-args", help="kvroute fleet options for it (trace default: scaled timings)")
    live.add_argument(
        "--pd",
        type=parse_pd,
        metavar="P:D",
        help="without --config: a disaggregated fleet of P prefill and D decode instances (not --fleet); "
        "vllm-router targets run in its P/D mode",
    )
    live.add_argument(
        "--kv-connector",
        choices=["nixl", "mooncake"],
        default="nixl",
        help="with --pd: the prefill-to-decode connector the instances speak",
    )
    live.add_argument(
        "--targets",
        help="comma-separated: kvroute[:POLICY], kvroute-replicas:N[+shared] (N replicas behind nginx's "
        "round robin, sharing a Redis store or not), vllm-router:POLICY (or :PREFILL/DECODE on a P/D fleet; "
        "kv_aware+affinity and kv_aware+programs turn on its session affinity or program scheduling), "
        "smg:POLICY (SGLang's model gateway), NAME=URL (a running router); default: kvroute:round-robin,"
        "kvroute,vllm-router:round_robin,vllm-router:cache_aware,vllm-router:kv_aware,smg:cache_aware; on a "
        "P/D fleet vllm-router:power_of_two instead of smg",
    )
    live.add_argument(
        "--trace",
        help="replay agentic, programs (each turn after its session's answer and tool call), mooncake, "
        "tenants, flows or a JSONL file (open loop), not sessions",
    )
    live.add_argument("--rate", type=float, default=5.0, help="trace: multiplies its arrival rate")
    live.add_argument("--requests", type=int, default=400, help="trace: its first N requests (0: all)")
    live.add_argument("--block-tokens", type=int, default=32, help="trace: real tokens per hash id")
    live.add_argument("--max-prompt-tokens", type=int, help="trace: longer prompts are not sent")
    live.add_argument("--sessions", type=int, default=8)
    live.add_argument("--turns", type=int, default=8)
    live.add_argument("--concurrency", type=int, default=8, help="sessions in flight at once")
    live.add_argument("--time-limit", type=float, default=300.0, help="seconds per target (trace: arrivals)")
    live.add_argument("--request-timeout", type=float, default=120.0)
    live.add_argument("--max-tokens", type=int, default=16, help="output tokens per turn (trace: at most)")
    live.add_argument("--system-words", type=int, default=400, help="words of the shared system prompt")
    live.add_argument(
        "--api",
        choices=("chat", "responses", "messages"),
        default="chat",
        help="sessions' API: /v1/chat/completions, /v1/responses (as Codex), /v1/messages (as Claude Code)",
    )
    live.add_argument(
        "--images-every",
        type=int,
        default=0,
        metavar="N",
        help="chat sessions: every Nth turn's message carries a screenshot (a PNG sent inline); the "
        "simulated fleet then serves a tiny Idefics3, whose images vLLM and kvroute key alike (0: none)",
    )
    live.add_argument(
        "--responses-chain",
        action="store_true",
        help="with --api responses: each turn sends only its new input after previous_response_id (stored)",
    )
    live.add_argument("--seed", type=int, default=1, help="target i replays sessions of seed + i")
    live.add_argument("--vllm-router", help="vllm-router binary; default: beside this Python or on PATH")
    live.add_argument("--smg", help="SGLang's model gateway (smg); default: beside this Python or on PATH")
    live.add_argument("--no-reset", action="store_true", help="do not reset prefix caches between targets")
    live.add_argument("--out", default="bench-results/live.json", help="JSON results ('' for none)")
    live.add_argument("--log-dir", help="keep the routers' logs here (default: a temporary directory)")
    live.set_defaults(run=_bench_live)
    store = benches.add_parser("store", help="the replicas' shared store: Redis against NATS")
    store.add_argument("--operations", type=positive_int, default=2000, help="of each kind, each way timed")
    store.add_argument("--out", default="bench-results/store.json", help="JSON results ('' for none)")
    store.set_defaults(run=_bench_store)
    add_simulate_parser(benches)
    add_overhead_parser(benches)
    add_calibrate_parser(benches)

    build = commands.add_parser("build-model", help="build the tiny local model and print its directory")
    build.set_defaults(run=_build_model)

    stack = commands.add_parser("stack", help="the real stack: vLLM instances, Mooncake master, the router")
    stack.add_argument("action", choices=["up", "down", "status"])
    stack.add_argument("--config", default="configs/stack-cpu.yaml", help="stack configuration (YAML)")
    stack.add_argument("--run-dir", default=".stack", help="state.json, generated configs and logs")
    stack.add_argument(
        "--no-router", action="store_true", help="up: the engines and the pool alone, for your own router"
    )
    stack.set_defaults(run=_stack)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # SIGHUP is held from the first line until the command is known (the parser's imports take most of a
    # second): its default would end a `serve` or `epp` still starting. Those ignore it until their reloader
    # takes it, as the file is read at the start and the reloader's first look reloads it when it changed
    # meanwhile; the other commands are ended by it, as before.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        args = _parser().parse_args(argv)
        if args.run in (_serve, _epp):
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # discards one held meanwhile
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # A SIGTERM unwinds like Ctrl-C, so the fleets, routers and stacks a command started are stopped too
    # (uvicorn installs its own handlers for `serve`).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    code: int = args.run(args)
    return code


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
