"""The conductor's stages built over a router's parts, and what it shares with its peers: the one assembly
`kvroute serve` (router/runtime.py) and the simulated router (kvroute/simulate/conducted.py) both use, so
the simulator runs no copy of it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from router.config import RouterConfig
from router.dispatch.conductor import Stages
from router.dispatch.decide.decision import Decider
from router.dispatch.intake.admission import Admission
from router.dispatch.observe.ab import ABStats
from router.dispatch.observe.events import Event
from router.dispatch.observe.observers import Observers
from router.dispatch.place.attempts import Attempts
from router.dispatch.place.sending import MarksUnreachable, RetryPolicy, SendContext, Sends
from router.dispatch.wait.flow_gate import FlowGate
from router.dispatch.wait.waiting import Waiting
from router.metrics import RouterMetrics
from router.programs.shared import ProgramTurnsShared
from router.programs.table import NoPrograms, Programs
from router.upstreams.instances import Upstreams
from router.upstreams.peer_sync import PeerSync
from router.upstreams.room import HasRoom
from scorers.policy import Policy


@dataclass(frozen=True)
class RouterParts:
    """What a router's stages work over, made by whoever runs it."""

    config: RouterConfig
    metrics: RouterMetrics
    upstreams: Upstreams
    flow_gate: FlowGate
    decider: Decider
    programs: Programs | NoPrograms
    room_freed: Event  # a first byte or an end: requests waiting in the router may go
    health: MarksUnreachable
    sender: Sends


@dataclass(frozen=True)
class Hooks:
    """What the stages tell outside the request's way."""

    ab_for: Callable[[Policy], ABStats]  # the A/B counts of the routing table in force
    sent_large: Callable[[], None] | None = None  # a request with a large context was sent (replicas' sync)
    clock: Callable[[], float] = time.perf_counter  # what attempts are timed by


def build_stages(parts: RouterParts, hooks: Hooks) -> Stages:
    """Admission, the waiting stage, the attempts and the observers over parts, wired as a request meets
    them: an outcome's served and withdrawn decisions go back to the decider, room freed wakes the waiting."""
    config, metrics, decider = parts.config, parts.metrics, parts.decider
    admission = config.admission
    observers = Observers(
        metrics, hooks.ab_for, parts.room_freed, parts.programs, hooks.sent_large, clock=hooks.clock
    )
    observers.served.subscribe(lambda served: decider.served(served.decision, served.policy))
    observers.withdrawn.subscribe(decider.withdraw)
    waiting = Waiting(
        parts.flow_gate, admission.memory_hold_s, parts.upstreams, decider, metrics, parts.programs
    )
    parts.room_freed.subscribe(waiting.wake)
    # One connection per request in flight: a request never waits for a pooled one.
    per_instance = min(admission.max_in_flight_per_instance, config.upstream.max_connections_per_instance)
    sending = SendContext(
        parts.upstreams,
        decider,
        observers,
        parts.health,
        parts.sender,
        RetryPolicy(config.upstream.attempts),
        HasRoom(per_instance, admission.max_waiting_per_instance),
    )
    attempts = Attempts(sending, config.disaggregation, config.programs.warm_up)
    slots = Admission(admission.max_in_flight, admission.queue_size, admission.queue_timeout_s)
    return Stages(parts.upstreams, slots, waiting, decider, attempts, observers)


def share_with_peers(peers: PeerSync, parts: RouterParts, policies: Callable[[], Iterable[Policy]]) -> None:
    """What the router tells its peers and takes from theirs: flow control's counts (a flow let go near its
    limit nudges the next snapshot), where sessions' turns went (heard by policies, those in force), and,
    where it has peers to tell (after PeerSync.send_also), the agent programs' turns."""
    peers.share_flows(parts.flow_gate.control)
    parts.flow_gate.control.on_taken = peers.nudge
    peers.share_sessions(_SessionsShared(parts.decider, policies))
    if isinstance(parts.programs, Programs) and peers.loops():
        peers.share_programs(ProgramTurnsShared(parts.programs))


class _SessionsShared:
    """Where this router placed sessions' turns, told its peers; theirs, told its policies
    (router/upstreams/peer_sync.py's SharedSessions)."""

    def __init__(self, decider: Decider, policies: Callable[[], Iterable[Policy]]) -> None:
        self._decider, self._policies = decider, policies

    def placed(self) -> dict[str, str]:
        return self._decider.sessions_placed()

    def heard(self, placements: dict[str, str]) -> None:
        self._decider.sessions_placed_elsewhere(placements, self._policies())
