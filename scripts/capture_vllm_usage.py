"""Capture what real vLLM's usage says of cached prompt tokens with --enable-prompt-tokens-details.

Starts one vLLM from configs/stack-cpu.yaml with the stack's own code (kvroute.stack.run.StackPlan), less the
pool and the router, with --enable-prompt-tokens-details, on free ports in its own process group. For a chat
and a completion, whole and streamed (stream_options.include_usage), it sends a prompt, then the same prompt
extended (its prefix cached), then the first again, each with how the instance's prefix-cache counters moved.
Stops exactly the process it started and writes:

    <out>/prompt_tokens_details_capture.json   vLLM version, command, env, block size, and per request: name,
                                               path, body, status, answer (the SSE text when streamed),
                                               counter increases

    .venv/bin/python scripts/capture_vllm_usage.py      # 2-3 minutes on 2 shared cores
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from capture_vllm_fixtures import log, vllm_version  # noqa: E402
from capture_vllm_pd import MODEL, STREAM, post, settled, start, stop, text  # noqa: E402

from kvroute.processes import free_port_block  # noqa: E402
from kvroute.stack.config import StackConfig, parse_stack_config  # noqa: E402
from kvroute.stack.run import StackPlan  # noqa: E402
from router.config import read_yaml  # noqa: E402

CONFIG = REPO / "configs" / "stack-cpu.yaml"
FLAG = "--enable-prompt-tokens-details"
OUT_NAME = "prompt_tokens_details_capture.json"


def stack_config() -> StackConfig:
    """stack-cpu.yaml as one instance, no pool, with the flag."""
    raw = read_yaml(CONFIG)
    raw.pop("pool")
    raw["vllm"]["instances"] = 1
    if FLAG not in raw["vllm"]["args"]:
        raw["vllm"]["args"].append(FLAG)
    config = parse_stack_config(raw, source=f"{CONFIG} (1 instance, no pool, {FLAG})")
    return config.with_ports(free_port_block(config.port_count()))


def cases(rng: random.Random) -> list[tuple[str, str, dict[str, Any]]]:
    """name, path, body: per endpoint and mode a prompt, the prompt extended, the prompt again."""
    found: list[tuple[str, str, dict[str, Any]]] = []
    for chat in (True, False):
        for stream in (False, True):
            name = ("chat" if chat else "completion") + ("_stream" if stream else "")
            base = {"model": MODEL, "max_tokens": 4, "temperature": 0, **(STREAM if stream else {})}
            first, more = text(rng, 60), text(rng, 30)
            for step, prompt in (("first", first), ("extended", first + " " + more), ("again", first)):
                if chat:
                    body = {**base, "messages": [{"role": "user", "content": prompt}]}
                    found.append((f"{name}.{step}", "/v1/chat/completions", body))
                else:
                    found.append((f"{name}.{step}", "/v1/completions", {**base, "prompt": prompt}))
    return found


def run(args: argparse.Namespace) -> None:
    config = stack_config()
    run_dir = Path(tempfile.mkdtemp(prefix="vllm-capture-usage-"))
    plan = StackPlan(config, run_dir, base_dir=REPO)
    (instance,) = plan.instances
    records: list[dict[str, Any]] = []
    children = start(plan, args.startup_timeout)
    try:
        for name, path, body in cases(random.Random(args.seed)):
            before = settled(instance.url)
            record: dict[str, Any] = {"name": name, "path": path, "request": body}
            record |= post(instance.url + path, body, 120)
            after = settled(instance.url)
            record["increase"] = {
                k: after[k] - before.get(k, 0.0) for k in sorted(after) if after[k] != before.get(k, 0.0)
            }
            records.append(record)
            log(f"{name}: {record['status']} in {record['seconds']} s")
        version = vllm_version(str(plan.python))
    finally:
        stop(children)
        log(f"stopped; logs kept in {run_dir / 'logs'}")
    capture = {
        "vllm_version": version,
        "config": str(CONFIG.relative_to(REPO)) + f" less pool and router, 1 instance, {FLAG}",
        "block_size": config.block_size,
        "command": ["VLLM_PYTHON", *plan.vllm_argv(0)[1:]],
        "env": dict(config.vllm.env),
        "requests": records,
    }
    out = json.dumps(capture, indent=1).replace(str(plan.model_dir), "MODEL_DIR")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / OUT_NAME).write_text(out + "\n")
    log(f"wrote {args.out / OUT_NAME}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "vllm")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--startup-timeout", type=float, default=600)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
