"""Reading an answer from an engine only up to what that kind of answer can be.

An engine that answers an endpoint with something else than that endpoint's answer (a misbehaving one, or a
proxy in front of it answering every path alike) must not make the router hold whatever it sends.
"""

from __future__ import annotations

import aiohttp


async def read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The answer's body, or None when it is longer than limit bytes (the rest left unread)."""
    if response.content_length is not None and response.content_length > limit:
        return None
    chunks, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
