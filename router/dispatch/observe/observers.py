"""The parts told what becomes of requests: metrics, the A/B results of the routing table in force, the
requests waiting in the router, the agent programs, and whoever subscribes to a decision served or withdrawn
(the decider: its session placements, its index's speculative blocks). An attempt's Outcome
(router/dispatch/observe/outcome.py) tells them of each attempt; the conductor of a request the place stage
ended with an error."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from router.dispatch.decide.decision import Decision
from router.dispatch.observe.ab import ABStats
from router.dispatch.observe.events import Event, Topic
from router.metrics import RouterMetrics
from router.programs.table import NO_PROGRAMS, NoPrograms, Programs
from scorers.policy import Policy

# The codes of the errors (router/errors.py) that end a request in the place stage: turned away before any
# instance had it, or failed since none answered it.
REJECTED = frozenset(
    {"instances_full", "no_healthy_instance", "no_instance_in_subset", "upstream_unreachable"}
)
FAILED = frozenset({"upstream_failed", "upstream_timeout", "upstream_unauthorized", "upstream_redirected"})


class Served(NamedTuple):
    """A decision an instance answered (a request retried elsewhere counts once), and its policy."""

    decision: Decision
    policy: Policy


@dataclass(frozen=True)
class Observers:
    metrics: RouterMetrics
    ab_for: Callable[[Policy], ABStats]
    room_freed: Event  # a first byte or an end: requests waiting in the router may go
    programs: Programs | NoPrograms = NO_PROGRAMS
    # Told when a request with a context of NUDGE_CONTEXT_TOKENS or more is sent: peers hear of it at once.
    sent_large: Callable[[], None] | None = None
    served: Topic[Served] = field(default_factory=Topic)
    # A decision whose request never ran where it was routed, or whose engine computed nothing of it
    withdrawn: Topic[Decision] = field(default_factory=Topic)
    # What attempts are timed by (a TTFT sample, the client's wait): the simulated router's is the trace's.
    clock: Callable[[], float] = time.perf_counter

    def request_failed(self, policy: Policy) -> None:
        """No instance answered the request: it failed (the A/B counts it against its policy)."""
        self.ab_for(policy).failed(policy.name)

    def request_ended(self, policy: Policy, code: str | int) -> None:
        """The place stage ended the request with an error of this code: turned away (no instance could
        take it), failed (no instance answered it), or neither (the client's own mistake, counted where
        it was found)."""
        if code in REJECTED:
            self.metrics.rejected(str(code)).inc()
            self.ab_for(policy).rejected(policy.name)
        elif code in FAILED:
            self.request_failed(policy)
