"""Images a chat gives by URL, fetched so that they can be keyed as the engine keys them.

The engine fetches them too (vLLM hashes the bytes it downloads), so the router fetches only from the hosts
an operator lists (``tokenization.image_url_domains``: a router at the edge must not fetch whatever a client
names), each URL once while it is kept (the last 64 MiB fetched), at most ``image_max_bytes`` within
``image_fetch_timeout_s``. A fetch that fails, or a host not listed, leaves the request routed by load
(``InvalidPrompt``, with why).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp

from router.prompt.chat_conversation import InvalidPrompt

KEPT_BYTES = 64 * 2**20
_AT_ONCE = 8  # fetches of one request at once


class ImageFetcher:
    def __init__(
        self, session: aiohttp.ClientSession, domains: Sequence[str], max_bytes: int, timeout_s: float
    ) -> None:
        self._session, self._domains = session, tuple(d.lower().strip(".") for d in domains)
        self._max_bytes, self._timeout_s = max_bytes, timeout_s
        self._kept: OrderedDict[str, bytes] = OrderedDict()
        self._kept_bytes = 0

    def allowed(self, url: str) -> bool:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        listed = any(host == domain or host.endswith("." + domain) for domain in self._domains)
        return parts.scheme in ("http", "https") and listed

    async def fetch_all(self, urls: Sequence[str]) -> dict[str, bytes]:
        """Each URL's bytes; InvalidPrompt when one is not allowed or does not come."""
        for url in urls:
            if not self.allowed(url):
                raise InvalidPrompt("an image URL whose host tokenization.image_url_domains does not list")
        slots = asyncio.Semaphore(_AT_ONCE)

        async def one(url: str) -> tuple[str, bytes]:
            async with slots:
                return url, await self.fetch(url)

        return dict(await asyncio.gather(*(one(url) for url in dict.fromkeys(urls))))

    async def fetch(self, url: str) -> bytes:
        kept = self._kept.get(url)
        if kept is not None:
            self._kept.move_to_end(url)
            return kept
        try:
            async with (
                asyncio.timeout(self._timeout_s),
                self._session.get(url, allow_redirects=False) as reply,
            ):
                if reply.status != 200:
                    raise InvalidPrompt(f"an image URL answered {reply.status}")
                data = await reply.content.read(self._max_bytes + 1)
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise InvalidPrompt(f"an image URL did not come ({type(error).__name__})") from None
        if len(data) > self._max_bytes:
            raise InvalidPrompt(f"an image URL holds more than {self._max_bytes} bytes")
        self._keep(url, data)
        return data

    def _keep(self, url: str, data: bytes) -> None:
        self._kept[url] = data
        self._kept_bytes += len(data)
        while self._kept_bytes > KEPT_BYTES and len(self._kept) > 1:
            _, dropped = self._kept.popitem(last=False)
            self._kept_bytes -= len(dropped)
