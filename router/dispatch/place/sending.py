"""Send one attempt to one instance and say what came of it; the retry policy both legs share.

An attempt is sent, and its first bytes read (a stream's first chunk, a whole answer), within its limits.
What came of it is one of: answered (any status: the send loop judges it), not connected (nothing was sent),
dropped (sent, and the connection broke before an answer), timed out, or answered badly. A client that
leaves cancels it: the connection is closed, so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import aiohttp

from router.dispatch.decide.decision import Decider
from router.dispatch.observe.observers import Observers
from router.dispatch.place.failures import DROPPED, NOT_CONNECTED
from router.dispatch.place.retry_budget import RetryBudget
from router.upstreams.instances import Instance, Upstreams
from router.upstreams.room import HasRoom
from router.upstreams.settings import UpstreamConfig

SentKind = Literal["answered", "not_connected", "dropped", "timed_out", "bad_answer"]
RETRY_BACKOFF_S = 0.05  # before a retry, per instance tried, jittered
# Of a whole answer, this much is held before the client gets it (its usage read, an error put in OpenAI's
# shape); past it, the rest is relayed as it arrives (router/dispatch/answer/relay.py), so that a request
# holds no more than this of its answer. vLLM's answers are kilobytes; logprobs of thousands of tokens, a
# megabyte.
WHOLE_HELD_BYTES = 4 * 2**20
# The most of an answer read at once. aiohttp's reader raises its buffer's high-water mark to twice the
# largest read asked of it: one read of WHOLE_HELD_BYTES let it buffer 8 MiB of an engine's answer while the
# client was slower. (readany joins all that is buffered: 7 MiB in one part.)
READ_PART_BYTES = 256 * 2**10


class Outgoing(NamedTuple):
    """One attempt's request to an instance."""

    instance: Instance
    path: str
    payload: bytes
    headers: dict[str, str]
    method: str = "POST"  # or GET, retrieving a stored response (without a body)


class Reply(Protocol):
    """What the send loop reads of an instance's answer: aiohttp's response here (the relay reads its body
    on), or a simulated engine's (kvroute/simulate/)."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def release(self) -> object: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Sent:
    kind: SentKind
    upstream: Reply | None
    first: bytes = b""  # a stream's first chunk or a whole answer, when answered
    error: BaseException | None = None


class Sends(Protocol):
    """What sends attempts: Sender over HTTP, or a simulated fleet's engines (kvroute/simulate/)."""

    async def attempt(self, outgoing: Outgoing, stream: bool) -> Sent: ...

    async def prefill(self, outgoing: Outgoing) -> Sent: ...


class MarksUnreachable(Protocol):
    """What routes around an instance a request could not reach (router/upstreams/health.py)."""

    def mark_unreachable(self, instance: Instance) -> None: ...


class Sender:
    def __init__(self, session: aiohttp.ClientSession, config: UpstreamConfig) -> None:
        self._session, self._first_byte_s = session, config.first_byte_timeout_s
        self._response_s = config.response_timeout_s
        # sock_connect, not connect: aiohttp's connect timeout also runs while a request waits for a pooled
        # connection, and a busy instance is not an unreachable one. No read has a socket timeout: a stream's
        # first chunk gets first_byte_timeout_s and every later one stream_idle_timeout_s (aiohttp's sock_read
        # would hold every chunk to the first one's limit), and a whole answer response_timeout_s in all (a
        # socket timeout would let an answer that drips a byte at a time go on for ever).
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=None
        )

    async def attempt(self, outgoing: Outgoing, stream: bool) -> Sent:
        """A request the client waits for: a stream's first byte comes after prefill (first_byte_timeout_s),
        a whole answer only after the last token (response_timeout_s, from sending it)."""
        limit = self._first_byte_s if stream else self._response_s
        return await self._send(outgoing, stream, limit)

    async def prefill(self, outgoing: Outgoing) -> Sent:
        """A prefill leg: one token, whole, within the client's first-byte limit."""
        return await self._send(outgoing, False, self._first_byte_s)

    async def _send(self, outgoing: Outgoing, stream: bool, limit_s: float) -> Sent:
        instance, path, payload, headers, method = outgoing
        upstream: aiohttp.ClientResponse | None = None
        try:
            sent = {**headers, **instance.headers} if instance.headers else headers
            async with asyncio.timeout(limit_s):
                upstream = await self._session.request(
                    method,
                    instance.url + path,
                    data=payload if method == "POST" else None,
                    headers=sent,
                    timeout=self._timeout,
                    allow_redirects=False,  # where it leads is no instance the index knows (attempts.py)
                )
                first = await _first_bytes(upstream, stream)
        except NOT_CONNECTED as exc:
            return Sent("not_connected", upstream, error=exc)
        except DROPPED as exc:
            return Sent("dropped", upstream, error=exc)
        except TimeoutError as exc:  # aiohttp's read timeout is one too
            return Sent("timed_out", upstream, error=exc)
        except aiohttp.ClientError as exc:
            return Sent("bad_answer", upstream, error=exc)
        except BaseException:
            if upstream is not None:
                upstream.close()  # not released to the pool: the engine must see the connection go (abort)
            raise
        return Sent("answered", upstream, first)


async def _first_bytes(upstream: aiohttp.ClientResponse, stream: bool) -> bytes:
    """A successful stream's first chunk; otherwise the whole answer, up to WHOLE_HELD_BYTES of it, also when
    a stream was asked for and a whole answer came (a gateway in front of the engine)."""
    if not (stream and streams_events(upstream)):
        return await _held(upstream.content, WHOLE_HELD_BYTES)
    first = await upstream.content.readany()
    if not first:  # a 200 stream that ends before its first chunk is broken, not empty
        raise aiohttp.ServerDisconnectedError()
    return first


async def _held(content: aiohttp.StreamReader, limit: int) -> bytes:
    """An answer's first limit bytes; all of it when it is no longer, and content is then at its end."""
    parts: list[bytes] = []
    held = 0
    while held < limit and (part := await content.read(min(limit - held, READ_PART_BYTES))):
        parts.append(part)
        held += len(part)
    return b"".join(parts)


def streams_events(upstream: aiohttp.ClientResponse) -> bool:
    """Whether an answer is relayed event by event: a successful stream. Anything else, an error above all
    (whatever its content type), is an answer in one piece."""
    return upstream.status == 200 and upstream.content_type == "text/event-stream"


class RetryPolicy:
    """How many attempts a request gets, and the retry budget that bounds retries of sent requests to a share
    of the traffic (router/dispatch/place/retry_budget.py), for both legs."""

    def __init__(self, attempts: int, budget: RetryBudget | None = None) -> None:
        self.attempts = attempts
        self._budget = budget or RetryBudget()

    def earn(self) -> None:
        """A request came: it earns a share of a retry."""
        self._budget.earn()

    def may_retry(self, attempt: int, another_has_room: bool) -> bool:
        """Whether a request whose attempt failed may go to another instance: an attempt left, an instance
        not tried with room for it, and the retry budget, spent only then."""
        return attempt + 1 < self.attempts and another_has_room and self._budget.spend()

    async def back_off(self, tried: int) -> None:
        await asyncio.sleep(RETRY_BACKOFF_S * tried * random.uniform(0.5, 1.5))


@dataclass(frozen=True)
class SendContext:
    """What both legs' send loops work with."""

    upstreams: Upstreams
    decider: Decider
    observers: Observers
    health: MarksUnreachable
    sender: Sends
    retry: RetryPolicy
    room: HasRoom  # the filter of instances with room for one more request
