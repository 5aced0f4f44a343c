"""The simulated instance's Responses API store, background runs, cancellation and options, its Anthropic
Messages options, and vLLM's answers to unknown routes; one instance served in-process per test."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from fleet.block_pool import BlockHasher, BlockPool
from fleet.engine import Engine, EngineTiming
from fleet.launcher import add_api_routes
from fleet.response_store import ResponseStore
from fleet.sampling import printable_token_ids
from fleet.server import SimInstance, serve
from kvroute.processes import free_port_block
from router.apis.responses.chat import responses_chat
from router.prompt.template_inputs import TemplateInputs
from router.prompt.tokenization import PromptTokenizer

MODEL = "tiny-llama"
PROMPT = " ".join(f"step{i}" for i in range(40))  # over 100 tokens: three full 32-token blocks
TOOL = {"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
NOT_FOUND = {"message": "Response with id '{}' not found.", "type": "invalid_request_error"}


class Client:
    def __init__(self, session: aiohttp.ClientSession, base: str, instance: SimInstance) -> None:
        self.session, self.base, self.instance = session, base, instance

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.session.request(method, self.base + path, json=body) as response:
            text = await response.text()
            if response.content_type == "application/json":
                return response.status, json.loads(text)
            return response.status, text

    async def post(self, path: str, body: Any = None) -> tuple[int, Any]:
        return await self.call("POST", path, body)

    async def get(self, path: str) -> tuple[int, Any]:
        return await self.call("GET", path)

    async def finished(self, response_id: str) -> dict[str, Any]:
        async with asyncio.timeout(10):
            while True:
                status, body = await self.get(f"/v1/responses/{response_id}")
                assert status == 200
                if body["status"] not in ("queued", "in_progress"):
                    return body  # type: ignore[no-any-return]
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def served(
    tokenizer: PromptTokenizer, decode_tps: float = 5000, **options: Any
) -> AsyncIterator[Client]:
    timing = EngineTiming(prefill_tokens_per_s=1e6, decode_s_per_token=1 / decode_tps)
    engine = Engine(BlockPool(512, 32, True), timing, BlockHasher("0"))
    vocabulary = printable_token_ids(tokenizer)
    instance = SimInstance("i0", MODEL, [engine], tokenizer, vocabulary, 4096, 0, **options)
    task = asyncio.create_task(engine.run())
    port = free_port_block(1)
    try:
        async with (
            serve(instance, "127.0.0.1", port, add_api_routes),
            aiohttp.ClientSession() as session,
        ):
            yield Client(session, f"http://127.0.0.1:{port}", instance)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def run(tokenizer: PromptTokenizer, test: Callable[[Client], Awaitable[None]], **options: Any) -> None:
    async def main() -> None:
        async with served(tokenizer, **options) as client:
            await test(client)

    asyncio.run(main())


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not in time"
        await asyncio.sleep(0.01)


def events(stream: str) -> list[dict[str, Any]]:
    return [json.loads(frame.split("\ndata: ")[1]) for frame in stream.split("\n\n") if frame.strip()]


def test_the_store_keeps_at_most_its_capacity_and_drops_the_oldest_whole() -> None:
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put_messages(name, [{"role": "user", "content": name}])
        store.put({"id": name, "status": "completed"})
    store.start_events("b")
    store.put_messages("c", [])  # c starts: a, the oldest, goes with its messages
    assert store.response("a") is None and store.messages("a") is None
    assert store.response("b") is not None and store.events("b") is not None
    assert len(store) == 2


def test_a_cancelled_response_is_not_overwritten_when_its_run_ends() -> None:
    store = ResponseStore()
    store.put({"id": "r", "status": "queued"})
    stored = store.response("r")
    assert stored is not None
    stored["status"] = "cancelled"
    store.put({"id": "r", "status": "completed"})
    assert store.response("r") == {"id": "r", "status": "cancelled"}
    with pytest.raises(ValueError):
        ResponseStore(capacity=0)


def test_a_follow_up_renders_the_stored_turn_and_finds_its_blocks_cached(tokenizer: PromptTokenizer) -> None:
    async def test(client: Client) -> None:
        first = {"input": PROMPT, "max_output_tokens": 3, "request_id": "resp_t1"}
        status, turn1 = await client.post("/v1/responses", first)
        assert status == 200 and turn1["id"] == "resp_t1"
        follow = {"input": "and then?", "instructions": "Be terse.", "previous_response_id": "resp_t1"}
        status, turn2 = await client.post("/v1/responses", {**follow, "max_output_tokens": 2})
        assert status == 200 and turn2["previous_response_id"] == "resp_t1"
        # the prompt: its instructions, turn 1's messages, turn 1's answer, the new input
        messages = client.instance.responses.messages("resp_t1")
        assert messages == [{"role": "user", "content": PROMPT}]
        chat = responses_chat(follow, messages, turn1["output"])
        assert chat.messages[0] == {"role": "system", "content": "Be terse."}
        assert chat.messages[2] == {"role": "assistant", "content": turn1["output"][0]["content"][0]["text"]}
        ids = tokenizer.chat_ids(
            chat.messages, add_special_tokens=True, inputs=TemplateInputs(calls_as_given=True)
        )
        assert turn2["usage"]["input_tokens"] == len(ids)
        # a third turn without instructions holds turn 2's prompt less its system message: no shared prefix
        # but the BOS tokens; turn 2 without them would have found turn 1's full blocks cached
        third = {"input": "why?", "previous_response_id": turn2["id"], "max_output_tokens": 1}
        _, turn3 = await client.post("/v1/responses", third)
        assert (
            turn3["usage"]["input_tokens_details"]["cached_tokens"]
            >= turn1["usage"]["input_tokens"] // 32 * 32
        )

    run(tokenizer, test)


def test_cached_tokens_are_the_engines_prefix_hits(tokenizer: PromptTokenizer) -> None:
    async def test(client: Client) -> None:
        body = {"input": PROMPT, "max_output_tokens": 2}
        _, first = await client.post("/v1/responses", body)
        _, again = await client.post("/v1/responses", body)
        prompt = first["usage"]["input_tokens"]
        assert first["usage"]["input_tokens_details"]["cached_tokens"] == 0
        assert first["usage"]["input_tokens_details"]["cache_write_tokens"] == prompt // 32 * 32
        assert again["usage"]["input_tokens_details"]["cached_tokens"] == (prompt - 1) // 32 * 32
        assert client.instance.engines[0].stats.prefix_cache_hits == (prompt - 1) // 32 * 32

    run(tokenizer, test)


def test_eos_after_ends_answers_as_finished_within_their_budget(tokenizer: PromptTokenizer) -> None:
    """--eos-after: the model samples its EOS after N tokens; a budget reached first still cuts the answer."""

    async def test(client: Client) -> None:
        messages = [{"role": "user", "content": "hi"}]
        _, ended = await client.post(
            "/v1/messages", {"model": MODEL, "max_tokens": 100, "messages": messages}
        )
        assert (ended["stop_reason"], ended["usage"]["output_tokens"]) == ("end_turn", 3)
        _, cut = await client.post("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": messages})
        assert (cut["stop_reason"], cut["usage"]["output_tokens"]) == ("max_tokens", 2)
        _, response = await client.post("/v1/responses", {"input": "hi", "max_output_tokens": 100})
        assert (response["status"], response["usage"]["output_tokens"]) == ("completed", 3)
        body = {"model": MODEL, "max_tokens": 100, "messages": messages}
        _, chat = await client.post("/v1/chat/completions", body)
        assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"]["completion_tokens"] == 3

    run(tokenizer, test, eos_after=3)


def test_a_response_is_stored_when_it_ends_and_its_messages_when_it_starts(
    tokenizer: PromptTokenizer,
) -> None:
    async def test(client: Client) -> None:
        body = {"input": PROMPT, "max_output_tokens": 400, "stream": True, "request_id": "resp_live"}
        streaming = asyncio.create_task(client.post("/v1/responses", body))
        await until(lambda: client.instance.responses.messages("resp_live") is not None)
        status, error = await client.post(
            "/v1/responses", {"input": "x", "previous_response_id": "resp_live", "max_output_tokens": 1}
        )
        assert status == 404 and error["error"]["message"] == NOT_FOUND["message"].format("resp_live")
        _, stream = await streaming
        assert events(stream)[-1]["type"] == "response.completed"
        status, stored = await client.get("/v1/responses/resp_live")
        assert status == 200 and stored["status"] == "incomplete" and stored["usage"]["output_tokens"] == 400

    run(tokenizer, test, decode_tps=2000)


def test_background_runs_are_queued_then_stored_and_followed_from_any_event(
    tokenizer: PromptTokenizer,
) -> None:
    async def test(client: Client) -> None:
        body = {"input": PROMPT, "max_output_tokens": 5, "background": True, "request_id": "resp_bg"}
        status, queued = await client.post("/v1/responses", body)
        assert status == 200 and queued["status"] == "queued" and queued["usage"] is None
        done = await client.finished("resp_bg")
        assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 5
        status, stream = await client.post(
            "/v1/responses", {**body, "stream": True, "request_id": "resp_bgs"}
        )
        whole = events(stream)
        assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
        _, resumed = await client.get("/v1/responses/resp_bgs?stream=true&starting_after=3")
        assert events(resumed) == whole[4:]
        _, from_start = await client.get("/v1/responses/resp_bgs?stream=1")
        assert events(from_start) == whole

    run(tokenizer, test)


def test_cancelling_a_background_run_stops_its_engine_request(tokenizer: PromptTokenizer) -> None:
    async def test(client: Client) -> None:
        body = {"input": PROMPT, "max_output_tokens": 3000, "background": True, "request_id": "resp_long"}
        await client.post("/v1/responses", body)
        engine = client.instance.engines[0]
        await until(lambda: engine.num_running > 0)
        status, cancelled = await client.post("/v1/responses/resp_long/cancel")
        assert status == 200 and cancelled["status"] == "cancelled" and cancelled["output"] == []
        assert engine.num_running == 0
        _, stored = await client.get("/v1/responses/resp_long")
        assert stored["status"] == "cancelled"
        status, error = await client.post("/v1/responses/resp_long/cancel")
        assert status == 400 and error["error"]["message"] == "Cannot cancel a synchronous response."

    run(tokenizer, test, decode_tps=500)


def test_a_stopping_instance_cancels_its_background_runs(tokenizer: PromptTokenizer) -> None:
    async def main() -> None:
        async with served(tokenizer, decode_tps=100) as client:
            body = {"input": "x", "max_output_tokens": 3000, "background": True, "request_id": "resp_bye"}
            await client.post("/v1/responses", body)
            store = client.instance.responses
        assert store.background_runs == 0

    asyncio.run(main())


def test_without_the_store_nothing_is_kept_and_background_is_refused(tokenizer: PromptTokenizer) -> None:
    async def test(client: Client) -> None:
        status, answer = await client.post(
            "/v1/responses", {"input": "x", "max_output_tokens": 1, "request_id": "r1"}
        )
        assert status == 200 and answer["id"] == "r1"
        for method, path in (("GET", "/v1/responses/r1"), ("POST", "/v1/responses/r1/cancel")):
            status, error = await client.call(method, path)
            assert status == 404 and error["error"]["param"] == "response_id"
        status, error = await client.post("/v1/responses", {"input": "x", "previous_response_id": "r1"})
        assert status == 404
        status, error = await client.post("/v1/responses", {"input": "x", "background": True})
        assert status == 400 and "VLLM_ENABLE_RESPONSES_API_STORE=1" in error["error"]["message"]
        assert error["error"]["param"] == "background"

    run(tokenizer, test, responses=ResponseStore(enabled=False))


def test_a_bounded_store_forgets_the_oldest_response(tokenizer: PromptTokenizer) -> None:
    async def test(client: Client) -> None:
        for name in ("r1", "r2", "r3"):
            await client.post("/v1/responses", {"input": name, "max_output_tokens": 1, "request_id": name})
        assert (await client.get("/v1/responses/r1"))[0] == 404
        assert (await client.get("/v1/responses/r3"))[0] == 200

    run(tokenizer, test, responses=ResponseStore(capacity=2))


def test_tools_need_auto_tool_choice_as_in_vllm(tokenizer: PromptTokenizer) -> None:
    message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'

    async def test(client: Client) -> None:
        body = {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [TOOL],
        }
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            status, error = await client.post(path, body)
            assert status == 400
            assert error == {"type": "error", "error": {"type": "BadRequestError", "message": message}}
        chat_tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
        chat = {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [chat_tool],
        }
        status, error = await client.post("/v1/chat/completions", chat)
        assert status == 400 and error["error"]["message"] == message
        status, _ = await client.post("/v1/chat/completions", {**chat, "tool_choice": "none"})
        assert status == 200
        required = {**chat, "tool_choice": {"type": "function", "function": {"name": "f"}}}
        status, error = await client.post("/v1/chat/completions", required)
        assert (
            status == 400
            and error["error"]["message"] == 'tool_choice=function "f" requires --tool-call-parser to be set'
        )

    run(tokenizer, test, auto_tool_choice=False)


def test_anthropic_usage_splits_out_the_cache_only_with_prompt_tokens_details(
    tokenizer: PromptTokenizer,
) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [TOOL],
    }

    async def plain(client: Client) -> None:
        _, counted = await client.post("/v1/messages/count_tokens", body)
        status, message = await client.post("/v1/messages", body)
        assert status == 200 and message["id"].startswith("chatcmpl-")
        assert message["usage"] == {"input_tokens": counted["input_tokens"], "output_tokens": 2}

    async def detailed(client: Client) -> None:
        _, counted = await client.post("/v1/messages/count_tokens", body)
        await client.post("/v1/messages", body)
        _, again = await client.post("/v1/messages", body)
        usage = again["usage"]
        assert usage["cache_read_input_tokens"] == (counted["input_tokens"] - 1) // 32 * 32
        assert (
            usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
            == (counted["input_tokens"])
        )

    run(tokenizer, plain)
    run(tokenizer, detailed, prompt_tokens_details=True)


def test_unknown_routes_and_methods_answer_as_vllm(tokenizer: PromptTokenizer) -> None:
    async def test(client: Client) -> None:
        assert await client.get("/v1/nope") == (404, {"detail": "Not Found"})
        assert await client.get("/v1/messages") == (405, {"detail": "Method Not Allowed"})
        async with client.session.get(client.base + "/v1/responses") as response:
            assert response.headers["Allow"] == "POST"

    run(tokenizer, test)


def test_an_api_key_is_asked_for_before_the_route_is_looked_up(tokenizer: PromptTokenizer) -> None:
    async def test(client: Client) -> None:
        assert await client.get("/v1/nope") == (401, {"error": "Unauthorized"})
        headers = {"Authorization": "Bearer k"}
        async with client.session.get(client.base + "/v1/nope", headers=headers) as response:
            assert response.status == 404

    run(tokenizer, test, api_key="k")
