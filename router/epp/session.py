"""One request's ext_proc streams: its headers and body in, where it goes out; then what Envoy tells of the
answer it relays (status, served endpoint, first and last bytes), told to the request's Outcome.

Envoy fails a request whose stream to the picker breaks while the picker may still change it, so the stream
that decides (fail closed) ends as soon as it has (routing only: configs/envoy-epp.yaml), and what follows
comes on streams Envoy lets go when they break (fail open), which name the request by a key Envoy's dynamic
metadata carries: an observing stream, opened as soon as the request is routed, that does not wait (the
answer's body: its first chunk is the first byte, a stream's TTFT sample; a whole answer is read to its end
for its usage), and an answering stream that waits at the answer's headers (status, served endpoint;
kvroute's headers added) and is held open to the end of the request. The answering stream ends the outcome
and frees the admission slot when it closes, however the request ended (answered, or the client left); the
observer's first chunk, on a stream of its own, may come just after. A request over before its answer began
has no answering stream: the observing stream's end, or nothing following the decision, ends it.

A gateway that does not split them (the Gateway API Inference Extension's, one ext_proc filter) shows the
routing stream the answer too, and holds it open to the end: it is followed there, as the answering stream.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from typing import Any

from router.dispatch.context import FlowTicket
from router.dispatch.observe.outcome import Outcome
from router.dispatch.observe.routing_headers import routing_headers
from router.epp import messages
from router.epp.picking import Picker, Routed
from router.errors import OpenAIError, too_large

_MAX_ANSWER_BYTES = 1 << 20  # of a whole answer, kept to read its usage; a larger one is not read
# How long an ended request waits for the observing stream's first chunk, which may have been sent before the
# answering stream closed and come after it (another gRPC stream); none comes when the client left first.
_OBSERVER_GRACE_S = 1.0
# How long a routed request waits for a stream to follow it once the routing stream has ended: Envoy opens the
# observing one as it passes the routed request on, at once; none comes when the request was gone by then.
_FOLLOWED_WITHIN_S = 5.0


class GatewayAnswer:
    """An answer the gateway relays itself: only its status reaches the picker, and nothing to release."""

    __slots__ = ("status",)

    def __init__(self, status: int) -> None:
        self.status = status

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class Exchanges:
    """The routing streams with a request in flight, by the key the observing streams name them with."""

    def __init__(self, picker: Picker, max_body_bytes: int) -> None:
        self._picker, self._max_body_bytes = picker, max_body_bytes
        # Unique to this process: a request routed by a picker that has since restarted names a key the new
        # one has never given, not another request's.
        self._prefix = secrets.token_hex(4)
        self._keys = itertools.count(1)
        self._open: dict[str, Exchange] = {}

    def new(self) -> Exchange:
        key = f"{self._prefix}-{next(self._keys)}"
        return Exchange(self._picker, self._max_body_bytes, key, self._open)

    def get(self, key: str | None) -> Exchange | None:
        return None if key is None else self._open.get(key)


class Exchange:
    def __init__(self, picker: Picker, max_body_bytes: int, key: str, open_: dict[str, Exchange]) -> None:
        self._picker, self._max_body_bytes = picker, max_body_bytes
        self._key, self._open = key, open_
        self._headers: dict[str, str] = {}
        self._subset: frozenset[str] | None = None
        self._body = bytearray()
        self._duplex_request = self._duplex_response = False
        self._routed: Routed | None = None
        self._ticket: FlowTicket | None = None  # the routed request's place in flow control
        self._outcome: Outcome | None = None  # the attempt the answer is told to, until it ends
        self._holds_slot = False
        self._answer: GatewayAnswer | None = None  # once the answer's first byte came
        self._whole = bytearray()  # a whole (not streamed) answer, for its usage
        self._status = 0
        self._relayed = False  # the routing stream shows the answer's body (no observer needed)
        self._observed = False  # the observing stream showed what there was to learn, or closed
        self._body_follows = False  # the answer's headers came, and a body after them
        self._grace: asyncio.TimerHandle | None = None
        self.decided = False  # the request's last message is answered: the routing stream has no more to do
        self._followed = False  # an observing or answering stream named this request
        self._answering = False  # the answer's headers came on the stream held open to the request's end
        self._unfollowed: asyncio.TimerHandle | None = None

    async def on(self, message: Any) -> list[Any]:
        """The answers to one message from Envoy: none while a full-duplex body is still coming."""
        phase = message.WhichOneof("request")
        if phase == "request_headers":
            return await self._request_headers(message)
        if phase == "request_body":
            return await self._request_body(message.request_body)
        if phase == "request_trailers":
            # Full duplex: a body with trailers has no last chunk; its route is known at the trailers.
            routing = await self._route(end=False) if self._routed is None and self._duplex_request else []
            self.decided = True
            return [*routing, messages.passed(phase)]
        if phase == "response_headers":
            return [self._response_headers(message)]
        if phase == "response_body":
            return self._response_body(message.response_body)
        return [messages.passed(phase)]

    def routing_closed(self) -> None:
        """A routing-only stream ended, the request decided: a routed one that no stream follows (it was gone
        before Envoy passed it on) is over after a while."""
        if self._key in self._open and not self._followed:
            self._unfollowed = asyncio.get_running_loop().call_later(_FOLLOWED_WITHIN_S, self._close_now)

    def follow(self) -> None:
        """An observing or answering stream names this request: those now tell its end."""
        self._followed = True
        if self._unfollowed is not None:
            self._unfollowed.cancel()
            self._unfollowed = None

    def close(self) -> None:
        """The answering stream is over, and so is the request (Envoy holds it open until then): an answer
        still counted as running ends here, and one that never began is taken back. An answer whose first
        chunk the observer has not shown yet waits a little for it."""
        waits = self._outcome is not None and self._body_follows and not (self._relayed or self._observed)
        if waits:
            self._grace = asyncio.get_running_loop().call_later(_OBSERVER_GRACE_S, self._close_now)
        else:
            self._close_now()

    def observed(self, chunk: Any) -> bool:
        """A chunk of the answer's body from the observing stream (Envoy relays it without waiting): the
        first is the first byte; a whole answer is read to its end for its usage. False: nothing more to
        learn (the observing stream may end)."""
        outcome = self._outcome
        if outcome is None:
            return False
        self._first_byte(outcome)
        more = not outcome.streamed and not chunk.end_of_stream
        if not outcome.streamed and len(self._whole) + len(chunk.body) <= _MAX_ANSWER_BYTES:
            self._whole += chunk.body
        if chunk.end_of_stream:
            self._ended(outcome)
        if not more:
            self.observer_closed()
        return more

    def observer_closed(self) -> None:
        """The observing stream ended: an ended request waiting for it is over, and so is a routed one whose
        answer never began (the observer of a routing-only stream stays until the answer's first chunk)."""
        self._observed = True
        if self._grace is not None:
            self._grace.cancel()
            self._close_now()
        elif self._followed and not self._answering:
            self._close_now()

    def _close_now(self) -> None:
        self._grace = self._unfollowed = None
        self._open.pop(self._key, None)
        outcome, self._outcome = self._outcome, None
        if outcome is not None:
            if self._answer is not None:
                # The observer does not see a stream's end: one the routing stream did not relay is taken as
                # answered whole (Envoy does not tell the picker whether the client left first).
                if not self._relayed:
                    outcome.complete()
                outcome.finish()
            else:
                outcome.abandon(None, failed=False)
        if self._holds_slot:
            self._holds_slot = False
            self._picker.leave(self._ticket)

    async def _request_headers(self, message: Any) -> list[Any]:
        self._duplex_request, self._duplex_response = messages.full_duplex(message)
        self._headers = messages.header_map(message.request_headers.headers)
        self._subset = messages.subset_hint(message)
        if message.request_headers.end_of_stream:  # no body (a GET): routed now
            return await self._route(end=True, body_follows=False)
        # Full duplex: the headers' answer waits for the body, whose prompt decides where they go.
        return [] if self._duplex_request else [messages.passed("request_headers")]

    async def _request_body(self, chunk: Any) -> list[Any]:
        self._body += chunk.body
        if len(self._body) > self._max_body_bytes:
            return [self._refused(too_large(self._max_body_bytes))]
        if not chunk.end_of_stream:
            return [] if self._duplex_request else [messages.passed("request_body")]
        return await self._route(end=True)

    async def _route(self, end: bool, body_follows: bool = True) -> list[Any]:
        raw = bytes(self._body)
        headers = self._headers
        try:
            routed = await self._picker.route(
                headers.get(":method", ""), headers.get(":path", ""), headers, raw, self._subset
            )
        except OpenAIError as error:
            return [self._refused(error)]
        self.decided = end
        self._routed, self._outcome = routed, routed.outcome
        # Kept apart from the outcome, which an answer Envoy made itself drops before the request is over.
        self._ticket = None if routed.outcome is None else routed.outcome.ticket
        self._holds_slot = routed.outcome is not None
        key = None
        if routed.outcome is not None:
            key = self._key
            self._open[key] = self
        if self._duplex_request or not body_follows:
            return messages.routed(routed.endpoints, routed.body if body_follows else None, end, key)
        (answer,) = messages.routed(routed.endpoints, None, exchange=key)
        return [messages.as_body_answer(answer, None if routed.body == raw else routed.body)]

    def _refused(self, error: OpenAIError) -> Any:
        self.decided = True
        # As the router's HTTP app counts them: its own 429s where they are decided, 5xx as upstream trouble.
        if error.status < 500 and error.status != 429:
            self._picker.metrics.client_errors(str(error.code)).inc()
        return messages.immediate(error)

    def _response_headers(self, message: Any) -> Any:
        self.follow()
        self._answering = True
        headers = messages.header_map(message.response_headers.headers)
        remove = [messages.SERVED_KEY] if messages.SERVED_KEY in headers else []
        outcome, routed = self._outcome, self._routed
        if outcome is None or routed is None:
            return messages.response_headers({}, remove)
        self._status = int(headers.get(":status", "0") or 0)
        served = messages.served_endpoint(message, headers)
        if served is None and self._status >= 500:
            # Envoy answered itself: none of the endpoints could be reached (or Envoy gave up on them).
            self._outcome = None
            outcome.abandon(None, failed=True, admitted=False, withdraw=True)
            outcome.observers.request_failed(outcome.policy)
            self._picker.metrics.upstream_errors(outcome.instance.name, "gateway").inc()
            return messages.response_headers({}, remove)
        if served is not None and served != routed.endpoints[0] and served in routed.endpoints:
            fallback = routed.fallbacks[routed.endpoints.index(served) - 1]
            outcome = self._outcome = self._picker.moved(routed, outcome, fallback)
        if message.response_headers.end_of_stream:
            self._first_byte(outcome)
            self._ended(outcome)
        else:
            self._body_follows = True
        return messages.response_headers(routing_headers(outcome), remove)

    def _response_body(self, chunk: Any) -> list[Any]:
        outcome = self._outcome
        self._relayed = True
        if outcome is not None:
            self._first_byte(outcome)
            if not outcome.streamed and len(self._whole) + len(chunk.body) <= _MAX_ANSWER_BYTES:
                self._whole += chunk.body
            if chunk.end_of_stream:
                self._ended(outcome)
        if self._duplex_response:
            return messages.streamed_body(chunk.body, request=False, end=chunk.end_of_stream)
        return [messages.passed("response_body")]

    def _first_byte(self, outcome: Outcome) -> None:
        """The answer's first byte reached the gateway: a stream's is its TTFT sample."""
        if self._answer is None:
            self._answer = GatewayAnswer(self._status)
            outcome.answered(self._answer, b"", outcome.attempts)

    def _ended(self, outcome: Outcome) -> None:
        """The answer's last byte went through: told once everywhere, as kvroute serve tells it."""
        if outcome.streamed:
            outcome.complete()
        else:
            outcome.completed_whole(bytes(self._whole))
        self._outcome = None
        outcome.finish()
        if self._holds_slot:
            self._holds_slot = False
            self._picker.leave(self._ticket)
