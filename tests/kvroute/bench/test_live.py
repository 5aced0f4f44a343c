"""`kvroute bench live` runs agent sessions through each router in front of the simulated fleet."""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from kvroute.agent_apis import Api
from kvroute.bench.live.pd import SOURCES, NoPDMode, vllm_router_pd_args
from kvroute.bench.live.run import (
    DEFAULT_TARGETS,
    VLLM_ROUTER_HASHING,
    Fleet,
    LiveOptions,
    LiveReport,
    SkipTarget,
    Target,
    TargetResult,
    find_vllm_router,
    parse_targets,
    run_live_bench,
    samples_of,
    vllm_router_args,
)
from kvroute.bench.live.smg import every_worker_healthy, find_smg, smg_args
from kvroute.cli import main
from kvroute.processes import FleetPorts, start
from router.config import parse_config

SESSIONS, TURNS = 4, 3  # 4 sessions over 3 instances: round robin moves every session every turn


def _options(
    fleet: FleetPorts,
    tmp_path: Path,
    targets: tuple[str, ...],
    vllm_router: str | None = None,
    smg: str | None = None,
) -> LiveOptions:
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump(fleet.router_config()))
    return LiveOptions(
        config=config,
        targets=targets,
        sessions=SESSIONS,
        turns=TURNS,
        concurrency=SESSIONS,
        time_limit_s=120,
        request_timeout_s=120,
        max_tokens=4,
        system_prompt_words=200,
        vllm_router=vllm_router,
        smg=smg,
        out=tmp_path / "live.json",
        log_dir=tmp_path / "logs",
    )


def _check_counts(report: LiveReport) -> None:
    for result in report.results:
        if result.skipped:
            continue
        assert result.ok + result.failed + result.rejected == result.sent == SESSIONS * TURNS, result
        assert result.ok == result.sent, result.errors
        assert result.ttft_p50_ms is not None and result.ttft_p99_ms is not None
        assert 0 < result.ttft_p50_ms <= result.ttft_p99_ms
        assert result.e2e_p50_ms is not None and result.e2e_p50_ms >= result.ttft_p50_ms
        assert result.requests_per_s > 0 and result.prompt_tokens_per_s > 0
        assert result.prompt_tokens == result.prefix_queries  # the engines counted exactly our prompts
        assert result.local_hit_rate is not None and 0.0 <= result.local_hit_rate <= 1.0
        assert result.pool_hit_rate is None  # the simulated fleet has no pool
        assert sum(result.requests_per_instance.values()) == result.sent
        assert result.caches_reset


