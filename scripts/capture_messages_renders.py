"""Capture the token ids real vLLM renders for Anthropic Messages bodies, and its Anthropic error answers.

Talks to two vLLM 0.32 servers already running (tiny model, served as "tiny", 127.0.0.1 only):

- main: the model's own chat template (which fails vLLM's system-first probe, so inline system messages are
  merged into the leading one), with tools accepted:

      python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --served-model-name tiny \\
          --host 127.0.0.1 --port PORT --dtype bfloat16 --max-model-len 8192 --block-size 32 \\
          --enable-prefix-caching --enable-scale-out --enable-auto-tool-choice --tool-call-parser hermes

- inline: the same flags without the two tool ones, and ``--chat-template FILE`` with INLINE_TEMPLATE
  (written by ``--write-template FILE``): a template that takes system messages anywhere (nothing is merged)
  and renders reasoning_effort "none" as "max" (so vLLM maps ``thinking: disabled`` to "low").

For each case it records the body, ``/v1/messages/render``'s token ids, ``/v1/messages/count_tokens``' count
and the prompt length ``/v1/messages`` reports (usage.input_tokens, the body sent with stream off); then
errors of both endpoints, with the chat endpoint's OpenAI-shaped answer to the same fault beside them:

    .venv/bin/python scripts/capture_messages_renders.py --main http://127.0.0.1:P1 --inline http://127.0.0.1:P2
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "vllm" / "messages_render_capture.json"
MODEL = "tiny"
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=cli; cch=4f2e9;"
INLINE_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|tools|>\\n' }}{% for tool in tools %}{{ tool | tojson + '\\n' }}"
    "{% endfor %}{{ '</s>\\n' }}{% endif %}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}{% if message['reasoning'] is defined %}"
    "{{ '<think>' + message['reasoning'] + '</think>\\n' }}{% endif %}"
    "{% if message['tool_call_id'] %}{{ '[' + message['tool_call_id'] + '] ' }}{% endif %}"
    "{{ message['content'] }}{% for call in message['tool_calls'] or [] %}"
    "{{ '\\n<call>' + call | tojson + '</call>' }}{% endfor %}{{ '</s>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% if reasoning_effort %}"
    "{{ '<effort>' + {'none': 'max'}.get(reasoning_effort, reasoning_effort) + '</effort>\\n' }}{% endif %}"
    "{% endif %}"
)
READ = {
    "name": "read_file",
    "description": "Read a file of the repository.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
GREP = {  # no "type": vLLM adds "object" at the end of the schema
    "name": "grep",
    "description": "Search files for a pattern.",
    "input_schema": {"properties": {"pattern": {"type": "string"}}, "required": ["pattern"]},
    "strict": True,
}
LATER = {"name": "web_fetch", "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
CALL = {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "a.py"}}


def log(message: str) -> None:
    print(f"[capture] {message}", file=sys.stderr, flush=True)


def user(*content: Any) -> dict[str, Any]:
    return {
        "role": "user",
        "content": content[0] if len(content) == 1 and isinstance(content[0], str) else [*content],
    }


def assistant(*content: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content[0] if len(content) == 1 and isinstance(content[0], str) else [*content],
    }


def text(value: str | None, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": value, **extra}


def body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [*messages], **fields}


def claude_code_tools() -> list[dict[str, Any]]:
    """25 tools shaped as Claude Code's (JSON Schema draft-07 objects, required fields, no extra keys), with
    short descriptions: with the tiny model's byte-level tokens, Claude Code's own overflow its context."""
    names = (
        "Task Bash Glob Grep ExitPlanMode Read Edit MultiEdit Write NotebookEdit WebFetch TodoWrite "
        "WebSearch BashOutput KillShell SlashCommand Skill AskUserQuestion ListMcpResources "
        "ReadMcpResource EnterWorktree ExitWorktree Monitor CronCreate CronDelete"
    ).split()
    tools = []
    for index, name in enumerate(names):
        properties = {"command" if index % 2 else "path": {"type": "string"}, "timeout": {"type": "number"}}
        schema = {
            "type": "object",
            "properties": properties,
            "required": [next(iter(properties))],
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        }
        description = f"{name}: use it when the task needs it."
        tools.append({"name": name, "description": description, "input_schema": schema})
    return tools


def claude_code_body() -> dict[str, Any]:
    system = [
        text(BILLING),
        text(
            "You are Claude Code, Anthropic's official CLI for Claude.", cache_control={"type": "ephemeral"}
        ),
        text(
            "\nYou are an interactive CLI tool that helps users with software engineering tasks.",
            cache_control={"type": "ephemeral"},
        ),
    ]
    first = user(
        text(
            "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
            "# important-instruction-reminders\nDo what has been asked; nothing more, nothing less.\n"
            "</system-reminder>\n"
        ),
        text("<system-reminder>\nThe date is 2026-11-24.\n</system-reminder>"),
        text("say hi", cache_control={"type": "ephemeral"}),
    )
    return {
        "model": MODEL,
        "messages": [first],
        "system": system,
        "tools": claude_code_tools(),
        "metadata": {"user_id": "user_abc_account__session_0f1e"},
        "max_tokens": 4,  # Claude Code asks 32000, more than this server's context
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "stream": True,
    }


def claude_code_second_turn() -> dict[str, Any]:
    first = claude_code_body()
    call = {
        "type": "tool_use",
        "id": "toolu_cc1",
        "name": "Bash",
        "input": {"command": "ls", "timeout": 1000},
    }
    result = {"type": "tool_result", "tool_use_id": "toolu_cc1", "content": [text("a.py\nb.py")]}
    turns = [
        assistant(
            {"type": "thinking", "thinking": "List the files.", "signature": "sig"}, text("Listing."), call
        ),
        user(result, text("<system-reminder>\nTodo list is empty.\n</system-reminder>")),
    ]
    return first | {"messages": first["messages"] + turns}


def main_cases() -> dict[str, dict[str, Any]]:
    hello = user("hello there")
    answer = assistant("general kenobi")
    return {
        "string_content": body(hello),
        "text_blocks": body(user(text("first part"), text("second part"))),
        "empty_text_block_dropped": body(user(text(""), text("only this"))),
        "system_string": body(hello, system="You are terse."),
        "system_blocks": body(
            hello, system=[text("Be terse. "), text("Be kind.", cache_control={"type": "ephemeral"})]
        ),
        "system_billing_header_block": body(
            hello, system=[text(BILLING), text("Be terse.", cache_control={"type": "ephemeral"})]
        ),
        "system_string_billing_header": body(hello, system=BILLING + "\nBe terse."),
        "system_empty_string": body(hello, system=""),
        "multi_turn": body(hello, answer, user("and now?")),
        "final_assistant_prefill": body(hello, assistant("gen")),
        "tool_use_and_string_result": body(
            user("read a.py"),
            assistant(text("Reading."), CALL),
            user({"type": "tool_result", "tool_use_id": "toolu_01", "content": "print(1)"}),
            tools=[READ],
        ),
        "tool_result_blocks_error_and_text": body(
            user("read a.py"),
            assistant(CALL),
            user(
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01",
                    "is_error": True,
                    "content": [text("no such"), text("file")],
                },
                text("try b.py"),
            ),
            tools=[READ],
        ),
        "tool_result_empty_and_two_results": body(
            user("read both"),
            assistant(
                CALL, {"type": "tool_use", "id": "toolu_02", "name": "grep", "input": {"pattern": "é ü"}}
            ),
            user(
                {"type": "tool_result", "tool_use_id": "toolu_01"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_02",
                    "content": [{"type": "text", "text": "x"}, {"type": "text"}],
                },
            ),
            tools=[READ, GREP],
        ),
        "tool_use_without_input_or_name": body(
            user("go"), assistant({"type": "tool_use", "id": "toolu_03"}), user("done?"), tools=[READ]
        ),
        "several_tools": body(hello, tools=[READ, GREP, LATER]),
        "tools_empty_list": body(hello, tools=[]),
        "tool_choice_auto_no_parallel": body(
            hello, tools=[READ], tool_choice={"type": "auto", "disable_parallel_tool_use": True}
        ),
        "tool_choice_any": body(hello, tools=[READ, GREP], tool_choice={"type": "any"}),
        "tool_choice_tool": body(hello, tools=[READ, GREP], tool_choice={"type": "tool", "name": "grep"}),
        "tool_choice_none": body(hello, tools=[READ], tool_choice={"type": "none"}),
        "thinking_in_history": body(
            hello,
            assistant(
                {"type": "thinking", "thinking": "They greet. ", "signature": "s1"},
                {"type": "thinking", "thinking": "Greet back.", "signature": "s2"},
                text("hi"),
            ),
            user("read a.py"),
            assistant(
                {"type": "redacted_thinking", "data": "b64"},
                {"type": "thinking", "thinking": "", "signature": "s3"},
                CALL,
            ),
            user({"type": "tool_result", "tool_use_id": "toolu_01", "content": "ok"}),
            tools=[READ],
        ),
        "assistant_only_redacted_thinking": body(
            hello, assistant({"type": "redacted_thinking", "data": "b64"}), user("well?")
        ),
        "user_thinking_and_tool_use_dropped": body(
            user(
                {"type": "thinking", "thinking": "hmm"},
                text("hi"),
                {"type": "tool_use", "id": "toolu_u", "name": "read_file", "input": {}},
            ),
            tools=[READ],
        ),
        "assistant_tool_result_as_text": body(
            hello,
            assistant(
                {"type": "tool_result", "tool_use_id": "t", "content": [text("x", cache_control=None)]}
            ),
            user("ok"),
        ),
        "tool_reference_skipped": body(
            user(text("look"), {"type": "tool_reference", "tool_name": "read_file"}), tools=[READ]
        ),
        "thinking_enabled": body(hello, thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=1030),
        "thinking_adaptive_effort_high": body(
            hello, thinking={"type": "adaptive"}, output_config={"effort": "high"}
        ),
        "thinking_disabled": body(hello, thinking={"type": "disabled"}),
        "thinking_disabled_over_effort": body(
            hello, thinking={"type": "disabled"}, output_config={"effort": "max"}
        ),
        "effort_low": body(hello, output_config={"effort": "low"}),
        "chat_template_kwargs": body(hello, chat_template_kwargs={"enable_thinking": False}),
        "sampling_fields_and_metadata": body(
            hello,
            stop_sequences=["\n\nHuman:"],
            metadata={"user_id": "u1"},
            temperature=0.5,
            top_p=0.9,
            top_k=5,
            cache_salt="salt-1",
        ),
        "stream": body(hello, stream=True),
        "inline_system_merged": body(
            hello, answer, {"role": "system", "content": "Now be brief."}, user("again"), system="Top."
        ),
        "inline_system_blocks_and_billing": body(
            hello, {"role": "system", "content": [text(BILLING), text("Mid "), text("note.")]}, user("again")
        ),
        "inline_system_without_top": body({"role": "system", "content": "Only inline."}, hello),
        "tool_addition_and_removal": body(
            {
                "role": "system",
                "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "web_fetch"}}
                ],
            },
            {
                "role": "system",
                "content": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "grep"}}],
            },
            {
                "role": "system",
                "content": [
                    {
                        "type": "tool_addition",
                        "tool": {"type": "tool_definition", "definition": {"name": "ls", "input_schema": {}}},
                    }
                ],
            },
            hello,
            tools=[READ, GREP, LATER],
        ),
        "empty_messages": body(system="Only a system prompt."),
        "assistant_empty_string_and_null_text": body(
            hello, assistant(""), user(text(None), text("still here"))
        ),
        "tool_result_without_id_and_lax_strict": body(
            user("go"),
            assistant(CALL),
            user({"type": "tool_result", "content": "done"}),
            tools=[READ | {"strict": 1}],
        ),
        "claude_code_first_turn": claude_code_body(),
        "claude_code_second_turn": claude_code_second_turn(),
    }


def inline_cases() -> dict[str, dict[str, Any]]:
    hello = user("hello there")
    return {
        "string_content": body(hello),
        "inline_system_in_place": body(
            hello,
            assistant("hi"),
            {"role": "system", "content": "Now be brief."},
            user("again"),
            system="Top.",
        ),
        "inline_system_billing_only_dropped": body(
            hello, {"role": "system", "content": [text(BILLING)]}, user("again")
        ),
        "thinking_disabled": body(hello, thinking={"type": "disabled"}),
        "effort_low": body(hello, output_config={"effort": "low"}),
        "effort_max": body(hello, output_config={"effort": "max"}),
    }


def post(base: str, path: str, payload: Any) -> tuple[int, str]:
    data = json.dumps(payload).encode() if not isinstance(payload, bytes) else payload
    request = urllib.request.Request(base + path, data, {"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def capture_case(base: str, server: str, name: str, case: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {"name": name, "server": server, "body": case}
    status, answer = post(base, "/v1/messages/render", case)
    record["render"] = {"status": status} | (
        {"token_ids": json.loads(answer)["token_ids"]} if status == 200 else {"answer": answer}
    )
    status, answer = post(base, "/v1/messages/count_tokens", case)
    record["count_tokens"] = {"status": status, "answer": json.loads(answer)}
    status, answer = post(base, "/v1/messages", case | {"stream": False})
    usage = json.loads(answer).get("usage") if status == 200 else None
    record["messages"] = {"status": status} | (
        {"input_tokens": usage["input_tokens"]} if usage else {"answer": answer}
    )
    ids = len(record["render"].get("token_ids", []))
    counted = record["count_tokens"]["answer"]
    log(f"{server}/{name}: {ids} ids, count_tokens {counted}, messages {record['messages']}")
    return record


def capture_errors(main: str, inline: str) -> list[dict[str, Any]]:
    """Each fault on /v1/messages and count_tokens, and where it has one, the chat endpoint's answer to it."""
    hello = [user("hi")]
    with_tools = body(*hello, tools=[READ])
    faults: list[tuple[str, str, str, Any]] = [
        ("unknown_model", main, "/v1/messages", body(*hello, model="nope")),
        ("unknown_model", main, "/v1/messages/count_tokens", {"model": "nope", "messages": hello}),
        (
            "unknown_model",
            main,
            "/v1/chat/completions",
            {"model": "nope", "messages": hello, "max_tokens": 4},
        ),
        ("tools_without_auto_tool_choice", inline, "/v1/messages", with_tools),
        ("tools_without_auto_tool_choice", inline, "/v1/messages/count_tokens", with_tools),
        (
            "tools_without_auto_tool_choice",
            inline,
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": hello,
                "max_tokens": 4,
                "tool_choice": "auto",
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "read_file", "parameters": READ["input_schema"]},
                    }
                ],
            },
        ),
        (
            "tool_choice_any_without_parser",
            inline,
            "/v1/messages",
            with_tools | {"tool_choice": {"type": "any"}},
        ),
        ("missing_max_tokens", main, "/v1/messages", {"model": MODEL, "messages": hello}),
        ("missing_messages", main, "/v1/messages/count_tokens", {"model": MODEL}),
        ("unknown_block_type", main, "/v1/messages", body(user({"type": "document", "source": {}}))),
        ("not_json", main, "/v1/messages", b"{not json"),
        (
            "tool_removal_of_undeclared",
            main,
            "/v1/messages",
            body(
                {
                    "role": "system",
                    "content": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "x"}}],
                },
                *hello,
            ),
        ),
    ]
    records = []
    for name, base, path, payload in faults:
        status, answer = post(base, path, payload)
        shown = payload.decode() if isinstance(payload, bytes) else payload
        records.append(
            {
                "name": name,
                "server": "main" if base == main else "inline",
                "path": path,
                "body": shown,
                "status": status,
                "answer": answer,
            }
        )
        log(f"error {name} {path}: {status} {answer[:160]}")
    return records


