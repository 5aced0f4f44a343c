"""Routers in front of the same fleet tell each other their load: the snapshots, and their ZMQ transport.

Every interval_s each router publishes a snapshot of what it has in flight on each instance, and counts its
peers' latest with its own (router/upstreams/peer_load.py). A snapshot stands alone: a lost one is replaced by
the next, a router that restarts starts from nothing, and one that stops publishing drops out after
stale_after_s. Replicas send their snapshots over the shared store's channel and find each other there
(router/shared/snapshots.py); the workers of `serve --workers` send theirs over ZMQ, each binding a PUB socket
on an ipc:// endpoint of its own and subscribing to its siblings' (PeerEndpoints).

Wire format: one frame, msgpack of `{"router": ID, "instances": {NAME: {"in_flight": N, "active_tokens": N,
"pending_prefill_tokens": N}}, "flows": {KEY: {"in_flight": N, "tokens": N}}, "sessions": {SESSION: NAME},
"programs": [[SESSION, NAME, N], ...], "seq": N}`, ID a random id a router draws at start. "sessions" are the
turns it placed since its last snapshot (the router's digest of a session's key, and the instance), which its
peers' session affinity follows. "programs" are the agent programs' turns it started since then (the
instance, and the prompt's tokens) and ended (NAME ""), which its peers' program tables follow
(router/programs/shared.py). "flows"
are flow control's limited flows and objectives (KEY "flow:NAME" or "objective:NAME"): their requests in
flight here and the prompt tokens sent since the last snapshot, so that each router counts its peers'
against one limit (router/dispatch/wait/flows_elsewhere.py). Loads are maps, so a later version may add
fields that this one ignores (a rolling upgrade keeps its peers). Snapshots that do not decode are counted
and skipped; instances this router does not route to are left out.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Protocol

import msgspec
import zmq
import zmq.asyncio

from router.metrics import RouterMetrics
from router.upstreams.instances import Upstreams
from router.upstreams.peer_load import PeerLoad, PeerLoads, own_loads

log = logging.getLogger(__name__)

_Count = Annotated[int, msgspec.Meta(ge=0, le=2**40)]  # more is no load, and would repel traffic for good
MAX_PEERS = 64  # routers followed at once; snapshots from more are skipped
_MAX_MESSAGE_BYTES = 2**20
# Between a nudged snapshot and the next: what a burst of let-go requests costs in snapshots (at most 500 a
# second, each a round trip to the store) against how late peers hear of them.
NUDGED_GAP_S = 0.002
# A request sent with a context this large nudges too: its KV memory and prefill weigh on where peers place
# their next requests (two long agent turns placed by two replicas within an interval would otherwise both
# see the instance free), and it takes far longer than a snapshot costs.
NUDGE_CONTEXT_TOKENS = 8192


@dataclass(frozen=True)
class PeerEndpoints:
    """Where this router publishes its snapshots over ZMQ and where its peers do: the sibling workers of
    `kvroute serve --workers` (router/http/workers.py), over ipc:// endpoints of their own. Replicas on other
    hosts share through the store (router/shared/) instead."""

    publish: str | None = None
    subscribe: tuple[str, ...] = ()
    interval_s: float = 0.05  # published this often
    stale_after_s: float = 1.0  # a peer silent this long counts no more


class PeerSyncError(Exception):
    """The router cannot take part: its publish endpoint cannot be bound."""


class InstanceLoad(msgspec.Struct):
    in_flight: _Count = 0
    active_tokens: _Count = 0
    pending_prefill_tokens: _Count = 0


class FlowShare(msgspec.Struct):
    in_flight: _Count = 0
    tokens: _Count = 0  # prompt tokens sent since the last snapshot


class ProgramTurn(msgspec.Struct, array_like=True):
    """A turn of an agent program this router started (at instance, its prompt tokens) or ended (instance
    "")."""

    key: Annotated[str, msgspec.Meta(max_length=256)]
    instance: Annotated[str, msgspec.Meta(max_length=512)]
    tokens: _Count = 0


class PeerSnapshot(msgspec.Struct):
    router: str
    instances: dict[str, InstanceLoad]
    flows: dict[str, FlowShare] = {}
    sessions: dict[str, str] = {}
    programs: list[ProgramTurn] = []
    seq: int = 0  # its router's count of snapshots: one heard twice (over ZMQ and the store) is applied once


class SharedSessions(Protocol):
    """Where sessions' turns were placed (router/dispatch/decide/session_placements.py)."""

    def placed(self) -> dict[str, str]:
        """This router's placements since the last call: session key -> instance."""
        ...

    def heard(self, placements: dict[str, str]) -> None: ...