def test_kvroute_targets_a_running_router_and_missing_binaries(
    fleet: FleetPorts, router_url: str, tmp_path: Path
) -> None:
    targets = (
        "kvroute:round-robin",
        "kvroute",
        f"given={router_url}",
        "vllm-router:round_robin",
        "smg:random",
    )
    missing = str(tmp_path / "missing")
    report = run_live_bench(_options(fleet, tmp_path, targets, vllm_router=missing, smg=missing))

    by_target = {r.target: r for r in report.results}
    assert list(by_target) == [
        "kvroute:round-robin",
        "kvroute:kvroute",
        "given",
        "vllm-router:round_robin",
        "smg:random",
    ]
    assert "vllm-router is not installed" in by_target["vllm-router:round_robin"].skipped
    assert "smg is not installed" in by_target["smg:random"].skipped
    assert not any(r.skipped for r in report.results[:3]), [r.skipped for r in report.results]
    assert [r.seed for r in report.results] == [1, 2, 3, 4, 5]  # fresh content for every target
    _check_counts(report)
    round_robin, kvroute = by_target["kvroute:round-robin"], by_target["kvroute:kvroute"]
    assert set(round_robin.requests_per_instance.values()) == {SESSIONS * TURNS // 3}
    assert kvroute.local_hit_rate >= round_robin.local_hit_rate  # type: ignore[operator]

    written = json.loads((tmp_path / "live.json").read_text())
    assert written["workload"]["sessions"] == SESSIONS
    assert [t["target"] for t in written["targets"]] == list(by_target)


@pytest.mark.skipif(
    find_vllm_router(None) is None, reason="vllm-router not installed (pip install '.[bench]')"
)
def test_vllm_router_round_robin_and_kv_aware(fleet: FleetPorts, tmp_path: Path) -> None:
    report = run_live_bench(_options(fleet, tmp_path, ("vllm-router:round_robin", "vllm-router:kv_aware")))

    round_robin, kv_aware = report.results
    assert not round_robin.skipped and not kv_aware.skipped, (round_robin.skipped, kv_aware.skipped)
    _check_counts(report)
    assert set(round_robin.requests_per_instance.values()) == {SESSIONS * TURNS // 3}
    lookups = {k: v for k, v in kv_aware.router_metrics.items() if "kv_placement_lookups" in k}
    assert sum(lookups.values()) == kv_aware.sent, (
        lookups
    )  # it looked every request up in its event-fed index
    # ...and found the prefixes the fleet's events announced (the shared system prompt, the earlier turns): a
    # peer whose index stays empty is only load balancing, which would make every comparison with it unfair.
    assert sum(v for k, v in lookups.items() if "result=hit" in k) > 0, lookups


@pytest.mark.skipif(
    find_vllm_router(None) is None, reason="vllm-router not installed (pip install '.[bench]')"
)
def test_vllm_router_kv_aware_variants(fleet: FleetPorts, tmp_path: Path) -> None:
    """Both variants answer every turn and key on the sessions' x-session-id: affinity keeps every later turn
    where the session's first went, and program scheduling admits every session as a program."""
    targets = ("vllm-router:kv_aware+affinity", "vllm-router:kv_aware+programs")
    report = run_live_bench(_options(fleet, tmp_path, targets))

    affinity, programs = report.results
    assert not affinity.skipped and not programs.skipped, (affinity.skipped, programs.skipped)
    _check_counts(report)
    decisions = {k: v for k, v in affinity.router_metrics.items() if "prefix_routing_decisions" in k}
    sticky = sum(v for k, v in decisions.items() if "outcome=sticky_hit" in k)
    assert sticky == affinity.sent - SESSIONS, decisions
    transitions = {k: v for k, v in programs.router_metrics.items() if "agent_aware_transitions" in k}
    admits = ("reason=program_admit", "reason=batch_gain_admit")
    admitted = sum(v for k, v in transitions.items() if any(a in k for a in admits))
    assert admitted >= SESSIONS, transitions  # a session's first turn always is one


@pytest.mark.skipif(find_smg(None) is None, reason="smg not installed (pip install '.[bench]')")
def test_smg_round_robin_and_cache_aware(fleet: FleetPorts, tmp_path: Path) -> None:
    report = run_live_bench(_options(fleet, tmp_path, ("smg:round_robin", "smg:cache_aware")))

    round_robin, cache_aware = report.results
    assert not round_robin.skipped and not cache_aware.skipped, (round_robin.skipped, cache_aware.skipped)
    _check_counts(report)
    assert set(round_robin.requests_per_instance.values()) == {SESSIONS * TURNS // 3}
    assert not round_robin.router_metrics  # its counters of cache_aware's decisions did not move
    branches = {k: v for k, v in cache_aware.router_metrics.items() if "cache_aware_policy_branch" in k}
    assert sum(branches.values()) == cache_aware.sent, branches  # cache_aware chose every request...
    # ...and found the earlier turns of a session in its tree: a later turn's text extends the last one's
    assert branches.get("smg_cache_aware_policy_branch_total{branch=tree_match}", 0) > 0, branches
    assert cache_aware.local_hit_rate > round_robin.local_hit_rate  # type: ignore[operator]


def test_smg_args() -> None:
    config = parse_config(FleetPorts(8101, 5601, 5701, 3).router_config())
    args = smg_args("/venv/bin/smg", "cache_aware", config, 30000, 30001)

    assert args[:2] == ["/venv/bin/smg", "launch"]
    flags = _flags(args[2:])
    assert flags["--worker-urls"] == [
        "http://127.0.0.1:8101",
        "http://127.0.0.1:8102",
        "http://127.0.0.1:8103",
    ]
    assert flags["--policy"] == ["cache_aware"]
    assert flags["--host"] == flags["--prometheus-host"] == ["127.0.0.1"]
    assert (flags["--port"], flags["--prometheus-port"]) == (["30000"], ["30001"])
    # its defaults, which are SGLang's cache_aware: none is overridden
    assert not {"--cache-threshold", "--balance-abs-threshold", "--balance-rel-threshold"} & set(flags)


PROGRAMS_JSON = '{"program_scheduling_enable_key": "auto"}'


@pytest.mark.parametrize(
    ("policy", "tail"),
    [
        ("kv_aware", []),
        ("kv_aware+affinity", ["--kv-aware-session-affinity-ttl-secs", "300"]),
        (
            "kv_aware+programs",
            ["--enable-program-scheduling", "--program-scheduling-config-json", PROGRAMS_JSON],
        ),
    ],
)
def test_vllm_router_args(policy: str, tail: list[str]) -> None:
    raw = FleetPorts(8101, 5601, 5701, 3).router_config()
    args = vllm_router_args("/venv/bin/vllm-router", policy, Fleet(parse_config(raw), raw), 30000, 30001)

    assert _flags(args[1:])["--policy"] == ["kv_aware"]
    assert args.count("--kv-event-source") == 3
    assert args[args.index("--kv-event-model") + 2 :] == tail


def test_vllm_router_variants_need_an_aggregated_fleet() -> None:
    raw = _pd_config()
    with pytest.raises(SkipTarget, match="aggregated fleet only"):
        vllm_router_args("/venv/bin/vllm-router", "kv_aware+affinity", Fleet(parse_config(raw), raw), 1, 2)


def _flags(args: list[str]) -> dict[str, list[str]]:
    flags: dict[str, list[str]] = {}
    for arg in args:
        if arg.startswith("--"):
            flags[arg] = []
            current = flags[arg]
        else:
            current.append(arg)
    return flags


@pytest.fixture
def readiness() -> Iterator[tuple[str, list[tuple[int, bytes]]]]:
    """A server whose every answer is the last (status, body) put in the list it yields with its URL."""
    answers: list[tuple[int, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answers[-1]
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/readiness", answers
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("status", "body", "ready"),
    [
        (200, b'{"status":"ready","healthy_workers":3,"total_workers":3}', True),
        (200, b'{"status":"ready","healthy_workers":2,"total_workers":2}', False),  # one left out at startup
        (200, b'{"status":"ready","healthy_workers":2,"total_workers":3}', False),
        (503, b'{"status":"not ready","reason":"draining"}', False),
        (200, b"OK", False),
    ],
)
def test_every_worker_healthy(
    readiness: tuple[str, list[tuple[int, bytes]]], status: int, body: bytes, ready: bool
) -> None:
    url, answers = readiness
    answers.append((status, body))
    assert every_worker_healthy(3)(url) is ready


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_sessions_over_the_agents_apis(api: Api, fleet: FleetPorts, tmp_path: Path) -> None:
    """Every target answers every turn in the API (vllm-router 0.1.17 and smg 1.13 forward both paths), and
    each turn's prompt tokens, read from the API's own usage, are what the engines counted."""
    peers = (("vllm-router:round_robin", find_vllm_router(None)), ("smg:round_robin", find_smg(None)))
    targets = ("kvroute:round-robin", "kvroute", *(target for target, binary in peers if binary))
    report = run_live_bench(dataclasses.replace(_options(fleet, tmp_path, targets), api=api))

    assert [r.target for r in report.results] == [t if ":" in t else f"{t}:kvroute" for t in targets]
    assert not any(r.skipped for r in report.results), [r.skipped for r in report.results]
    _check_counts(report)
    round_robin, kvroute = report.results[:2]
    assert kvroute.local_hit_rate >= round_robin.local_hit_rate  # type: ignore[operator]
    workload = json.loads((tmp_path / "live.json").read_text())["workload"]
    assert (workload["api"], workload["responses_chain"]) == (api, False)
    assert f"/v1/{api}" in workload["title"]


def test_a_chain_of_stored_responses_needs_their_instance(fleet: FleetPorts, tmp_path: Path) -> None:
    """Chained by previous_response_id, kvroute sends every turn where its response is stored, even under
    round robin; vllm-router's round robin does not, and those turns fail with vLLM's 404."""
    has_binary = find_vllm_router(None) is not None
    targets = ("kvroute:round-robin", *(("vllm-router:round_robin",) if has_binary else ()))
    options = dataclasses.replace(_options(fleet, tmp_path, targets), api="responses", responses_chain=True)
    kvroute, *peers = run_live_bench(options).results

    assert kvroute.ok == kvroute.sent == SESSIONS * TURNS, kvroute.errors
    assert kvroute.prompt_tokens == kvroute.prefix_queries
    for peer in peers:
        assert peer.sent == SESSIONS * TURNS and peer.ok >= SESSIONS  # first turns name no stored response
        assert peer.failed == peer.sent - peer.ok > 0
        assert list(peer.errors) == ["HTTP 404: Response with id 'resp_*' not found."], peer.errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--responses-chain", "--responses-chain needs --api responses"),
        ("--api messages --trace agentic", "--api is the sessions' API; a trace is replayed as completions"),
    ],
)
def test_api_options_refused_before_anything_starts(
    argv: str, message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # main() installs its own handlers
    assert main(["bench", "live", *argv.split()]) == 2
    assert message in capsys.readouterr().err


def test_command_starts_its_own_fleet(tmp_path: Path) -> None:
    out = tmp_path / "live.json"
    args = [
        "bench",
        "live",
        "--fleet",
        "2",
        "--targets",
        "kvroute:round-robin,kvroute",
        "--sessions",
        "2",
        "--turns",
        "2",
        "--max-tokens",
        "4",
        "--time-limit",
        "30",
        "--out",
        str(out),
    ]
    child = start("bench-live", args, tmp_path)
    code = child.wait(180)
    assert code == 0, child.log_tail()
    results = json.loads(out.read_text())["targets"]
    assert [(r["target"], r["sent"], r["ok"]) for r in results] == [
        ("kvroute:round-robin", 4, 4),
        ("kvroute:kvroute", 4, 4),
    ]
    assert "TTFT p50" in child.log_path.read_text()


def test_trace_replay_through_every_default_target(tmp_path: Path) -> None:
    """The small run `make test` keeps: it finishes, and the JSON and plots have everything (not the numbers)."""
    out = tmp_path / "live.json"
    args = [
        "bench",
        "live",
        "--fleet",
        "2",
        "--trace",
        "agentic",
        "--requests",
        "16",
        "--rate",
        "20",
        "--max-tokens",
        "4",
        "--time-limit",
        "30",
        "--out",
        str(out),
    ]
    child = start("bench-live-trace", args, tmp_path)
    code = child.wait(300)
    assert code == 0, child.log_tail()
    written = json.loads(out.read_text())
    workload = written["workload"]
    assert workload["mode"] == "trace" and workload["trace"] == "agentic-0" and workload["requests"] == 16
    assert {
        "rate",
        "sessions",
        "block_tokens",
        "trace_block_tokens",
        "max_tokens",
        "title",
        "fleet_args",
    } <= set(workload)
    # hashed as vllm-router asks of vLLM; scaled: 32 of 512 tokens per hash id
    assert workload["fleet_args"] == [*VLLM_ROUTER_HASHING, "--prefill-tps", "2000"]
    fields = {f.name for f in dataclasses.fields(TargetResult)}
    assert [t["target"] for t in written["targets"]] == [
        t if ":" in t else f"{t}:kvroute" for t in DEFAULT_TARGETS
    ]
    for target in written["targets"]:
        assert set(target) == fields, target["target"]
        if not target["skipped"]:
            assert target["sent"] == 16 and len(target["ttft_ms"]) == target["ok"], target
    skipped = {target["target"]: target["skipped"] for target in written["targets"]}
    assert "prompt is token ids" in skipped["smg:cache_aware"]  # smg 1.13 would answer every one with a 400
    for plot in ("live-ttft.png", "live-hits.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG"), plot


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("kvroute", Target("kvroute:kvroute", "kvroute", "kvroute")),
        ("kvroute:round-robin", Target("kvroute:round-robin", "kvroute", "round-robin")),
        ("vllm-router:kv_aware", Target("vllm-router:kv_aware", "vllm-router", "kv_aware")),
        (
            "vllm-router:kv_aware+programs",
            Target("vllm-router:kv_aware+programs", "vllm-router", "kv_aware+programs"),
        ),
        ("smg:cache_aware", Target("smg:cache_aware", "smg", "cache_aware")),
        ("kvroute-replicas:3", Target("kvroute-replicas:3", "kvroute-replicas", "3")),
        (
            "kvroute-replicas:3+shared",
            Target("kvroute-replicas:3+shared", "kvroute-replicas", "3+shared"),
        ),
        ("stack=http://127.0.0.1:8000/", Target("stack", "url", url="http://127.0.0.1:8000")),
    ],
)
def test_parse_targets(spec: str, expected: Target) -> None:
    assert parse_targets([spec], default_policy="kvroute") == [expected]


@pytest.mark.parametrize("spec", ["vllm-router", "smg", "smg:", "sglang:cache_aware"])
def test_parse_targets_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match="use kvroute"):
        parse_targets([spec], default_policy="kvroute")


