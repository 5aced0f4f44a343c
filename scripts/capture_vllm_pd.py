"""Capture real vLLM's prefill/decode disaggregation with MooncakeConnector: both legs' bodies as kvroute
sends them, straight to the instances.

Starts one prefill (kv_producer) and one decode (kv_consumer) vLLM from configs/stack-pd-cpu.yaml with the
stack's own code (kvroute.stack.run.StackPlan: flags, kv_transfer_config, PYTHONPATH with kvconnectors/), less
the pool and the router, on free ports, each in its own process group. For a chat and a completion, whole and
streamed, it sends the prefill leg (router.dispatch.place.prefill_leg.prefill_body) to the prefiller and the
decode leg to the decoder, recording bodies, statuses, answers (the streamed decode leg's SSE events) and how
each instance's prompt-token counters moved. Then a decode leg naming a transfer nobody prefilled, twice: once
bounded by --unknown-timeout (vLLM's own wait is the prefiller's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT), once
waited out past the prefiller's --abort-timeout. Stops exactly the processes it started and writes:

    <out>/pd_capture.json   vLLM version, commands, env, kv_transfer_config, and per leg: instance, body,
                            status, answer, seconds, counter increases by instance

    .venv/bin/python scripts/capture_vllm_pd.py          # 5-6 minutes on 2 shared cores
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from capture_vllm_fixtures import log, vllm_version  # noqa: E402

from kvroute.processes import Child, free_port_block, spawn, wait_all_healthy  # noqa: E402
from kvroute.stack.config import SIDE_CHANNEL_ENV, StackConfig, parse_stack_config  # noqa: E402
from kvroute.stack.run import StackPlan  # noqa: E402
from router.config import read_yaml  # noqa: E402
from router.dispatch.place.prefill_leg import prefill_body  # noqa: E402

CONFIG = REPO / "configs" / "stack-pd-cpu.yaml"
MODEL = "tiny-llama"
ABORT_ENV = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"
# Where each instance's prompt tokens came from, and what finished, summed over engines.
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_by_source_total",
    "vllm:prompt_tokens_cached_by_source_total",
    "vllm:request_success_total",
)
WORDS = "cache router block prefix token request worker queue latency batch engine replica session".split()
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


def stack_config(abort_timeout_s: int) -> StackConfig:
    """stack-pd-cpu.yaml as one prefill and one decode instance with MooncakeConnector alone, failed loads
    recomputed, the prefiller giving up on a transfer nobody prefilled after abort_timeout_s."""
    raw = read_yaml(CONFIG)
    raw.pop("pool")
    raw["vllm"]["instances"] = 2
    raw["vllm"]["per_instance"] = [
        {"role": "prefill", "env": {ABORT_ENV: str(abort_timeout_s)}},
        {"role": "decode"},
    ]
    raw["disaggregation"]["transfer"]["kv_load_failure_policy"] = "recompute"
    config = parse_stack_config(raw, source=f"{CONFIG} (1 prefill + 1 decode, no pool)")
    return config.with_ports(free_port_block(config.port_count()))


def text(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(words))


def client_bodies(rng: random.Random) -> dict[str, tuple[str, dict[str, Any]]]:
    """What a client sends kvroute, by case: path and body. Prompts of ~600 tokens, each its own."""
    bodies: dict[str, tuple[str, dict[str, Any]]] = {}
    for stream in (False, True):
        suffix = "_stream" if stream else ""
        base, extra = {"model": MODEL, "max_tokens": 8, "temperature": 0}, STREAM if stream else {}
        messages = [{"role": "user", "content": text(rng, 100)}]
        bodies["chat" + suffix] = ("/v1/chat/completions", {**base, "messages": messages, **extra})
        bodies["completion" + suffix] = ("/v1/completions", {**base, "prompt": text(rng, 100), **extra})
    return bodies


def post(url: str, body: Any, timeout_s: float) -> dict[str, Any]:
    """status, content_type, answer (JSON, or SSE text) and seconds; status None when timeout_s passed."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, ctype, raw = response.status, response.headers.get("content-type", ""), response.read()
    except urllib.error.HTTPError as error:
        status, ctype, raw = error.code, error.headers.get("content-type", ""), error.read()
    except (TimeoutError, urllib.error.URLError) as error:
        reason = getattr(error, "reason", error)
        if not isinstance(reason, TimeoutError):
            raise
        return {"status": None, "timed_out": True, "seconds": round(time.monotonic() - started, 1)}
    seconds = round(time.monotonic() - started, 2)
    answer: Any = raw.decode()
    if "event-stream" not in ctype:
        try:
            answer = json.loads(raw)
        except ValueError:
            pass
    key = "sse" if "event-stream" in ctype else "response"
    return {"status": status, "content_type": ctype, key: answer, "seconds": seconds}


