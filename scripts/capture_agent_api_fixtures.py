"""Capture how a real vLLM answers the agents' APIs: the Responses API and the Anthropic Messages API.

Talks to a vLLM 0.32 that is already running, started with the store and the flags the simulated fleet
mirrors (the model served as tiny-llama, 32-token blocks):

    VLLM_ENABLE_RESPONSES_API_STORE=1 python -m vllm.entrypoints.openai.api_server --model MODEL_DIR \\
        --served-model-name tiny-llama --host 127.0.0.1 --port PORT --max-model-len 4096 --block-size 32 \\
        --enable-prefix-caching --enable-prompt-tokens-details --enable-auto-tool-choice \\
        --tool-call-parser hermes

Sends a fixed script of requests (bodies, event streams, the store's follow-ups, retrieval, cancellation,
background runs and errors) and writes, per request, its name, method, path, body, status, content type and
answer (JSON, or the SSE text), to tests/fixtures/vllm/agent_api_capture.json:

    .venv/bin/python scripts/capture_agent_api_fixtures.py http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "vllm" / "agent_api_capture.json"
MODEL = "tiny-llama"
WORDS = (
    "cache router block prefix token request worker queue latency batch engine tensor shard replica "
    "session agent tool result error retry budget schedule memory page evict hash chain parent child"
).split()
TOOL = {
    "type": "function",
    "name": "read_file",
    "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
ANTHROPIC_TOOL = {
    "name": "read_file",
    "description": "Read a file of the repository.",
    "input_schema": TOOL["parameters"],
}


def log(msg: str) -> None:
    print(f"[capture] {msg}", file=sys.stderr, flush=True)


def words(rng: random.Random, count: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(count))


def call(
    base: str,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    ctype: str = "application/json",
) -> dict[str, Any]:
    """status, content_type and answer: JSON, or the text of anything else (an event stream); broken: an
    answer cut off before its end."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"content-type": ctype} if data is not None else {}
    request = urllib.request.Request(base + path, data, headers, method=method)
    broken = False
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, ctype = response.status, response.headers.get("content-type", "")
            try:
                payload = response.read()
            except http.client.IncompleteRead as cut:
                payload, broken = cut.partial, True
    except urllib.error.HTTPError as error:
        status, ctype, payload = error.code, error.headers.get("content-type", ""), error.read()
    answer: Any = payload.decode("utf-8", "replace")
    if ctype.startswith("application/json"):
        answer = json.loads(payload)
    return {"status": status, "content_type": ctype, "answer": answer} | ({"broken": True} if broken else {})


class Script:
    def __init__(self, base: str) -> None:
        self.base = base
        self.records: list[dict[str, Any]] = []

    def send(
        self,
        name: str,
        method: str,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        ctype: str = "application/json",
    ) -> Any:
        record: dict[str, Any] = {"name": name, "method": method, "path": path}
        if body is not None:
            record["request"] = body
        if raw is not None:
            record["raw_request"] = raw.decode()
            record["request_content_type"] = ctype
        record |= call(self.base, method, path, body, raw, ctype)
        self.records.append(record)
        log(f"{name}: {record['status']}")
        return record["answer"]

    def wait_done(self, name: str, response_id: str) -> None:
        """Polls a background response until it leaves queued/in_progress; records the last answer."""
        for _ in range(600):
            answer = call(self.base, "GET", f"/v1/responses/{response_id}")["answer"]
            if answer.get("status") not in ("queued", "in_progress"):
                break
            time.sleep(0.1)
        self.send(name, "GET", f"/v1/responses/{response_id}")


def codex_like(prompt: str) -> dict[str, Any]:
    """What Codex CLI sends: developer and user items with ids, a call and its output, namespace and
    web_search tools, reasoning, store off, a stream, fields vLLM ignores."""
    namespace = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [TOOL]}
    return {
        "model": MODEL,
        "instructions": "",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "id": "msg_1",
                "content": [{"type": "input_text", "text": "Be terse."}],
            },
            {
                "type": "message",
                "role": "user",
                "id": "msg_2",
                "content": [{"type": "input_text", "text": prompt}],
            },
            {
                "type": "function_call",
                "status": "completed",
                "id": "fc_1",
                "name": "read_file",
                "arguments": '{"path": "README.md"}',
                "call_id": "call_1",
            },
            {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "# kvroute\n"},
        ],
        "tools": [TOOL, namespace, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1",
        "client_metadata": {"x": "y"},
        "max_output_tokens": 4,
    }


