"""What decides a request's policy, as one value: the policies, the traffic split, its headers and the A/B
results. A reload or the admin API builds a new table and puts it in place whole; a request keeps the table it
started with, so it never sees half of a change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from router.config import RouterConfig
from router.dispatch.intake.settings import TrafficConfig
from router.dispatch.observe.ab import ABStats
from router.errors import bad_request
from router.traffic_split import TrafficSplit
from scorers.policy import Policy

_DISCARDED = ABStats(max_samples=1)  # results of policies a reload replaced: never read


@dataclass(frozen=True)
class RoutingTable:
    policies: Mapping[str, Policy]
    split: TrafficSplit
    traffic: TrafficConfig
    ab: ABStats = field(default_factory=ABStats)  # carried from table to table

    @classmethod
    def from_config(cls, config: RouterConfig) -> RoutingTable:
        policies = {name: Policy(name, policy) for name, policy in config.policies.items()}
        return cls(policies, TrafficSplit(config.traffic_weights()), config.traffic)

    def policy_for(self, forced: str | None, session: str | None) -> Policy:
        """forced: the policy a request names in traffic.force_header; else the split picks by session."""
        if forced is None:
            return self.policies[self.split.policy_for(session)]
        policy = self.policies.get(forced)
        if policy is None:
            known = ", ".join(self.policies)
            message = f"Unknown policy {forced!r} in {self.traffic.force_header}; known: {known}."
            raise bad_request(message, "unknown_policy")
        return policy

    def ab_for(self, policy: Policy) -> ABStats:
        """Where policy's A/B results go: nowhere once a reload has replaced or removed it, so that a policy
        defined afresh under its name starts from nothing, whatever the old one still had in flight."""
        return self.ab if self.policies.get(policy.name) is policy else _DISCARDED

    def with_split(self, weights: Mapping[str, float]) -> RoutingTable:
        """The same table with another split (ValueError when the weights cannot make one)."""
        return replace(self, split=TrafficSplit(weights))

    def reloaded(self, old: RouterConfig, new: RouterConfig) -> tuple[RoutingTable, list[str]]:
        """The table for configuration new, and the policies it redefined or added.

        A policy whose definition stays keeps its state (session affinity, round-robin position); one
        redefined starts afresh, and so do its A/B results, which would otherwise mix two policies. A removed
        one's results go too: added back later, it starts afresh. A split set at runtime (PUT /admin/traffic)
        stays unless the file's own split changed or the running one names a policy that is gone; order
        counts, as the first policy is the A/B baseline and the ranges are laid out in order."""
        kept = {name: p for name, p in self.policies.items() if new.policies.get(name) == p.config}
        for name in self.policies.keys() - kept.keys():
            self.ab.forget(name)
        policies = {name: kept.get(name) or Policy(name, config) for name, config in new.policies.items()}
        split = self.split
        changed = list(new.traffic_weights().items()) != list(old.traffic_weights().items())
        if changed or not split.weights.keys() <= new.policies.keys():
            split = TrafficSplit(new.traffic_weights())
        table = RoutingTable(policies, split, new.traffic, self.ab)
        return table, [name for name in new.policies if name not in kept]