class SharedPrograms(Protocol):
    """Agent programs' turns (router/programs/shared.py)."""

    def shared(self) -> list[ProgramTurn]:
        """The turns this router started and ended since the last call."""
        ...

    def heard(self, peer: str, turns: list[ProgramTurn]) -> None: ...

    def forget(self, peer: str) -> None: ...


class SharedFlows(Protocol):
    """Flow control's side of the snapshots (router/dispatch/wait/flows_elsewhere.py)."""

    def shared(self) -> dict[str, tuple[int, int]]:
        """This router's limited flows: KEY -> (in flight, tokens sent since the last call)."""
        ...

    def heard(self, peer: str, flows: dict[str, tuple[int, int]]) -> None: ...

    def forget(self, peer: str) -> None: ...


class PeerSync:
    """Publishes this router's load and follows its peers'.

    ```
    sync = PeerSync(PeerEndpoints(publish, follow), fleet, metrics, context, on_change=room_freed.fire)
    sync.start()  # binds and connects: a bad endpoint fails here
    tasks = [asyncio.create_task(loop()) for loop in sync.loops().values()]
    ...
    sync.close()
    ```
    """

    def __init__(
        self,
        config: PeerEndpoints,
        fleet: Upstreams,
        metrics: RouterMetrics,
        context: zmq.asyncio.Context | None,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """context: the ZMQ sockets' (None: snapshots only through send_also, as the simulated replicas
        send theirs); on_change: called after peers' loads changed (a request of theirs may have freed
        memory)."""
        self.router_id = uuid.uuid4().hex[:16]
        self.loads = PeerLoads(config.stale_after_s, clock)
        self._config, self._fleet, self._metrics, self._context = config, fleet, metrics, context
        self._on_change = on_change
        self._flows: SharedFlows | None = None
        self._sessions: SharedSessions | None = None
        self._programs: SharedPrograms | None = None
        self._nudged: asyncio.Event | None = None  # set by nudge(), while publish() runs
        # Where each snapshot goes besides the ZMQ socket: the shared store's channel (router/shared/).
        self._also_sent: list[Callable[[bytes], Awaitable[None]]] = []
        self._sequence = 0
        self._heard_seq: dict[str, int] = {}  # peer -> the last of its snapshots applied
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PeerSnapshot)
        self._publisher: zmq.asyncio.Socket | None = None
        self._subscriber: zmq.asyncio.Socket | None = None

    def share_flows(self, flows: SharedFlows) -> None:
        """Tell peers flow control's counts, and hand it theirs."""
        self._flows = flows

    def share_sessions(self, sessions: SharedSessions) -> None:
        """Tell peers where this router placed sessions' turns, and hand it theirs."""
        self._sessions = sessions

    def share_programs(self, programs: SharedPrograms) -> None:
        """Tell peers the agent programs' turns this router starts and ends, and hand it theirs."""
        self._programs = programs

    def send_also(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Each snapshot is sent with send too (the shared store's channel, whose follower hands peers'
        snapshots to receive()): one snapshot an interval, whatever carries it, since it tells the tokens and
        placements since the last one. Before start()."""
        self._also_sent.append(send)

    def start(self) -> None:
        context = self._context
        if context is None:
            if self._config.publish is not None or self._config.subscribe:
                raise PeerSyncError("the peers' ZMQ endpoints are configured without a ZMQ context")
            return
        if self._config.publish is not None:
            self._publisher = context.socket(zmq.PUB)
            self._publisher.setsockopt(zmq.LINGER, 0)
            self._publisher.setsockopt(zmq.SNDHWM, 16)  # past it a slow subscriber misses snapshots
            try:
                self._publisher.bind(self._config.publish)
            except zmq.ZMQError as exc:
                raise PeerSyncError(
                    f"the peers' publish endpoint {self._config.publish} cannot be bound: {exc}"
                ) from None
        if self._config.subscribe:
            self._subscriber = context.socket(zmq.SUB)
            self._subscriber.setsockopt(zmq.LINGER, 0)
            self._subscriber.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
            self._subscriber.setsockopt(zmq.RCVHWM, 64)
            self._subscriber.setsockopt(zmq.SUBSCRIBE, b"")
            for endpoint in self._config.subscribe:
                self._subscriber.connect(endpoint)

    def loops(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """The background loops start() set up, by name, each to run in a task of its own (supervised); none
        without peers configured, where the sync is a null object."""
        configured = self._config.publish is not None or self._config.subscribe
        if not configured and not self._also_sent:
            return {}
        loops: dict[str, Callable[[], Awaitable[None]]] = {"peers-expire": self.expire_stale}
        if self._publisher is not None or self._also_sent:
            loops["peers-publish"] = self.publish
        if self._subscriber is not None:
            loops["peers-follow"] = self.follow
        return loops

    def close(self) -> None:
        for socket in (self._publisher, self._subscriber):
            if socket is not None:
                socket.close(linger=0)

    def snapshot(self) -> bytes:
        loads = {name: InstanceLoad(*load) for name, load in own_loads(self._fleet.instances).items()}
        own = {} if self._flows is None else self._flows.shared()
        flows = {key: FlowShare(max(n, 0), max(tokens, 0)) for key, (n, tokens) in own.items()}
        sessions = {} if self._sessions is None else self._sessions.placed()
        programs = [] if self._programs is None else self._programs.shared()
        self._sequence += 1
        snapshot = PeerSnapshot(self.router_id, loads, flows, sessions, programs, self._sequence)
        return self._encoder.encode(snapshot)

    def receive(self, message: bytes) -> None:
        """Take one peer's snapshot; malformed ones, this router's own, new peers past MAX_PEERS and one
        heard already (or older than one heard) are counted and skipped."""
        try:
            snapshot = self._decoder.decode(message)
        except (msgspec.DecodeError, UnicodeDecodeError):
            self._metrics.peer_snapshots("malformed").inc()
            return
        if snapshot.router == self.router_id:
            self._metrics.peer_snapshots("own").inc()
            return
        if not self.loads.knows(snapshot.router) and self.loads.peers >= MAX_PEERS:
            self._metrics.peer_snapshots("too_many_peers").inc()
            return
        if snapshot.seq and snapshot.seq <= self._heard_seq.get(snapshot.router, 0):
            self._metrics.peer_snapshots("repeated").inc()
            return
        self._heard_seq[snapshot.router] = snapshot.seq
        self._metrics.peer_snapshots("applied").inc()
        names = {instance.name for instance in self._fleet.instances}
        loads = {
            name: PeerLoad(load.in_flight, load.active_tokens, load.pending_prefill_tokens)
            for name, load in snapshot.instances.items()
            if name in names
        }
        self.loads.update(snapshot.router, loads)
        if self._flows is not None:
            flows = {key: (share.in_flight, share.tokens) for key, share in snapshot.flows.items()}
            self._flows.heard(snapshot.router, flows)
        if self._sessions is not None and snapshot.sessions:
            placed = snapshot.sessions.items()
            self._sessions.heard({key: name for key, name in placed if name in names})
        if self._programs is not None and snapshot.programs:
            turns = [turn for turn in snapshot.programs if not turn.instance or turn.instance in names]
            self._programs.heard(snapshot.router, turns)
        self._apply()

    def skipped(self) -> None:
        """A message that is no snapshot (too large to be one) was not read."""
        self._metrics.peer_snapshots("malformed").inc()

    def expire(self) -> None:
        stale = self.loads.expire()
        for peer in stale:
            self._heard_seq.pop(peer, None)
            if self._flows is not None:
                self._flows.forget(peer)
            if self._programs is not None:
                self._programs.forget(peer)
        if stale:
            self._apply()

    def _apply(self) -> None:
        self.loads.apply(self._fleet.instances)
        self._metrics.peer_routers.set(self.loads.peers)
        self._on_change()

    def nudge(self) -> None:
        """Something peers must hear soon changed (a request let go into a flow near its limit, one with a
        large context sent): the next snapshot goes within NUDGED_GAP_S rather than at the interval's end."""
        if self._nudged is not None:
            self._nudged.set()

    async def publish(self) -> None:
        self._nudged = nudged = asyncio.Event()
        while True:
            nudged.clear()
            message = self.snapshot()
            if self._publisher is not None:
                await self._publisher.send(message)
            for send in self._also_sent:
                await send(message)
            try:
                async with asyncio.timeout(self._config.interval_s):
                    await nudged.wait()
                await asyncio.sleep(NUDGED_GAP_S)  # the nudges of a burst go in one snapshot
            except TimeoutError:
                pass

    async def follow(self) -> None:
        assert self._subscriber is not None
        while True:
            frames = await self._subscriber.recv_multipart()
            if len(frames) != 1:
                self._metrics.peer_snapshots("malformed").inc()
                continue
            self.receive(frames[0])

    async def expire_stale(self) -> None:
        """Forget peers gone silent, whatever else fails (a router that cannot publish still forgets)."""
        while True:
            self.expire()
            await asyncio.sleep(self._config.interval_s)