@pytest.mark.parametrize(
    "spec", ["vllm-router:round_robin+affinity", "vllm-router:kv_aware+", "vllm-router:kv_aware+sticky"]
)
def test_parse_targets_rejects_variants(spec: str) -> None:
    with pytest.raises(ValueError, match="kv_aware\\+affinity, kv_aware\\+programs"):
        parse_targets([spec], default_policy="kvroute")


@pytest.mark.parametrize("spec", ["kvroute-replicas", "kvroute-replicas:0", "kvroute-replicas:3+gossip"])
def test_parse_targets_rejects_replicas(spec: str) -> None:
    with pytest.raises(ValueError, match="kvroute-replicas:N or kvroute-replicas:N\\+shared"):
        parse_targets([spec], default_policy="kvroute")


def test_disaggregated_fleet_through_kvroute_and_vllm_router_pd(tmp_path: Path) -> None:
    """Every request answered through both legs, and the result says where each prompt was computed."""
    has_binary = find_vllm_router(None) is not None
    targets = ("kvroute", "vllm-router:cache_aware") if has_binary else ("kvroute",)
    options = LiveOptions(
        pd=(2, 2),
        targets=targets,
        sessions=SESSIONS,
        turns=TURNS,
        concurrency=SESSIONS,
        time_limit_s=120,
        request_timeout_s=120,
        max_tokens=4,
        system_prompt_words=200,
        out=tmp_path / "live.json",
        log_dir=tmp_path / "logs",
    )
    report = run_live_bench(options)

    assert report.roles == ["prefill", "prefill", "decode", "decode"]
    assert [r.target for r in report.results] == [t if ":" in t else f"{t}:kvroute" for t in targets]
    for result in report.results:
        assert not result.skipped, result.skipped
        assert result.ok == result.sent == SESSIONS * TURNS, result.errors
        assert result.ttft_p50_ms is not None and result.ttft_p99_ms is not None and result.e2e_p50_ms
        assert set(result.prompt_tokens_by_role) == {"prefill", "decode"}
        assert all(set(tokens) == set(SOURCES) for tokens in result.prompt_tokens_by_role.values())
        # the decode instances see every prompt once, whatever computed it
        assert sum(result.prompt_tokens_by_role["decode"].values()) == result.prompt_tokens
        assert result.pd_paths and sum(result.pd_paths.values()) == result.sent, result.pd_paths
        assert result.pool_hit_rate is None  # decode instances' external hits are fetched, not pooled
    written = json.loads((tmp_path / "live.json").read_text())
    assert written["roles"] == report.roles and written["workload"]["disaggregation"] == "nixl"
    assert "--roles" in written["workload"]["fleet_args"]


