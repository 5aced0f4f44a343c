"""What tokenizing an agent's chats with tools costs the router: rendered here vs asked of an engine.

Plays one agent session with tools, growing by a tool call and its output per turn, through two routers'
`prepare` side by side: one rendering locally (its token cache on), one asking an instance's /tokenize (what
kvroute did before it rendered tools). Prints the time per turn and checks that both give the same blocks.
The engine is the simulated fleet (`--engine fleet`: the same render and encode, long prompts allowed) or
real vLLM (`--engine stack`: configs/stack-cpu.yaml, `make stack-env`; its max-model-len is 4096).

    .venv/bin/python scripts/measure_tool_chats.py --turns 30 --output-tokens 1500
    .venv/bin/python scripts/measure_tool_chats.py --engine stack --turns 10 --output-tokens 250
    .venv/bin/python scripts/measure_tool_chats.py --template-kwargs '{"enable_thinking": false}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvroute.processes import FleetPorts, free_port_block, running_fleet  # noqa: E402
from kvroute.stack.config import load_stack_config  # noqa: E402
from kvroute.stack.run import running_stack  # noqa: E402
from router.apis.openai_body import ChatRequest  # noqa: E402
from router.dispatch.decide.decision import Decider  # noqa: E402
from router.index.block_index import BlockIndex  # noqa: E402
from router.metrics import RouterMetrics  # noqa: E402
from router.prompt.remote_tokenizer import RemoteTokenizer  # noqa: E402
from router.prompt.token_cache import CachedChatTokenizer  # noqa: E402
from router.prompt.tokenization import PromptTokenizer  # noqa: E402
from tinymodel.builder import MODEL_NAME, ensure_model  # noqa: E402

PARAMETERS = {"type": "object", "properties": {"arg": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} here.", "parameters": PARAMETERS}}
    for name in ("read_file", "edit_file", "run_tests", "grep", "list_dir")
]
FILLER = "def handler(request):\n    return route(request, instances)  # 128 passed, 3 skipped\n"


def session(turns: int, output_tokens: int) -> list[list[dict[str, Any]]]:
    """Each turn's messages: the previous turn's, plus an assistant tool call and the tool's output."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " * 40},
        {"role": "user", "content": "Fix the failing test."},
    ]
    chats = []
    for turn in range(turns):
        arguments = json.dumps({"arg": f"tests/t{turn}.py"})
        call = {
            "id": f"c{turn}",
            "type": "function",
            "function": {"name": "run_tests", "arguments": arguments},
        }
        output = FILLER * max(1, output_tokens // 25)
        messages = [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{turn}", "content": output},
        ]
        chats.append(messages)
    return chats


async def measure(url: str, turns: int, output_tokens: int, template_kwargs: dict[str, Any] | None) -> None:
    tokenizer = CachedChatTokenizer(PromptTokenizer(ensure_model()))
    async with aiohttp.ClientSession() as http:
        remote = RemoteTokenizer(http, url, MODEL_NAME)
        local_router = Decider(BlockIndex(32), {MODEL_NAME: tokenizer}, 32, RouterMetrics())
        remote_router = Decider(BlockIndex(32), {}, 32, RouterMetrics(), lambda model: remote)
        rows = []
        for turn, messages in enumerate(session(turns, output_tokens)):
            body = ChatRequest(
                model=MODEL_NAME, messages=messages, tools=TOOLS, chat_template_kwargs=template_kwargs
            )
            timings, chains = [], []
            for router in (local_router, remote_router):
                started = time.perf_counter()
                prepared = await router.prepare(body, None, off_loop=True)
                timings.append((time.perf_counter() - started) * 1000)
                chains.append(prepared.chain)
            assert chains[0] == chains[1], f"turn {turn + 1}: the local and the engine's blocks differ"
            tokens = prepared.request.prompt_tokens
            rows.append((turn + 1, tokens, *timings))
            print(
                f"turn {turn + 1:3d}  {tokens:7d} tokens  local {timings[0]:7.1f} ms  "
                f"/tokenize {timings[1]:7.1f} ms"
            )
        later = rows[1:]
        print(
            f"median over turns 2-{turns}: local {statistics.median(r[2] for r in later):.1f} ms, "
            f"/tokenize {statistics.median(r[3] for r in later):.1f} ms; last turn {rows[-1][1]} tokens: "
            f"{rows[-1][2]:.1f} vs {rows[-1][3]:.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--output-tokens", type=int, default=1500, help="about this many per tool output")
    parser.add_argument("--engine", choices=("fleet", "stack"), default="fleet")
    parser.add_argument("--template-kwargs", type=json.loads, help="chat_template_kwargs to send, as JSON")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="tool-chats-"))
    if args.engine == "fleet":
        ports = FleetPorts.allocate(1)
        with running_fleet(ports, run_dir, ["--max-model-len", "400000"]):
            url = f"http://127.0.0.1:{ports.http}"
            asyncio.run(measure(url, args.turns, args.output_tokens, args.template_kwargs))
        return
    config = load_stack_config(REPO / "configs" / "stack-cpu.yaml")
    config = config.with_ports(free_port_block(config.port_count()))
    with running_stack(config, run_dir, base_dir=REPO) as stack:
        asyncio.run(measure(stack.instances[0].url, args.turns, args.output_tokens, args.template_kwargs))


if __name__ == "__main__":
    main()
