"""The fixed fast backends ``kvroute bench overhead`` puts behind each router.

nginx answers every POST with one canned chat completion: a C server whose own cost is far below any router's.
The long-prompt case needs a backend that also tokenizes as vLLM does (``/tokenize`` and
``/v1/chat/completions/render``), since vllm-router's ``kv_aware`` asks the workers for token ids; that one is
a small aiohttp server run as ``python -m kvroute.bench.overhead.backend PORT``, one process per port.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from kvroute.processes import Child, spawn, wait_healthy

MODEL = "tiny-llama"
CANNED_COMPLETION = (
    '{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"tiny-llama",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}'
)
_MAX_MODEL_LEN = 1_000_000


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (str(p) for p in (Path("/usr/sbin/nginx"), Path("/usr/local/sbin/nginx")) if p.exists()), None
    )


NGINX_TEMP_KINDS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def nginx_conf_around(work: Path, http: str) -> str:
    """A whole nginx configuration around the http block's own lines: one worker (its cost stays small and
    fixed), in the foreground, no access log, every file and temp path inside work (the temp directories
    made)."""
    for kind in NGINX_TEMP_KINDS:
        (work / kind).mkdir(parents=True, exist_ok=True)
    temp_paths = "\n".join(f"  {kind}_temp_path {work / kind};" for kind in NGINX_TEMP_KINDS)
    return f"""worker_processes 1;
daemon off;
pid {work / "nginx.pid"};
error_log {work / "nginx-error.log"};
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_max_body_size 64m;
{temp_paths}
{http}
}}
"""


def nginx_conf(work: Path, ports: Sequence[int]) -> str:
    """The canned backend: every port answers a completion at once."""
    listens = "\n".join(f"    listen 127.0.0.1:{port};" for port in ports)
    return nginx_conf_around(
        work,
        f"""  server {{
{listens}
    location = /health {{ return 200; }}
    location = /metrics {{ default_type text/plain; return 200 ''; }}
    location / {{
      default_type application/json;
      return 200 '{CANNED_COMPLETION}';
    }}
  }}""",
    )


def start_nginx(binary: str, ports: Sequence[int], log_dir: Path) -> Child:
    work = log_dir / "nginx"
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "nginx.conf"
    conf.write_text(nginx_conf(work, ports))
    # -e: nginx opens its error log before reading the config; the default one may not be writable.
    child = spawn(
        "nginx", [binary, "-p", str(work), "-e", str(work / "nginx-error.log"), "-c", str(conf)], log_dir
    )
    wait_healthy(child, [f"http://127.0.0.1:{port}/health" for port in ports], timeout_s=20)
    return child


def start_render_backends(ports: Sequence[int], log_dir: Path) -> list[Child]:
    """One process per port, so two workers tokenize in parallel as two vLLM servers would."""
    children = [
        spawn(f"backend-{port}", [sys.executable, "-m", "kvroute.bench.overhead.backend", str(port)], log_dir)
        for port in ports
    ]
    try:
        for child, port in zip(children, ports, strict=True):
            wait_healthy(child, [f"http://127.0.0.1:{port}/health"], timeout_s=60)
    except BaseException:
        for child in children:
            child.stop()
        raise
    return children


class _ChatBody(msgspec.Struct):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


def build_app() -> web.Application:
    """Canned completions like nginx; /tokenize and render tokenize exactly as the simulated fleet does."""
    from router.prompt.tokenization import PromptTokenizer, resolve_tokenizer_path

    tokenizer = PromptTokenizer(resolve_tokenizer_path("builtin:tiny-llama"))
    decode = msgspec.json.Decoder(_ChatBody).decode
    encode = msgspec.json.Encoder().encode

    def token_ids(raw: bytes) -> list[int]:
        body = decode(raw)
        return tokenizer.chat_ids(
            body.messages, body.add_generation_prompt, body.continue_final_message, body.add_special_tokens
        )

    async def completion(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text=CANNED_COMPLETION, content_type="application/json")

    async def tokenize(request: web.Request) -> web.Response:
        ids = token_ids(await request.read())
        body = {"count": len(ids), "max_model_len": _MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
        return web.Response(body=encode(body), content_type="application/json")

    async def render(request: web.Request) -> web.Response:
        ids = token_ids(await request.read())
        body = {"request_id": "render-1", "model": MODEL, "token_ids": ids, "prompt_token_ids": ids}
        return web.Response(body=encode(body), content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_post("/v1/chat/completions/render", render)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a canned-completion backend that also tokenizes")
    parser.add_argument("port", type=int)
    args = parser.parse_args(argv)
    web.run_app(build_app(), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