def _ids_on_one_line(text: str) -> str:
    """Lists of numbers (the token ids) on one line each, not one number a line."""
    numbers = re.compile(r"\[\n\s*(-?\d+(?:,\n\s*-?\d+)*)\n\s*\]")
    return numbers.sub(lambda found: "[" + re.sub(r",\n\s*", ",", found.group(1)) + "]", text)


def vllm_version(base: str) -> str:
    with urllib.request.urlopen(base + "/version", timeout=30) as response:
        return str(json.loads(response.read())["version"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--main", help="the vLLM with the model's template and tools accepted")
    parser.add_argument(
        "--inline", help="the vLLM started with --chat-template INLINE_TEMPLATE, no tool flags"
    )
    parser.add_argument("--write-template", type=Path, help="write INLINE_TEMPLATE to this file and stop")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.write_template is not None:
        args.write_template.write_text(INLINE_TEMPLATE)
        return
    if not (args.main and args.inline):
        parser.error("--main and --inline are both needed")
    cases = [capture_case(args.main, "main", name, case) for name, case in main_cases().items()]
    cases += [capture_case(args.inline, "inline", name, case) for name, case in inline_cases().items()]
    fixture = {
        "vllm_version": vllm_version(args.main),
        "servers": {
            "main": {
                "chat_template": None,
                "flags": ["--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
            },
            "inline": {
                "chat_template": INLINE_TEMPLATE,
                "flags": ["--enable-scale-out", "--chat-template", "<INLINE_TEMPLATE>"],
            },
        },
        "cases": cases,
        "errors": capture_errors(args.main, args.inline),
    }
    args.out.write_text(_ids_on_one_line(json.dumps(fixture, indent=1, ensure_ascii=False)) + "\n")
    log(f"wrote {args.out}: {len(cases)} cases, {len(fixture['errors'])} errors")


if __name__ == "__main__":
    main()
