"""The prefill leg of a disaggregated request, and what both legs carry.

A model served by prefill and decode instances answers in two legs, as vLLM's disaggregated serving and the
peers' routers do. The decode instance is chosen first (router/dispatch/place/attempts.py), for what it holds
and its load. Unless it holds all but a few of the prompt's tokens, a prefill instance chosen by the same
policy computes the prompt's KV: `max_tokens` 1, no stream, `kv_transfer_params` asking for a remote decode.
Then the decode leg, which answers the client, fetches that KV through the connector instead of computing it:
- NixlConnector: the prefill answer's `kv_transfer_params` are what the decode leg sends;
- MooncakeConnector: the prefill answer's are null. The router names the transfer (a `transfer_id` both legs
  carry), and the decode leg names the prefill instance's engine and bootstrap server.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from router.dispatch.context import Received
from router.dispatch.decide.decision import Decision, Prepared
from router.dispatch.observe.cached_tokens import reported_cached_tokens
from router.dispatch.observe.outcome import BUSY, Asked, Outcome, Part
from router.dispatch.place.failures import NOT_THE_REQUESTS_FAULT
from router.dispatch.place.sending import Outgoing, SendContext, Sent
from router.dispatch.place.settings import KVConnector
from router.errors import upstream_timeout
from router.tracing.spans import Trace
from router.upstreams.instances import Instance

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Transfer:
    """A prompt's KV, computed on a prefill instance and ready for a decode instance to fetch."""

    instance: Instance  # the prefill instance
    params: dict[str, Any]  # the decode leg's kv_transfer_params
    cached_tokens: int | None = None  # the prompt tokens the prefill answer reports it found cached


class NoPrefill(Exception):
    """No prefill instance computed the prompt (none up, all failed, or one refused the request as the client
    sent it): the decode instance computes it, and answers as an aggregated instance would."""


class _Answer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode
# What could end the prefill leg before its one token, or make it more than a prefill.
_ENDS_EARLY = frozenset({"stream_options", "stop", "stop_token_ids", "include_stop_str_in_output"})
_encode = msgspec.json.Encoder().encode


def prefill_body(body: dict[str, Any], connector: KVConnector, transfer_id: str) -> bytes:
    """The client's request as the prefill leg: one token, whole, its KV kept for a remote decode. The token
    must end the leg by length: the connectors keep a prompt's KV for the decode leg only then, so a first
    token that is EOS or completes a stop string would leave the decode leg waiting for KV that is gone
    (MooncakeConnector, until VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s)."""
    leg = {key: value for key, value in body.items() if key not in _ENDS_EARLY}
    leg |= {"stream": False, "max_tokens": 1, "ignore_eos": True}
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    if "min_tokens" in leg:
        leg["min_tokens"] = 1
    params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    if connector == "mooncake":
        params["transfer_id"] = transfer_id
    else:  # the fields NixlConnector fills in for the decode leg
        params |= dict.fromkeys(("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"))
    leg["kv_transfer_params"] = params
    return _encode(leg)


def decode_leg_body(body: dict[str, Any], transfer: Transfer) -> bytes:
    """The client's request as the decode leg: its KV fetched from the prefill instance."""
    return _encode({**body, "kv_transfer_params": transfer.params})


def mooncake_params(instance: Instance, transfer_id: str) -> dict[str, Any]:
    """What MooncakeConnector's decode leg needs: the transfer, and where the prefill instance serves it."""
    endpoint = instance.transfer
    assert endpoint is not None  # the configuration requires both of a prefill instance
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_engine_id": endpoint.engine_id,
        "remote_bootstrap_addr": endpoint.bootstrap_url,
    }


def prefill_leg_worth_it(decision: Decision, local_prefill_max_tokens: int) -> bool:
    """Whether a prefill leg should compute the prompt rather than the decode instance decision chose: it
    would compute more than local_prefill_max_tokens itself (what it holds or loads from the pool it does
    not), or the router cannot tell."""
    return decision.prompt_tokens == 0 or decision.uncached_tokens > local_prefill_max_tokens


