"""kvroute's router in the simulation: the product's conductor (router/dispatch/conductor.py), its stages
built as router/runtime.py builds them, on the trace's clock (kvroute/simulate/trace_loop.py), sending to
the simulated engines.

A trace request reaches it as a client sends it: a streamed completion whose prompt is the request's token
ids (kvroute/simulate/blocks.py), with the headers that name its session, its tenant and its objective. So
every stage a request goes through in `kvroute serve` (admission, prepare, flow control, the program and
memory gates, filter, pick, the attempts and their retries, what an outcome tells) is the product's own; only
the bytes' way differs: EngineSender hands an attempt to its engine and answers with the engine's first token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvroute.simulate.clock import EventLoop
from kvroute.simulate.disaggregation import prefill_leg
from kvroute.simulate.engine import Engine, SimRequest, warm_up_of
from kvroute.simulate.pool import StoreLookup
from kvroute.simulate.view import RouterView
from router.apis.routes import COMPLETIONS
from router.config import RouterConfig
from router.dispatch.assembly import Hooks, RouterParts, build_stages, share_with_peers
from router.dispatch.conductor import Conductor
from router.dispatch.context import Arrival, Received
from router.dispatch.decide.decision import Decider, DeciderOptions, Prepared
from router.dispatch.intake.routing_table import RoutingTable
from router.dispatch.observe.events import Event
from router.dispatch.observe.outcome import Outcome
from router.dispatch.place.sending import Outgoing, Sent
from router.dispatch.wait.flow_gate import FlowGate
from router.index.pool import PoolConfirmer
from router.metrics import RouterMetrics
from router.programs.table import followed
from router.traffic_split import TrafficSplit
from router.upstreams.instances import Instance, Upstreams
from router.upstreams.peer_sync import PeerEndpoints, PeerSync
from scorers.policy import Policy

PATH = "/v1/completions"
REQUEST_ID = "x-request-id"  # what names the trace request an attempt is of, to its engine
_FIRST_CHUNK = b'data: {"object":"text_completion","choices":[{"index":0,"text":" "}]}\n\n'
_TRANSFER = "sim_transfer"  # what names a prefill leg's KV in the kv_transfer_params: its request's number
_BUSY = b'{"error":{"message":"The engine is at capacity.","type":"ServiceUnavailable","code":503}}'


class _Sent(msgspec.Struct):
    """What the simulated engine reads of a request's body."""

    priority: int = 0  # vLLM's: the lowest runs first, with its priority scheduling policy
    # A prefill leg's (do_remote_decode), or a decode leg's: the transfer this sender named in the prefill
    # leg's answer, as NixlConnector's prefill answer names the KV the decode leg fetches.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class EngineReply:
    """An engine's answer as the send loop reads it (router/dispatch/place/sending.py Reply)."""

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class EngineSender:
    """Sends each attempt to its simulated engine (router/dispatch/place/sending.py Sends): a request's answer
    begins at its first token; an engine that refuses it answers 503, as vLLM's admission control does. On a
    disaggregated fleet a prefill leg is a one-token request whose engine keeps the prompt's KV until the
    decode leg that names its transfer fetched it (kvroute/simulate/engine.py)."""

    def __init__(self, loop: EventLoop, engines: list[Engine], view: RouterView) -> None:
        self._loop, self._engines, self._view = loop, engines, view
        # By x-request-id, every one the clients sent: a warm-up after an answer sends its prompt again.
        self.requests: dict[str, SimRequest] = {}
        self._first: dict[int, asyncio.Future[None]] = {}  # by request number
        self._whole: dict[int, asyncio.Future[None]] = {}  # a warm-up's or a prefill leg's, by its id()
        self._legs: dict[int, SimRequest] = {}  # by request number: a prefill leg whose KV is to be fetched
        self.warm_ups = 0

    async def attempt(self, outgoing: Outgoing, stream: bool) -> Sent:
        request = self.requests[outgoing.headers[REQUEST_ID]]
        number = self._view.by_name[outgoing.instance.name]
        request.instance, request.dispatched_s = number, self._loop.now
        sent = msgspec.json.decode(outgoing.payload, type=_Sent)
        request.priority = sent.priority
        # A decode leg fetches the prefill leg's KV its params name; a whole request computes its prompt.
        params = sent.kv_transfer_params
        fetches = params is not None and params.get(_TRANSFER) == request.number
        request.prefill = self._legs[request.number] if fetches else None
        first = self._first[request.number] = asyncio.get_running_loop().create_future()
        if not self._engines[number].enqueue(request):
            del self._first[request.number]
            request.tried |= {number}  # (what ConductedRun counts retries by)
            return Sent("answered", EngineReply(503), _BUSY)
        if request.prefill is None:
            self.release(request)  # a prefill leg no decode leg fetches (its request is served whole)
        else:
            del self._legs[request.number]  # its KV is this engine's to fetch now
        await first
        return Sent("answered", EngineReply(200, {"content-type": "text/event-stream"}), _FIRST_CHUNK)

    async def prefill(self, outgoing: Outgoing) -> Sent:
        """A prefill leg, or a program's next turn warmed up (router/dispatch/place/warm_up.py): its prompt,
        one token."""
        request = self.requests[outgoing.headers[REQUEST_ID]]
        number = self._view.by_name[outgoing.instance.name]
        sent = msgspec.json.decode(outgoing.payload, type=_Sent)
        if sent.kv_transfer_params is None:
            self.warm_ups += 1
            one = warm_up_of(request, number, self._loop.now)
        else:
            self.release(request)  # a leg computed before whose decode leg no instance took
            one = prefill_leg(request, number)
            one.sent_s = one.dispatched_s = self._loop.now
            one.priority = sent.priority
        done = self._whole[id(one)] = asyncio.get_running_loop().create_future()
        if not self._engines[number].enqueue(one):
            del self._whole[id(one)]
            return Sent("answered", EngineReply(503), _BUSY)
        await done
        if one.warm_up:
            return Sent("answered", EngineReply(200, {"content-type": "application/json"}), b"{}")
        self._legs[request.number] = one
        params = {"do_remote_prefill": True, "remote_engine_id": str(number), _TRANSFER: request.number}
        answer = msgspec.json.encode({"object": "text_completion", "kv_transfer_params": params})
        return Sent("answered", EngineReply(200, {"content-type": "application/json"}), answer)

    def release(self, request: SimRequest) -> None:
        """The prefill leg of request whose KV no decode leg fetched: freed on its engine."""
        leg = self._legs.pop(request.number, None)
        if leg is not None:
            self._engines[leg.instance].release(leg)

    def first_token(self, request: SimRequest) -> None:
        if not request.warm_up and request.prefills is None:
            self._first.pop(request.number).set_result(None)

    def finished(self, request: SimRequest) -> None:
        if request.warm_up or request.prefills is not None:
            self._whole.pop(id(request)).set_result(None)