def test_mooncake_fleet_skips_vllm_router_and_smg(tmp_path: Path) -> None:
    """vllm-router's MooncakeConnector mode asks the prefill instances' bootstrap servers, which the simulated
    fleet has not; smg runs on an aggregated fleet only."""
    options = LiveOptions(
        pd=(1, 1),
        kv_connector="mooncake",
        targets=("kvroute", "vllm-router:round_robin", "smg:cache_aware"),
        sessions=2,
        turns=2,
        max_tokens=4,
        system_prompt_words=200,
        out=None,
        log_dir=tmp_path / "logs",
    )
    kvroute, vllm_router, smg = run_live_bench(options).results

    assert kvroute.ok == kvroute.sent == 4 and kvroute.pd_paths, kvroute
    assert "/query does not answer" in vllm_router.skipped
    assert "need an aggregated fleet" in smg.skipped


def _pd_config(connector: str = "nixl", block_size: int = 16) -> dict[str, object]:
    instances = [
        {
            "name": "p0",
            "url": "http://127.0.0.1:9001",
            "role": "prefill",
            "events": "tcp://127.0.0.1:5001",
            "kv_engine_id": "p0",
            "kv_bootstrap_url": "http://127.0.0.1:9",
        },
        {"name": "d0", "url": "http://127.0.0.1:9002", "role": "decode"},
        {
            "name": "b0",
            "url": "http://127.0.0.1:9003",
            "role": "both",
            "kv_engine_id": "b0",
            "kv_bootstrap_url": "http://127.0.0.1:9",
        },
    ]
    return {
        "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],
        "block_size": block_size,
        "instances": instances,
        "disaggregation": {"connector": connector},
    }