class PrefillLeg:
    def __init__(self, context: SendContext, connector: KVConnector, local_prefill_max_tokens: int) -> None:
        self._context, self._connector, self._local_max = context, connector, local_prefill_max_tokens

    def worth_it(self, decision: Decision) -> bool:
        return prefill_leg_worth_it(decision, self._local_max)

    async def transfer_for(
        self, received: Received, prepared: Prepared, path: str, body: dict[str, Any], decode_instance: str
    ) -> Transfer:
        """Compute the prompt's KV on the best prefill instance (not the decode one), trying another when one
        cannot be reached, drops the request or fails it, within the attempts and the retry budget. The
        request's trace gets a span for the leg (its decisions and attempts beneath)."""
        with received.trace.step("prefill") as leg:
            transfer = await self._run(received, prepared, path, body, decode_instance, leg)
            leg.set("kvroute.prefill_instance", transfer.instance.name)
            return transfer

    async def _run(
        self,
        received: Received,
        prepared: Prepared,
        path: str,
        body: dict[str, Any],
        decode_instance: str,
        leg: Trace,
    ) -> Transfer:
        context, policy, headers = self._context, received.policy, received.headers
        model = prepared.request.model
        asked = Asked(policy, model, streamed=False)
        tried = {decode_instance}
        for attempt in range(context.retry.attempts):
            prefill_capable = context.upstreams.candidates(model, exclude=frozenset(tried), leg="prefill")
            candidates = context.room.filter(prepared.request, prefill_capable)
            if not candidates:
                break
            if attempt and not context.retry.may_retry(attempt - 1, another_has_room=True):  # a retry
                break
            decision = context.decider.decide(prepared, policy.prefill_leg, candidates, leg)
            instance = decision.instance
            tried.add(instance.name)
            transfer_id = uuid.uuid4().hex
            outcome = Outcome.start(context.observers, decision, asked, None, Part("prefill"))
            payload = prefill_body(body, self._connector, transfer_id)
            with leg.attempt(instance, attempt, "prefill") as span:
                try:
                    sent = await context.sender.prefill(
                        Outgoing(instance, path, payload, span.headers(headers))
                    )
                except BaseException:  # the client left: the engine aborts the leg
                    outcome.abandon(None, failed=False)
                    raise
                span.sent(sent.kind, 0 if sent.upstream is None else sent.upstream.status)
                transfer = await self._transfer(sent, outcome, transfer_id, len(tried) - 1)
            if transfer is not None:
                return transfer
        raise NoPrefill("no prefill instance took it")

    async def _transfer(
        self, sent: Sent, outcome: Outcome, transfer_id: str, attempts: int
    ) -> Transfer | None:
        """The KV a prefill leg computed, ready to fetch; None: another prefill instance may try."""
        instance, upstream, metrics = outcome.instance, sent.upstream, self._context.observers.metrics
        if sent.kind == "not_connected":
            outcome.abandon(upstream, admitted=False, withdraw=True)
            metrics.upstream_errors(instance.name, "connect").inc()
            self._context.health.mark_unreachable(instance)
            return None
        if sent.kind == "dropped":
            outcome.abandon(upstream, withdraw=True)
            metrics.upstream_errors(instance.name, "disconnected").inc()
            await self._context.retry.back_off(1)
            return None
        if sent.kind == "timed_out":
            # The prompt may still be computing there; the client has waited its first-byte limit.
            outcome.abandon(upstream)
            metrics.upstream_errors(instance.name, "timeout").inc()
            raise upstream_timeout(instance.name, "first_byte_timeout_s") from sent.error
        if sent.kind == "bad_answer":
            outcome.abandon(upstream, failed=False)
            assert sent.error is not None
            raise sent.error
        assert upstream is not None
        answer = sent.first
        outcome.answered(upstream, answer, attempts=attempts)
        outcome.first_byte(decoded_tokens=1)
        outcome.complete()
        outcome.finish()
        status = upstream.status
        if status == 200:
            params = self._params(instance, transfer_id, answer)
            if params is not None:
                return Transfer(instance, params, reported_cached_tokens(answer))
            metrics.upstream_errors(instance.name, "no_transfer_params").inc()
            return None
        if 400 <= status < 500 and status not in NOT_THE_REQUESTS_FAULT:
            # Refused as the client sent it: the decode instance answers it, with the engine's own error.
            raise NoPrefill(f"{instance.name} answered {status}")
        metrics.upstream_errors(instance.name, "busy" if status == BUSY else "response").inc()
        return None

    def _params(self, instance: Instance, transfer_id: str, answer: bytes) -> dict[str, Any] | None:
        """The decode leg's kv_transfer_params; None when a NixlConnector prefill answer has none (the
        instance is no KV producer)."""
        if self._connector == "mooncake":
            return mooncake_params(instance, transfer_id)
        try:
            params = _decode_answer(answer).kv_transfer_params
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            params = None
        if params is None:
            log.warning("%s answered a prefill leg with no kv_transfer_params: no producer?", instance.name)
        return params
