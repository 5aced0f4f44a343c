"""Images a chat gives by URL, fetched from the hosts an operator lists and keyed as the same image sent
inline (vLLM hashes the bytes it downloads); anything else is routed by load."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from PIL import Image

from router.apis.openai_body import ChatRequest
from router.dispatch.decide.decision import Decider, DeciderOptions
from router.index.block_index import BlockIndex
from router.metrics import RouterMetrics
from router.prompt.multimodal.fetch import ImageFetcher
from router.prompt.token_cache import CachedChatTokenizer
from router.prompt.tokenization import PromptTokenizer
from tinymodel.vision import build_files

MODEL, ROOT = "tiny-mm", "tiny-idefics3"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    directory = tmp_path_factory.mktemp("model") / "tiny-idefics3"
    build_files(directory)
    return PromptTokenizer(directory)


def png(size: tuple[int, int]) -> bytes:
    data = io.BytesIO()
    Image.new("RGB", size, (10, 120, 200)).save(data, "PNG")
    return data.getvalue()


def chat(url: str) -> list[dict[str, Any]]:
    text = {"type": "text", "text": "What does this screenshot say about the failing build? " * 3}
    return [{"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": url}}]}]


async def chains(
    tokenizer: PromptTokenizer, urls: Sequence[str], domains: Sequence[str], served: bytes
) -> tuple[list[list[int]], int]:
    """The chains the decider makes of a chat of each URL (an image server on 127.0.0.1 answering served),
    and how often the server was asked."""
    asked = 0

    async def image(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        return web.Response(body=served, content_type="image/png")

    app = web.Application()
    app.router.add_get("/shot.png", image)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            fetcher = ImageFetcher(session, domains, max_bytes=100_000, timeout_s=5)
            options = DeciderOptions(model_roots=lambda model: [ROOT], images=fetcher)
            decider = Decider(
                BlockIndex(32), {MODEL: CachedChatTokenizer(tokenizer)}, 32, RouterMetrics(), options=options
            )
            made = []
            for url in urls:
                body = ChatRequest(model=MODEL, messages=chat(url.format(port=port)))
                made.append(list((await decider.prepare(body, None)).request.chain))
            decider.close()
    finally:
        await runner.cleanup()
    return made, asked


def test_an_image_by_url_is_fetched_once_and_keyed_as_the_same_image_inline(
    tokenizer: PromptTokenizer,
) -> None:
    image = png((80, 60))
    inline = "data:image/png;base64," + base64.b64encode(image).decode()
    url = "http://127.0.0.1:{port}/shot.png"
    (by_url, again, sent_inline), asked = asyncio.run(
        chains(tokenizer, [url, url, inline], ["127.0.0.1"], image)
    )
    assert by_url and by_url == again == sent_inline
    assert asked == 1


def test_an_image_from_an_unlisted_host_or_too_large_is_routed_by_load(tokenizer: PromptTokenizer) -> None:
    url = "http://127.0.0.1:{port}/shot.png"
    (unlisted,), asked = asyncio.run(chains(tokenizer, [url], ["images.example.com"], png((80, 60))))
    assert unlisted == [] and asked == 0
    (large,), _ = asyncio.run(chains(tokenizer, [url], ["127.0.0.1"], b"\x89PNG" + bytes(200_000)))
    assert large == []