def counters(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        families = text_string_to_metric_families(response.read().decode())
    found: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name in COUNTERS:
                label = sample.labels.get("source") or sample.labels.get("finished_reason")
                key = f"{sample.name}{{{label}}}" if label else sample.name
                found[key] = found.get(key, 0.0) + sample.value
    return found


def settled(base: str, quiet_s: float = 1.0, timeout_s: float = 20.0) -> dict[str, float]:
    """counters once two reads quiet_s apart agree (they land shortly after the answer)."""
    deadline = time.monotonic() + timeout_s
    last = counters(base)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = counters(base)
        if now == last:
            return now
        last = now
    return last


class Capture:
    def __init__(self, plan: StackPlan) -> None:
        self.plan = plan
        self.prefill, self.decode = plan.instances
        assert plan.config.disaggregation is not None
        self.bootstrap = f"http://{plan.config.host}:{plan.config.disaggregation.side_channel_port}"
        self.records: list[dict[str, Any]] = []

    def send(
        self, name: str, leg: str, path: str, body: dict[str, Any], timeout_s: float = 180
    ) -> dict[str, Any]:
        instance = self.prefill if leg == "prefill" else self.decode
        before = {i.name: settled(i.url) for i in self.plan.instances}
        record: dict[str, Any] = {
            "name": name,
            "leg": leg,
            "instance": instance.name,
            "path": path,
            "request": body,
        }
        record |= post(instance.url + path, body, timeout_s)
        after = {i.name: settled(i.url) for i in self.plan.instances}
        record["increase"] = {
            n: {
                k: after[n].get(k, 0.0) - before[n].get(k, 0.0)
                for k in sorted(after[n])
                if after[n].get(k, 0.0) != before[n].get(k, 0.0) or "by_source" in k
            }
            for n in after
        }
        self.records.append(record)
        log(f"{name} ({leg}): {record['status']} in {record['seconds']} s")
        return record

    def decode_params(self, transfer_id: str) -> dict[str, Any]:
        """router.dispatch.place.prefill_leg.mooncake_params for the prefill instance."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_engine_id": self.prefill.name,
            "remote_bootstrap_addr": self.bootstrap,
        }

    def disaggregated(self, name: str, path: str, body: dict[str, Any]) -> None:
        transfer_id = uuid.uuid4().hex
        leg = json.loads(prefill_body(body, "mooncake", transfer_id))
        self.send(name + ".prefill", "prefill", path, leg)
        self.send(
            name + ".decode", "decode", path, {**body, "kv_transfer_params": self.decode_params(transfer_id)}
        )

    def unknown_transfer(self, name: str, path: str, body: dict[str, Any], timeout_s: float) -> None:
        params = self.decode_params("never-prefilled-" + uuid.uuid4().hex[:8])
        self.send(name, "decode", path, {**body, "kv_transfer_params": params}, timeout_s)


def start(plan: StackPlan, timeout_s: float) -> list[Child]:
    plan.check_ready_to_start()
    plan.write_files()  # the instances' PYTHONPATH copy of kvconnectors/
    children: list[Child] = []
    try:
        for index, instance in enumerate(plan.instances):
            children.append(
                spawn(
                    instance.name,
                    plan.vllm_argv(index),
                    plan.run_dir / "logs",
                    env=plan.vllm_env(index),
                    cwd=plan.run_dir,
                )
            )
            log(f"{instance.name} ({instance.role}) pid {children[-1].process.pid}, {instance.url}")
        started = time.monotonic()
        wait_all_healthy(
            [(c, i.url + "/health") for c, i in zip(children, plan.instances, strict=True)], timeout_s
        )
        log(f"both healthy after {time.monotonic() - started:.0f} s")
    except BaseException:
        stop(children)
        raise
    return children


def stop(children: list[Child]) -> None:
    for child in reversed(children):
        child.stop(30.0)


def run(args: argparse.Namespace) -> None:
    config = stack_config(args.abort_timeout)
    run_dir = Path(tempfile.mkdtemp(prefix="vllm-capture-pd-"))
    plan = StackPlan(config, run_dir, base_dir=REPO)
    capture = Capture(plan)
    bodies = client_bodies(random.Random(args.seed))
    rng = random.Random(args.seed + 1)
    children = start(plan, args.startup_timeout)
    try:
        for name, (path, body) in bodies.items():
            capture.disaggregated(name, path, body)
        unknown = {
            "model": MODEL,
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": text(rng, 100)}],
        }
        capture.unknown_transfer(
            "unknown_transfer.bounded", "/v1/chat/completions", unknown, args.unknown_timeout
        )
        unknown = {**unknown, "messages": [{"role": "user", "content": text(rng, 100)}]}
        capture.unknown_transfer(
            "unknown_transfer.waited", "/v1/chat/completions", unknown, args.abort_timeout + 120
        )
        path, chat = bodies["chat"]  # does the decoder still take transfers?
        fresh = [{"role": "user", "content": text(rng, 100)}]
        capture.disaggregated("chat_after_unknown", path, {**chat, "messages": fresh})
        version = vllm_version(str(plan.python))
    finally:
        stop(children)
        log(f"stopped; logs kept in {run_dir / 'logs'}")
    write(args.out, plan, version, args, capture.records)


def write(
    out: Path, plan: StackPlan, version: str, args: argparse.Namespace, records: list[dict[str, Any]]
) -> None:
    config = plan.config
    assert config.disaggregation is not None
    side_channel = SIDE_CHANNEL_ENV[config.disaggregation.connector]
    instances = []
    for index, instance in enumerate(plan.instances):
        env = {
            **config.vllm.env,
            **config.vllm.instance(index).env,
            side_channel: str(config.disaggregation.side_channel_port + index),
            "PYTHONPATH": "RUN_DIR/pythonpath (a copy of kvconnectors/)",
        }
        instances.append(
            {
                "name": instance.name,
                "role": instance.role,
                "url": instance.url,
                "command": ["VLLM_PYTHON", *plan.vllm_argv(index)[1:]],
                "env": env,
                "kv_transfer_config": plan.kv_transfer_config(index),
            }
        )
    capture = {
        "vllm_version": version,
        "config": str(CONFIG.relative_to(REPO)) + " less pool and router, 1 prefill + 1 decode",
        "abort_timeout_s": args.abort_timeout,
        "unknown_timeout_s": args.unknown_timeout,
        "instances": instances,
        "requests": records,
    }
    text = json.dumps(capture, indent=1).replace(str(plan.model_dir), "MODEL_DIR")
    out.mkdir(parents=True, exist_ok=True)
    (out / "pd_capture.json").write_text(text + "\n")
    log(f"wrote {out / 'pd_capture.json'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "vllm")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument(
        "--abort-timeout", type=int, default=90, help=f"the prefiller's {ABORT_ENV} (vLLM's default: 480 s)"
    )
    ap.add_argument(
        "--unknown-timeout",
        type=float,
        default=60,
        help="how long the first decode leg of an unknown transfer is waited for",
    )
    run(ap.parse_args())


if __name__ == "__main__":
    main()
