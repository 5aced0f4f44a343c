"""The remote tokenizer answers what the local one does and names its failures."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvroute.processes import FleetPorts, free_port_block, running_fleet
from router.prompt.remote_tokenizer import RemoteTokenizer, TokenizeFailed
from router.prompt.tokenization import PromptTokenizer
from tests.support.http import post
from tinymodel.builder import MODEL_NAME


@pytest.fixture(scope="module")
def instance_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ports = FleetPorts.allocate(1)
    with running_fleet(ports, tmp_path_factory.mktemp("fleet")):
        yield f"http://127.0.0.1:{ports.http}"


async def remote_ids(url: str, method: str, *args: Any, timeout_s: float = 10.0, **kwargs: Any) -> list[int]:
    async with aiohttp.ClientSession() as session:
        remote = RemoteTokenizer(session, url, MODEL_NAME, timeout_s)
        result: list[int] = await getattr(remote, method)(*args, **kwargs)
        return result


CHAT = [
    {"role": "system", "content": "You are a careful coding agent."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "fix it 🙂"}, {"type": "text", "text": "now </s>"}],
    },
    {"role": "assistant", "content": "On it"},
]


@pytest.mark.parametrize(
    ("method", "args", "kwargs"),
    [
        ("chat_ids", (CHAT,), {}),
        ("chat_ids", (CHAT,), {"add_generation_prompt": False}),
        ("chat_ids", (CHAT,), {"add_generation_prompt": False, "continue_final_message": True}),
        ("chat_ids", (CHAT,), {"add_special_tokens": True}),
        ("completion_ids", ("def f(x):\n    return x",), {}),
        ("completion_ids", ("def f(x):",), {"add_special_tokens": False}),
        ("completion_ids", ([5, 6, 7],), {}),
        ("completion_ids", (["def f(x):"],), {}),
    ],
)
def test_remote_ids_equal_local_ones(
    instance_url: str, tokenizer: PromptTokenizer, method: str, args: tuple[Any, ...], kwargs: dict[str, bool]
) -> None:
    expected = getattr(tokenizer, method)(*args, **kwargs)
    assert asyncio.run(remote_ids(instance_url, method, *args, **kwargs)) == expected


def test_remote_token_id_prompts_are_the_ids_themselves_as_vllms_tokenize_takes_text_only(
    instance_url: str,
) -> None:
    dead = f"http://127.0.0.1:{free_port_block(1)}"
    assert asyncio.run(remote_ids(dead, "completion_ids", [5, 6, 7])) == [5, 6, 7]
    assert asyncio.run(remote_ids(dead, "completion_ids", [[8, 9]])) == [8, 9]
    refused = json.dumps({"model": MODEL_NAME, "prompt": [5, 6, 7]}).encode()
    assert post(instance_url + "/tokenize", refused)[0] == 400  # the simulated engine, as vLLM's


def test_remote_failures_raise_tokenize_failed(instance_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port_block(1)}"
    with pytest.raises(TokenizeFailed) as refused:
        asyncio.run(remote_ids(dead, "completion_ids", "hi"))
    assert isinstance(refused.value.__cause__, aiohttp.ClientConnectionError)
    with pytest.raises(TokenizeFailed, match="answered 400"):  # the instance rejects a message without a role
        asyncio.run(remote_ids(instance_url, "chat_ids", [{"content": "hi"}]))


@pytest.mark.parametrize(
    ("status", "body", "cause", "message"),
    [
        (500, b'{"error": "boom"}', type(None), "answered 500"),
        (200, b"not json", msgspec.DecodeError, "unreadable"),
        (200, b'{"count": 1, "tokens": ["a"]}', msgspec.DecodeError, "unreadable"),
        (200, b'{"count": 3, "tokens": [1]}', type(None), "count 3"),
    ],
)
def test_bad_answers_raise_tokenize_failed(status: int, body: bytes, cause: type, message: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/tokenize", handler)
        async with TestServer(app, host="127.0.0.1") as server:
            with pytest.raises(TokenizeFailed, match=message) as failed:
                await remote_ids(str(server.make_url("")), "completion_ids", "hi")
            assert isinstance(failed.value.__cause__, cause)

    asyncio.run(main())


def test_a_silent_instance_times_out_as_tokenize_failed() -> None:
    async def main() -> None:
        never = asyncio.Event()

        async def handler(request: web.Request) -> web.Response:
            await never.wait()
            return web.Response()

        app = web.Application()
        app.router.add_post("/tokenize", handler)
        async with TestServer(app, host="127.0.0.1") as server:
            with pytest.raises(TokenizeFailed) as failed:
                await remote_ids(str(server.make_url("")), "completion_ids", "hi", timeout_s=0.2)
            assert isinstance(failed.value.__cause__, TimeoutError)

    asyncio.run(main())
