"""Capture the exact prompt token ids real vLLM renders for Responses API requests (non-harmony path).

Talks to a vLLM 0.32 that is already running with the store and the scale-out endpoints, e.g.

    VLLM_ENABLE_RESPONSES_API_STORE=1 python -m vllm.entrypoints.openai.api_server --model MODEL_DIR \\
        --served-model-name tiny --host 127.0.0.1 --port PORT --max-model-len 8192 --block-size 32 \\
        --enable-prefix-caching --enable-scale-out

Single requests go to ``POST /v1/responses/render``, which answers the prompt's ``token_ids``; requests vLLM
refuses are kept with their status. ``previous_response_id`` chains (render refuses those) are created
with ``store`` and ``enable_response_messages``, whose ``input_messages`` hold the prompt's ids; each turn
keeps the ``output`` it answered, which the next turn's prompt is built from. Writes
tests/fixtures/vllm/responses_render_capture.json; tests/router/apis/responses/test_chat.py checks
router/apis/responses/chat.py against every case, token for token:

    .venv/bin/python scripts/capture_responses_renders.py --url http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "vllm" / "responses_render_capture.json"
PARAMETERS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
READ = {"type": "function", "name": "read_file", "description": "Read a file.", "parameters": PARAMETERS}
SHELL = {
    "type": "function",
    "name": "shell",
    "parameters": {"type": "object", "properties": {}},
    "strict": False,
}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.", "format": {"type": "text"}}
AGENTS = {
    "type": "namespace",
    "name": "agents",
    "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn", "description": "Start one.", "parameters": PARAMETERS},
        {"type": "custom", "name": "note"},
        {"type": "function", "name": "close", "defer_loading": True},
    ],
}
WEB = {"type": "web_search", "external_web_access": False}


def user(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **extra}


def said(*texts: str, status: str = "completed") -> dict[str, Any]:
    """An assistant output message as a client echoes it back."""
    parts = [{"type": "output_text", "text": text, "annotations": []} for text in texts]
    return {"type": "message", "role": "assistant", "status": status, "id": "msg_a1", "content": parts}


def call(call_id: str, name: str, arguments: str, **extra: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, **extra}


def result(call_id: str, output: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def reasoning(content: str | None = None, summary: str | None = None, **extra: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "reasoning", "summary": []}
    if summary is not None:
        item["summary"] = [{"type": "summary_text", "text": summary}]
    if content is not None:
        item["content"] = [{"type": "reasoning_text", "text": content}]
    return item | extra


def rendered_cases() -> list[tuple[str, dict[str, Any]]]:
    """name, body (less the model) of each request sent to /v1/responses/render."""
    ask = user("Which file holds the router?")
    return [
        ("string_input", {"input": "hello there"}),
        ("empty_string_input", {"input": ""}),
        ("instructions", {"instructions": "Be brief.", "input": "hello"}),
        ("empty_instructions", {"instructions": "", "input": "hello"}),
        (
            "developer_and_system",
            {
                "instructions": "Top.",
                "input": [
                    {"role": "system", "content": "sys"},
                    {"role": "developer", "content": "dev note"},
                    ask,
                ],
            },
        ),
        (
            "input_text_parts",
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "p1"},
                            {"type": "input_text", "text": "p2"},
                            {"type": "input_text", "text": "p3"},
                        ],
                    }
                ]
            },
        ),
        (
            "assistant_easy_message",
            {"input": [ask, {"role": "assistant", "content": "router.py"}, user("ok")]},
        ),
        (
            "assistant_input_text_parts",
            {
                "input": [
                    ask,
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "input_text", "text": "a1"},
                            {"type": "input_text", "text": "a2"},
                        ],
                    },
                    user("ok"),
                ]
            },
        ),
        ("assistant_output_message_parts", {"input": [ask, said("o1", "o2"), user("and?")]}),
        ("assistant_incomplete_continues", {"input": [ask, said("par", status="incomplete")]}),
        (
            "assistant_easy_in_progress_continues",
            {
                "input": [
                    ask,
                    {"type": "message", "role": "assistant", "content": "half", "status": "in_progress"},
                ]
            },
        ),
        (
            "assistant_string_with_id",
            {
                "input": [
                    ask,
                    {"type": "message", "role": "assistant", "id": "msg_1", "content": "it is"},
                    user("ok"),
                ]
            },
        ),
        ("assistant_completed_last", {"input": [ask, said("done")]}),
        ("user_incomplete_continues", {"input": [user("unfinished", status="incomplete")]}),
        (
            "function_call_and_output",
            {
                "tools": [READ],
                "input": [ask, call("call_1", "read_file", '{"path": "a.py"}'), result("call_1", "print(1)")],
            },
        ),
        (
            "parallel_calls",
            {
                "tools": [READ, SHELL],
                "input": [
                    ask,
                    call("call_1", "read_file", '{"path":"a.py"}', id="fc_1", status="completed"),
                    call("call_2", "shell", '{"cmd": "ls", "n": [1, 2]}'),
                    result("call_1", "one"),
                    result(
                        "call_2", [{"type": "input_text", "text": "x"}, {"type": "input_text", "text": "y"}]
                    ),
                    user("next"),
                ],
            },
        ),
        (
            "call_arguments_not_json",
            {
                "tools": [SHELL],
                "input": [
                    ask,
                    call("c1", "shell", "not json"),
                    result("c1", "r1"),
                    call("c2", "shell", ""),
                    result("c2", "r2"),
                    call("c3", "shell", "[1]"),
                    result("c3", "r3"),
                ],
            },
        ),
        (
            "message_then_call",
            {
                "tools": [READ],
                "input": [ask, said("Looking."), call("call_1", "read_file", "{}"), result("call_1", "")],
            },
        ),
        (
            "namespace_call",
            {
                "tools": [AGENTS],
                "input": [
                    ask,
                    call("call_9", "spawn", '{"path":"x"}', namespace="agents"),
                    result("call_9", "started"),
                ],
            },
        ),
        (
            "custom_tool_call",
            {
                "tools": [PATCH],
                "input": [
                    ask,
                    {
                        "type": "custom_tool_call",
                        "call_id": "ct_1",
                        "name": "apply_patch",
                        "input": "*** héllo ✓\n",
                    },
                    {"type": "custom_tool_call_output", "call_id": "ct_1", "output": "applied"},
                ],
            },
        ),
        (
            "tool_output_without_call_id",
            {"input": [ask, call("c1", "shell", "{}"), {"type": "function_call_output", "output": "o"}]},
        ),
        (
            "reasoning_content",
            {"input": [ask, reasoning("think hard", "summary"), said("answer"), user("more")]},
        ),
        (
            "reasoning_summary_only",
            {"input": [ask, reasoning(summary="in short"), said("answer"), user("more")]},
        ),
        ("reasoning_empty", {"input": [ask, reasoning(), said("answer"), user("more")]}),
        (
            "reasoning_then_calls",
            {
                "tools": [READ],
                "input": [
                    ask,
                    reasoning("need file"),
                    call("c1", "read_file", '{"path":"r.py"}'),
                    call("c2", "read_file", '{"path":"s.py"}'),
                    result("c1", "1"),
                    result("c2", "2"),
                ],
            },
        ),
        ("message_then_reasoning", {"input": [ask, said("first"), reasoning("after"), reasoning("again")]}),
        ("reasoning_incomplete_continues", {"input": [ask, reasoning("partial", status="incomplete")]}),
        ("namespace_custom_and_function_tools", {"tools": [READ, AGENTS, PATCH, SHELL], "input": "hi"}),
        ("web_search_dropped", {"tools": [WEB, READ], "input": "hi"}),
        ("only_web_search", {"tools": [WEB], "input": "hi"}),
        ("tool_choice_none_still_shown", {"tools": [READ], "tool_choice": "none", "input": "hi"}),
        ("reasoning_effort_low", {"reasoning": {"effort": "low"}, "input": "hi"}),
        ("reasoning_effort_none", {"reasoning": {"effort": "none"}, "input": "hi"}),
        (
            "reasoning_effort_none_thinking_kwarg_wins",
            {
                "reasoning": {"effort": "none"},
                "chat_template_kwargs": {"enable_thinking": True},
                "input": "hi",
            },
        ),
        ("reasoning_summary_no_effort", {"reasoning": {"summary": "auto"}, "input": "hi"}),
        ("template_kwargs_thinking_off", {"chat_template_kwargs": {"enable_thinking": False}, "input": "hi"}),
        ("template_kwargs_thinking_null", {"chat_template_kwargs": {"enable_thinking": None}, "input": "hi"}),
        (
            "template_kwargs_generation_flag_overridden",
            {"chat_template_kwargs": {"add_generation_prompt": False, "unused": 1}, "input": "hi"},
        ),
        (
            "ignored_fields",
            {
                "input": "hi",
                "store": False,
                "max_output_tokens": 5,
                "metadata": {"k": "v"},
                "prompt_cache_key": "s1",
                "temperature": 0.3,
                "include": ["reasoning.encrypted_content"],
                "client_metadata": {"x": 1},
                "parallel_tool_calls": False,
            },
        ),
        ("codex_first_turn", codex_body([])),
        (
            "codex_after_tool_call",
            codex_body(
                [
                    reasoning("run it", id="rs_1"),
                    call("call_1", "exec_command", '{"cmd":"echo hi"}', id="fc_1", status="completed"),
                    {
                        "type": "function_call_output",
                        "id": "fco_1",
                        "call_id": "call_1",
                        "output": "Chunk ID: 1\nOutput:\nhi\n",
                    },
                    said("It printed hi."),
                    user("thanks", id="msg_u3"),
                ]
            ),
        ),
        ("refused_item_reference", {"input": [ask, {"type": "item_reference", "id": "msg_x"}]}),
        ("refused_encrypted_reasoning", {"input": [ask, reasoning(encrypted_content="gAAAA"), user("x")]}),
        (
            "refused_grammar_tool",
            {
                "input": "hi",
                "tools": [
                    {
                        "type": "custom",
                        "name": "g",
                        "format": {"type": "grammar", "syntax": "lark", "definition": "x"},
                    }
                ],
            },
        ),
        ("refused_empty_input", {"input": []}),
        (
            "refused_assistant_string_with_id_and_status",
            {
                "input": [
                    ask,
                    {
                        "type": "message",
                        "role": "assistant",
                        "id": "msg_1",
                        "status": "completed",
                        "content": "it is",
                    },
                ]
            },
        ),
        (
            "refused_assistant_output_text_without_type",
            {"input": [ask, {"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}]},
        ),
    ]


def codex_body(more: list[dict[str, Any]]) -> dict[str, Any]:
    """Shaped like Codex CLI 0.169's requests (docs/internals/vllm-agent-apis.md section 5), only shorter."""
    exec_command = {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}, "yield_time_ms": {"type": "number"}},
            "required": ["cmd"],
            "additionalProperties": False,
        },
    }
    view_image = {
        "type": "function",
        "name": "view_image",
        "description": "View an image.",
        "strict": False,
        "parameters": PARAMETERS,
    }
    return {
        "instructions": "",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "id": "msg_d1",
                "content": [{"type": "input_text", "text": "You are Codex, a coding agent."}],
            },
            {
                "type": "message",
                "role": "developer",
                "id": "msg_d2",
                "content": [{"type": "input_text", "text": "<skills>none</skills>"}],
            },
            user("<environment_context><cwd>/w</cwd></environment_context>", id="msg_u1"),
            user("say hi", id="msg_u2"),
            *more,
        ],
        "tools": [exec_command, view_image, AGENTS, WEB],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0b6c1f3e-session",
        "client_metadata": {"originator": "codex_exec"},
    }


