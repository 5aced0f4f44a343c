"""What one attempt's reply means for its request, read from the reply alone: the client's answer, another
instance's turn, or the error that ends the request. Every kind of reply is read here, in one table; the send
loop (router/dispatch/place/attempts.py) carries the verdict out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from router.dispatch.observe.outcome import BUSY
from router.dispatch.observe.routing_headers import ATTEMPTS_HEADER
from router.dispatch.place.failures import REFUSED_CREDENTIALS
from router.dispatch.place.sending import Sent
from router.errors import (
    RETRY_AFTER_S,
    OpenAIError,
    unavailable,
    upstream_failed,
    upstream_redirected,
    upstream_timeout,
    upstream_unauthorized,
)

# Why an instance passed the request on: the error the client gets if no other instance answers either, the
# first kind found in this order.
Failure = Literal["dropped", "refused", "redirected"]
FAILURES: tuple[Failure, ...] = ("dropped", "refused", "redirected")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with one attempt. When it does not serve the client, the attempt is abandoned (failed,
    admitted, withdraw: as Outcome.abandon takes them), and the request either ends with `ends` or goes on to
    another instance."""

    serves: bool = False  # the reply is the client's, whatever its status
    counted: str | None = None  # the kind of upstream error counted against the instance
    failed: bool = True  # counted against the instance's circuit breaker
    admitted: bool = True  # the engine may have held its context (it was sent)
    withdraw: bool = False  # the engine computed nothing of it, or lost it: its speculative blocks go
    unreachable: bool = False  # the instance is down for now
    retried: bool = False  # counted as a retry at the instance
    back_off: bool = False  # the next attempt waits the retry policy's backoff first
    lost_transfer: bool = False  # a prefill leg's KV the instance may have fetched is gone with it
    ends: OpenAIError | None = None  # no other instance may take it: the request fails with this
    failure: tuple[Failure, OpenAIError] | None = None  # the client's error if no instance is left


SERVES = Verdict(serves=True)


def judge(sent: Sent, instance: str, stream: bool, may_retry: Callable[[], bool]) -> Verdict:
    """The verdict on what came of an attempt at instance; may_retry: whether another attempt is allowed
    (attempts and retry budget left, an instance with room), asked only where it matters."""
    if sent.kind == "not_connected":
        # Nothing was sent: safe to try another instance, and this one is down for now.
        return Verdict(counted="connect", admitted=False, withdraw=True, unreachable=True)
    if sent.kind == "dropped":
        # Sent, but the connection broke before the first byte (the instance died or restarted, or closed a
        # kept-alive connection as it was reused): the client has had nothing yet, so another instance may
        # serve it, within the retry budget. One drop does not mark the instance down (a request every engine
        # drops would black out the model): its circuit breaker counts it, and a dead instance refuses the
        # next connection. What it computed before dying went with it, and so did a prefill leg's KV it may
        # have fetched (the prefill instance let it go).
        assert isinstance(sent.error, Exception)
        error = upstream_failed(instance, sent.error)
        retry = may_retry()
        failure: tuple[Failure, OpenAIError] = ("dropped", error)
        return Verdict(
            counted="disconnected",
            withdraw=True,
            retried=retry,
            back_off=retry,
            lost_transfer=True,
            ends=None if retry else error,
            failure=failure,
        )
    if sent.kind in ("timed_out", "bad_answer"):
        # Timed out or answered badly: it may still be running there, so it is not sent again.
        assert sent.error is not None
        if sent.kind == "timed_out":
            limit = "first_byte_timeout_s" if stream else "response_timeout_s"
            return Verdict(counted="timeout", ends=upstream_timeout(instance, limit))
        return Verdict(counted="response", ends=upstream_failed(instance, sent.error))
    assert sent.upstream is not None
    return _answered(sent, instance, may_retry)


def _answered(sent: Sent, instance: str, may_retry: Callable[[], bool]) -> Verdict:
    """An answer came: it is the client's, unless the instance refused the router's key, redirected, or was
    busy with another instance left to try. Those ran nothing, so another instance may take the request."""
    assert sent.upstream is not None
    status = sent.upstream.status
    if status in REFUSED_CREDENTIALS:
        # The router's key (clients' never reach engines), which vLLM checks before anything else. Counted
        # against this instance's breaker.
        failure: tuple[Failure, OpenAIError] = ("refused", upstream_unauthorized(instance, status))
        return Verdict(counted="unauthorized", admitted=False, withdraw=True, failure=failure)
    if 300 <= status < 400:
        # Not followed: what the instance's URL leads to is no instance the index and the load accounting know
        # (an ingress redirecting to https, a moved host), and aiohttp would send a 301's or 302's POST on as
        # a GET. Counted against its breaker.
        location = sent.upstream.headers.get("Location", "")
        failure = ("redirected", upstream_redirected(instance, status, location))
        return Verdict(counted="redirect", admitted=False, withdraw=True, failure=failure)
    if status == BUSY and may_retry():
        # vLLM's admission control (--max-num-queued-reqs, --max-num-queued-tokens) and a fleet being scaled
        # refuse with 503 before anything runs, asking for "a different instance". The last instance's 503
        # reaches the client, with its Retry-After.
        return Verdict(counted="busy", failed=False, admitted=False, withdraw=True, retried=True)
    return SERVES


def none_answered(model: str, tried: set[str], failures: Mapping[Failure, OpenAIError]) -> OpenAIError:
    """Why no instance answered, once none is left to try: the last instance's that passed it on, of the first
    kind in FAILURES; else none could be reached (tried) or none was there."""
    for kind in FAILURES:
        if kind in failures:
            return with_attempts(failures[kind], tried)
    if tried:
        message, code = f"No instance serving `{model}` could be reached.", "upstream_unreachable"
    else:
        message, code = f"No healthy instance serves `{model}` right now.", "no_healthy_instance"
    return with_attempts(unavailable(message + " Retry later.", code, RETRY_AFTER_S), tried)


def with_attempts(error: OpenAIError, tried: set[str]) -> OpenAIError:
    """error, saying how many instances the request was sent to, as an answer does."""
    error.headers[ATTEMPTS_HEADER] = str(len(tried))
    return error