def responses_script(script: Script, rng: random.Random) -> None:
    # ~90 prompt tokens, so a repeat finds two full blocks cached
    prompt = words(rng, 30)
    base = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    script.send("responses", "POST", "/v1/responses", {**base, "input": prompt, "request_id": "resp_cap_a"})
    script.send("responses_again", "POST", "/v1/responses", {**base, "input": prompt})
    stream = {**base, "input": prompt, "stream": True, "request_id": "resp_cap_s"}
    script.send("responses_stream", "POST", "/v1/responses", stream)
    follow = {**base, "input": "and then?", "previous_response_id": "resp_cap_a", "request_id": "resp_cap_b"}
    script.send("responses_followup", "POST", "/v1/responses", follow)
    follow_stream = {**base, "input": "and then?", "previous_response_id": "resp_cap_s", "stream": True}
    script.send("responses_followup_stream", "POST", "/v1/responses", follow_stream)
    chain = {**base, "input": "why?", "previous_response_id": "resp_cap_b"}
    script.send("responses_followup_chain", "POST", "/v1/responses", chain)
    items = [
        {"type": "message", "role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]},
    ]
    with_tools = {**base, "input": items, "instructions": "You are a coding agent.", "tools": [TOOL]}
    script.send("responses_tools", "POST", "/v1/responses", with_tools)
    script.send("responses_codex_like", "POST", "/v1/responses", codex_like(prompt))
    stored_off = {**base, "input": prompt, "store": False, "request_id": "resp_cap_unstored"}
    script.send("responses_store_false", "POST", "/v1/responses", stored_off)
    script.send("retrieve", "GET", "/v1/responses/resp_cap_a")
    script.send("retrieve_stream_not_background", "GET", "/v1/responses/resp_cap_a?stream=true")
    script.send("retrieve_unstored", "GET", "/v1/responses/resp_cap_unstored")
    script.send("retrieve_unknown", "GET", "/v1/responses/resp_nope")
    script.send("cancel_finished", "POST", "/v1/responses/resp_cap_a/cancel")
    script.send("cancel_unknown", "POST", "/v1/responses/resp_nope/cancel")
    unknown_prev = {**base, "input": "x", "previous_response_id": "resp_nope"}
    script.send("error_previous_unknown", "POST", "/v1/responses", unknown_prev)
    script.send("error_unknown_model", "POST", "/v1/responses", {**base, "model": "nope", "input": "x"})
    script.send("error_missing_input", "POST", "/v1/responses", {"model": MODEL})
    no_store = {**base, "input": "x", "background": True, "store": False}
    script.send("error_background_store_false", "POST", "/v1/responses", no_store)
    script.send("error_empty_input", "POST", "/v1/responses", {**base, "input": []})
    script.send(
        "error_max_output_tokens", "POST", "/v1/responses", {**base, "input": "x", "max_output_tokens": 5000}
    )
    required = {**base, "input": "x", "tool_choice": "required"}
    script.send("error_required_tool_choice", "POST", "/v1/responses", required)
    text_body = json.dumps({**base, "input": "x"}).encode()
    script.send("error_content_type", "POST", "/v1/responses", raw=text_body, ctype="text/plain")
    script.send("retrieve_bad_query", "GET", "/v1/responses/resp_cap_a?starting_after=x")
    too_long = {**base, "input": words(rng, 1600)}
    script.send("error_prompt_too_long", "POST", "/v1/responses", too_long)
    background = {**base, "input": prompt, "background": True, "request_id": "resp_cap_bg"}
    script.send("background", "POST", "/v1/responses", {**background, "max_output_tokens": 8})
    script.wait_done("background_retrieve", "resp_cap_bg")
    bg_stream = {**background, "stream": True, "request_id": "resp_cap_bgs"}
    script.send("background_stream", "POST", "/v1/responses", bg_stream)
    script.send("background_stream_resume", "GET", "/v1/responses/resp_cap_bgs?stream=true&starting_after=3")
    script.send("background_retrieve_stream_done", "GET", "/v1/responses/resp_cap_bgs")
    long_run = {**background, "request_id": "resp_cap_cancel", "max_output_tokens": 3000, "ignore_eos": True}
    script.send("background_long", "POST", "/v1/responses", long_run)
    script.send("cancel_background", "POST", "/v1/responses/resp_cap_cancel/cancel")
    script.send("retrieve_cancelled", "GET", "/v1/responses/resp_cap_cancel")
    script.send("cancel_cancelled", "POST", "/v1/responses/resp_cap_cancel/cancel")


def messages_script(script: Script, rng: random.Random) -> None:
    prompt = words(rng, 30)
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        "system": "You are a careful coding agent.",
        "messages": [{"role": "user", "content": prompt}],
    }
    script.send("messages", "POST", "/v1/messages", body)
    script.send("messages_again", "POST", "/v1/messages", body)
    script.send("messages_stream", "POST", "/v1/messages", {**body, "stream": True})
    blocks = {
        **body,
        "system": [
            {"type": "text", "text": "You are a careful coding agent.", "cache_control": {"type": "x"}}
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "tools": [ANTHROPIC_TOOL],
    }
    script.send("messages_tools", "POST", "/v1/messages?beta=true", blocks)
    script.send("messages_tools_stream", "POST", "/v1/messages?beta=true", {**blocks, "stream": True})
    turns = [
        *blocks["messages"],
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "README.md"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "# kvroute"},
                {"type": "text", "text": "Go on."},
            ],
        },
    ]
    script.send("messages_conversation", "POST", "/v1/messages", {**blocks, "messages": turns})
    count = {k: v for k, v in blocks.items() if k in ("model", "system", "messages", "tools")}
    script.send("count_tokens", "POST", "/v1/messages/count_tokens", count)
    plain_count = {k: v for k, v in body.items() if k in ("model", "system", "messages")}
    script.send("count_tokens_plain", "POST", "/v1/messages/count_tokens", plain_count)
    script.send("messages_error_unknown_model", "POST", "/v1/messages", {**body, "model": "nope"})
    no_max = {k: v for k, v in body.items() if k != "max_tokens"}
    script.send("messages_error_missing_max_tokens", "POST", "/v1/messages", no_max)
    script.send("messages_error_bad_json", "POST", "/v1/messages", raw=b"{not json")
    script.send(
        "count_tokens_error_unknown_model", "POST", "/v1/messages/count_tokens", {**count, "model": "nope"}
    )
    too_long = {**body, "messages": [{"role": "user", "content": words(rng, 1600)}]}
    script.send("messages_error_prompt_too_long", "POST", "/v1/messages", too_long)


def routes_script(script: Script) -> None:
    script.send("route_unknown", "GET", "/v1/nope")
    script.send("route_unknown_post", "POST", "/v1/responses/x/y/z", {})
    script.send("route_wrong_method_messages", "GET", "/v1/messages")
    script.send("route_wrong_method_responses", "GET", "/v1/responses")
    script.send("route_wrong_method_cancel", "GET", "/v1/responses/resp_cap_a/cancel")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url", help="the running vLLM's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=41)
    args = ap.parse_args()
    base = args.url.rstrip("/")
    script, rng = Script(base), random.Random(args.seed)
    version = call(base, "GET", "/version")["answer"]
    responses_script(script, rng)
    messages_script(script, rng)
    routes_script(script)
    capture = {
        "vllm_version": version.get("version") if isinstance(version, dict) else version,
        "model": MODEL,
        "block_size": 32,
        "max_model_len": 4096,
        "flags": [
            "VLLM_ENABLE_RESPONSES_API_STORE=1",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enable-auto-tool-choice",
            "--tool-call-parser hermes",
        ],
        "requests": script.records,
    }
    args.out.write_text(json.dumps(capture, indent=1, ensure_ascii=False) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
