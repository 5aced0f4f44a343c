"""The prefill leg of a disaggregated request, and what both legs carry.

A model served by prefill and decode instances answers in two legs, as vLLM's disaggregated serving and the
peers' routers do. The decode instance is chosen first (router/dispatch/attempts.py), for what it holds and
its load. Unless it holds all but a few of the prompt's tokens, a prefill instance chosen by the same policy
computes the prompt's KV: `max_tokens` 1, no stream, `kv_transfer_params` asking for a remote decode. Then the
decode leg, which answers the client, fetches that KV through the connector instead of computing it:
- NixlConnector: the prefill answer's `kv_transfer_params` are what the decode leg sends;
- MooncakeConnector: the prefill answer's are null. The router names the transfer (a `transfer_id` both legs
  carry), and the decode leg names the prefill instance's engine and bootstrap server.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from router.config import KVConnector, UpstreamConfig
from router.dispatch.cached_tokens import reported_cached_tokens
from router.dispatch.decision import Decider, Decision, Prepared
from router.dispatch.failures import DROPPED, NOT_CONNECTED
from router.dispatch.outcome import BUSY, Observers, Outcome
from router.dispatch.retry_budget import RetryBudget
from router.errors import upstream_timeout
from router.metrics import RouterMetrics
from router.upstreams.health import HealthChecker
from router.upstreams.instances import Instance, Upstreams
from router.upstreams.room import with_room
from scorers.policy import Policy

log = logging.getLogger(__name__)

_RETRY_BACKOFF_S = 0.05


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


def decode_body(body: dict[str, Any], transfer: Transfer) -> bytes:
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
    def __init__(
        self,
        upstreams: Upstreams,
        decider: Decider,
        observers: Observers,
        session: aiohttp.ClientSession,
        health: HealthChecker,
        metrics: RouterMetrics,
        config: UpstreamConfig,
        connector: KVConnector,
        local_prefill_max_tokens: int,
        per_instance_limit: int,
        retry_budget: RetryBudget,
        max_waiting: int | None = None,
    ) -> None:
        self._upstreams, self._decider, self._observers = upstreams, decider, observers
        self._session, self._health, self._metrics, self._config = session, health, metrics, config
        self._connector, self._local_max = connector, local_prefill_max_tokens
        self._per_instance_limit, self._retry_budget = per_instance_limit, retry_budget
        self._max_waiting = max_waiting
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=None
        )

    def worth_it(self, decision: Decision) -> bool:
        return prefill_leg_worth_it(decision, self._local_max)

    async def run(
        self,
        prepared: Prepared,
        policy: Policy,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        decode_instance: str,
    ) -> Transfer:
        """Compute the prompt's KV on the best prefill instance (not the decode one), trying another when one
        cannot be reached, drops the request or fails it, within the attempts and the retry budget."""
        model = prepared.request.model
        tried = {decode_instance}
        for attempt in range(self._config.attempts):
            prefill_capable = self._upstreams.candidates(model, exclude=frozenset(tried), leg="prefill")
            candidates = with_room(prefill_capable, self._per_instance_limit, self._max_waiting)
            if not candidates:
                break
            if attempt and not self._retry_budget.spend():
                break
            decision = self._decider.decide(prepared, policy.prefill_leg, candidates)
            instance = decision.instance
            tried.add(instance.name)
            transfer_id = uuid.uuid4().hex
            outcome = Outcome.start(self._observers, decision, policy, model, False, None, leg="prefill")
            upstream: aiohttp.ClientResponse | None = None
            try:
                sent = {**headers, **instance.headers} if instance.headers else headers
                async with asyncio.timeout(self._config.first_byte_timeout_s):
                    upstream = await self._session.post(
                        instance.url + path,
                        data=prefill_body(body, self._connector, transfer_id),
                        headers=sent,
                        timeout=self._timeout,
                    )
                    answer = await upstream.read()
            except NOT_CONNECTED:
                outcome.abandon(upstream, admitted=False, withdraw=True)
                self._metrics.upstream_errors(instance.name, "connect").inc()
                self._health.mark_unreachable(instance)
                continue
            except DROPPED:
                outcome.abandon(upstream, withdraw=True)
                self._metrics.upstream_errors(instance.name, "disconnected").inc()
                await asyncio.sleep(_RETRY_BACKOFF_S * random.uniform(0.5, 1.5))
                continue
            except TimeoutError as exc:
                # The prompt may still be computing there; the client has waited its first-byte limit.
                outcome.abandon(upstream)
                self._metrics.upstream_errors(instance.name, "timeout").inc()
                raise upstream_timeout(instance.name, "first_byte_timeout_s") from exc
            except BaseException:  # the client left (the engine aborts the leg), or a bad answer
                outcome.abandon(upstream, failed=False)
                raise
            outcome.answered(upstream, answer, attempts=len(tried) - 1)
            outcome.first_byte(decoded_tokens=1)
            outcome.completed = True
            outcome.finish()
            status = upstream.status
            if status == 200:
                params = self._params(instance, transfer_id, answer)
                if params is not None:
                    return Transfer(instance, params, reported_cached_tokens(answer))
                self._metrics.upstream_errors(instance.name, "no_transfer_params").inc()
                continue
            if 400 <= status < 500 and status not in (401, 403, 429):
                # Refused as the client sent it: the decode instance answers it, with the engine's own error.
                raise NoPrefill(f"{instance.name} answered {status}")
            self._metrics.upstream_errors(instance.name, "busy" if status == BUSY else "response").inc()
        raise NoPrefill("no prefill instance took it")

    def _params(self, instance: Instance, transfer_id: str, answer: bytes) -> dict[str, Any] | None:
        """The decode leg's kv_transfer_params; None when a NixlConnector prefill answer has none (the
        instance is no KV producer)."""
        if self._connector == "mooncake":
            return mooncake_params(instance, transfer_id)
        try:
            params = _decode_answer(answer).kv_transfer_params
        except (msgspec.DecodeError, RecursionError):
            params = None
        if params is None:
            log.warning("%s answered a prefill leg with no kv_transfer_params: no producer?", instance.name)
        return params