P0, D0, B0 = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"
PD_HEAD = [
    "--vllm-pd-disaggregation",
    "--kv-connector",
    "nixl",
    "--prefill",
    P0,
    "none",
    "--prefill",
    B0,
    "none",
    "--decode",
    D0,
    "--decode",
    B0,
]


@pytest.mark.parametrize(
    ("policy", "tail"),
    [
        ("cache_aware", ["--policy", "cache_aware"]),  # both stages, as vllm-router's --policy sets them
        ("cache_aware/power_of_two", ["--prefill-policy", "cache_aware", "--decode-policy", "power_of_two"]),
    ],
)
def test_vllm_router_pd_args(policy: str, tail: list[str]) -> None:
    assert vllm_router_pd_args(parse_config(_pd_config()), policy) == PD_HEAD + tail


@pytest.mark.parametrize(
    ("config", "policy", "reason"),
    [
        (_pd_config(block_size=32), "kv_aware", "16-token blocks"),
        (_pd_config(), "kv_aware", "missing: b0"),  # kv_aware reads every prefill instance's events
        (_pd_config("mooncake"), "round_robin", "http://127.0.0.1:9/query does not answer"),
    ],
)
def test_vllm_router_pd_args_refuses(config: dict[str, object], policy: str, reason: str) -> None:
    with pytest.raises(NoPDMode, match=reason):
        vllm_router_pd_args(parse_config(config), policy)


def test_a_metrics_page_with_a_malformed_sample_gives_all_the_others() -> None:
    """vllm-router 0.1.17 with program scheduling exports a sample whose label repeats, which the
    Prometheus parser refuses for the whole page."""
    page = '# TYPE a counter\na_total{x="1"} 3\nb{target="t",quantile="p95",quantile="0"} 2\nc 4\n'
    assert samples_of(page) == [("a_total", {"x": "1"}, 3.0), ("c", {}, 4.0)]
    assert samples_of('# TYPE a counter\na_total{x="1"} 3\n') == [("a_total", {"x": "1"}, 3.0)]