def chains() -> list[tuple[str, list[dict[str, Any]]]]:
    """name, turns: each turn after the first names the previous turn's response."""
    return [
        (
            "three_turns",
            [
                {"instructions": "First rules.", "input": "hello there"},
                {"instructions": "Second rules.", "input": [user("next"), user("and more")]},
                {"input": [{"role": "developer", "content": "dev"}, user("last")]},
            ],
        ),
        (
            "tools_across_turns",
            [
                {
                    "tools": [READ],
                    "input": [
                        user("read a.py"),
                        call("c1", "read_file", '{"path":"a.py"}'),
                        result("c1", "x = 1"),
                    ],
                },
                {
                    "tools": [READ],
                    "input": [call("c2", "read_file", '{"path":"b.py"}'), result("c2", "y = 2")],
                },
                {
                    "tools": [READ],
                    "instructions": "Finish.",
                    "input": [reasoning("done"), said("ok"), user("bye")],
                },
            ],
        ),
    ]


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def render(url: str, model: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = post(url, "/v1/responses/render", {"model": model, **body})
    print(f"[capture] {name}: {status}", file=sys.stderr, flush=True)
    record: dict[str, Any] = {"name": name, "body": body, "status": status}
    if status == 200:
        record["token_ids"] = answer["token_ids"]
    else:
        record["error"] = answer
    return record


def chain(url: str, model: str, name: str, turns: list[dict[str, Any]]) -> dict[str, Any]:
    recorded = []
    previous_id = None
    for number, turn in enumerate(turns):
        body = {**turn, **({"previous_response_id": previous_id} if previous_id else {})}
        sent = {
            "model": model,
            "store": True,
            "enable_response_messages": True,
            "max_output_tokens": 6,
            "temperature": 0,
            **body,
        }
        status, answer = post(url, "/v1/responses", sent)
        print(f"[capture] {name}[{number}]: {status}", file=sys.stderr, flush=True)
        if status != 200:
            raise SystemExit(f"{name}[{number}] failed: {answer}")
        [raw] = answer["input_messages"]
        recorded.append({"body": body, "output": answer["output"], "token_ids": raw["tokens"]})
        previous_id = answer["id"]
    return {"name": name, "turns": recorded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the running vLLM, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default="tiny", help="its served model name")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    url = args.url.rstrip("/")
    with urllib.request.urlopen(url + "/version", timeout=30) as answer:
        version = json.loads(answer.read())["version"]
    capture = {
        "vllm_version": version,
        "tokenizer": "builtin:tiny-llama",
        "server": "VLLM_ENABLE_RESPONSES_API_STORE=1, --enable-scale-out, no --default-chat-template-kwargs, "
        "no --exclude-tools-when-tool-choice-none",
        "renders": [render(url, args.model, name, body) for name, body in rendered_cases()],
        "chains": [chain(url, args.model, name, turns) for name, turns in chains()],
    }
    Path(args.out).write_text(json.dumps(capture, indent=1, ensure_ascii=False) + "\n")
    print(f"[capture] wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
