"""What peer routers have in flight of each limited flow and objective, so that a limit is one limit.

Flow control's per-flow and per-objective limits (router/dispatch/wait/flow_control.py) hold for the tenant,
not for each replica: every router tells its peers, in its load snapshot (router/upstreams/peer_sync.py), its
limited flows' requests in flight and the prompt tokens it sent since the last snapshot. Each counts the
latest in-flight counts of every peer against a flow's ``max_in_flight`` beside its own, and takes the tokens
its peers sent out of its own token bucket for the flow. A request let go into a flow at half its limit in
flight or more sends the next snapshot at once (PeerSync.nudge), so that near its limit a count lags by the
snapshot's transit, and tokens by an interval: for that long several routers may each let go a request into
the last slot, so a limit may be passed by at most the requests let go in that time; a peer that goes silent
counts no more.
"""

from __future__ import annotations

from collections.abc import Mapping


def flow_key(flow: str) -> str:
    return f"flow:{flow}"


def objective_key(objective: str) -> str:
    return f"objective:{objective}"


class FlowsElsewhere:
    def __init__(self) -> None:
        self._by_peer: dict[str, Mapping[str, int]] = {}  # peer -> key -> its requests in flight
        self._totals: dict[str, int] = {}

    def in_flight(self, key: str) -> int:
        """The peers' requests in flight of a flow or objective (flow_key, objective_key)."""
        return self._totals.get(key, 0)

    def heard(self, peer: str, in_flight: Mapping[str, int]) -> None:
        """A peer's latest counts, which replace its earlier ones."""
        self.forget(peer)
        counted = {key: n for key, n in in_flight.items() if n > 0}
        if counted:
            self._by_peer[peer] = counted
            totals = self._totals
            for key, n in counted.items():
                totals[key] = totals.get(key, 0) + n

    def forget(self, peer: str) -> None:
        earlier = self._by_peer.pop(peer, None)
        if earlier is None:
            return
        totals = self._totals
        for key, n in earlier.items():
            left = totals.get(key, 0) - n
            if left > 0:
                totals[key] = left
            else:
                totals.pop(key, None)