@dataclass(frozen=True, slots=True)
class _ClientHeaders:
    """The headers a client names its session, tenant and objective in, by the router's configuration."""

    session: str
    flow: str
    objective: str


class SimulatedRouter:
    """One kvroute router in front of the simulated fleet: its conductor, over view's index and instances."""

    def __init__(
        self,
        config: RouterConfig,
        policy_name: str,
        view: RouterView,
        sender: EngineSender,
        peers: PeerEndpoints | None = None,
    ) -> None:
        """peers: with replicas that share their state, how often this one tells them (share())."""
        clock, metrics = view.loop.clock, RouterMetrics()
        upstreams = Upstreams(config, view.instances)
        self.flow_gate = flow_gate = FlowGate(config.flow_control, upstreams, metrics, clock)
        room_freed = Event()
        programs = followed(
            config.programs, metrics, upstreams.program_working_set, upstreams.kv_capacity, clock
        )
        pool = None
        if view.pool is not None:
            # The simulated instances' pool keys carry no pool name: the index files their blocks under "".
            lookup = StoreLookup(view.pool)
            ttl_s = config.pool.confirm_ttl_s
            pool = PoolConfirmer(view.index, lookup, {view.model: ""}, metrics, ttl_s, clock)
        options = DeciderOptions(pool=pool, programs=programs)
        self.decider = decider = Decider(view.index, {}, view.block_size, metrics, options=options)
        # Session affinity's TTL on the trace's clock; ties broken by the run's seed, so that a run repeats.
        policy = Policy(policy_name, config.policies[policy_name], clock, view.tie_rng)
        table = RoutingTable({policy_name: policy}, TrafficSplit({policy_name: 1.0}), config.traffic)
        self._parts = RouterParts(
            config, metrics, upstreams, flow_gate, decider, programs, room_freed, _Reachable(), sender
        )
        self.peers = (
            None if peers is None else PeerSync(peers, upstreams, metrics, None, room_freed.fire, clock)
        )
        sent_large = None if self.peers is None else self.peers.nudge
        stages = build_stages(self._parts, Hooks(table.ab_for, sent_large, clock))
        self._policies = lambda: table.policies.values()
        self.conductor = Conductor(stages, lambda: table, config.tokenization)
        self.model = view.model
        self._sender = sender
        flows = config.flow_control
        self._headers = _ClientHeaders(
            config.traffic.session_header, flows.fairness_headers[0], flows.objective_headers[0]
        )

    async def serve(self, request: SimRequest, prompt: list[int], name: str) -> Outcome:
        """request through the conductor, as `kvroute serve` takes a streamed completion of prompt: the
        outcome whose first token came (or the last instance's 503), or the OpenAIError that ended it; name:
        its x-request-id."""
        traced = request.trace
        body = {"model": self.model, "prompt": prompt, "max_tokens": traced.output_tokens, "stream": True}
        headers = {REQUEST_ID: name, "content-type": "application/json"}
        named = self._headers
        if request.session is not None:
            headers[named.session] = request.session
        if traced.flow is not None:
            headers[named.flow] = traced.flow
        if traced.objective is not None:
            headers[named.objective] = traced.objective
        arrival = Arrival(msgspec.json.encode(body), COMPLETIONS, headers)
        conductor = self.conductor

        async def send(received: Received, prepared: Prepared) -> Outcome:
            return await conductor.send(received, prepared, PATH)

        self._sender.requests[name] = request
        return await conductor.conduct(arrival, send)

    def share(self, send: Callable[[bytes], Awaitable[None]]) -> dict[str, Callable[[], Awaitable[None]]]:
        """Its snapshots sent with send (to the other replicas, through their store); the loops that publish
        them and forget peers gone silent (router/upstreams/peer_sync.py), for the run to run."""
        assert self.peers is not None, "a router that shares nothing was told to share"
        self.peers.send_also(send)
        share_with_peers(self.peers, self._parts, self._policies)
        return self.peers.loops()

    def ended(self, outcome: Outcome) -> None:
        """Its answer's last token came (or its error was all of it): the outcome told, its slot freed."""
        if outcome.status == 200:
            outcome.complete()
        if outcome.finish():
            self.conductor.leave(outcome.ticket)

    def close(self) -> None:
        self.decider.close()


class _Reachable:
    """A simulated engine is always reachable: nothing marks one down."""

    def mark_unreachable(self, instance: Instance) -> None:
        raise AssertionError(f"a simulated engine ({instance.name}) was unreachable")
