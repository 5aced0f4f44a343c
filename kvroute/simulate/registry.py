"""The policies `kvroute bench simulate` compares, by name, each made fresh for a run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.pd_peers import DynamoPD, LlmdPD, VllmRouterPD
from kvroute.simulate.peer_queues import DynamoQueued, LlmdQueued
from kvroute.simulate.peer_thunderagent import DynamoThunderAgent
from kvroute.simulate.peer_vllm_router import (
    VllmRouterKvAwareAffinity,
    VllmRouterKvAwarePrograms,
    VllmRouterSticky,
)
from kvroute.simulate.peers import ConsistentHash, DynamoCost, PowerOfTwo, SGLangCacheAware, VllmRouterKvAware
from kvroute.simulate.policies import ConfiguredPolicy, Replicas, SimPolicy, priors_for, router_config
from router.config import RouterConfig
from scorers.policy_config import PolicyConfig, ScorerSpec
from scorers.ttft_model import TTFTPriors

LLMD_SCRAPE_S = 0.05  # llm-d scrapes the engines' /metrics every 50 ms


def _configured(
    name: str, policy: str, calibrate: bool = True, hardware_priors: bool = False, **options: object
) -> Callable[[FleetSpec], SimPolicy]:
    """policy from the configuration; its TTFT priors kvroute's defaults, or with hardware_priors those of an
    operator who measured the simulated hardware (priors_for)."""

    def make(fleet: FleetSpec) -> SimPolicy:
        priors = priors_for(fleet) if hardware_priors else TTFTPriors()
        config = router_config(fleet, priors.model_copy(update={"calibrate": calibrate}))
        return ConfiguredPolicy(name, config, policy, calibrate=calibrate, **options)  # type: ignore[arg-type]

    return make


def _llmd_config(fleet: FleetSpec) -> RouterConfig:
    """llm-d's precise prefix-cache profile: precise-prefix 2, kv-cache-utilization 1, queue 1, max score."""
    config = router_config(fleet)
    config.policies["llm-d"] = PolicyConfig(
        scorers=[
            ScorerSpec(type="precise-prefix", weight=2.0),
            ScorerSpec(type="kv-usage", weight=1.0),
            ScorerSpec(type="queue-depth", weight=1.0),
        ]
    )
    return config


def _llmd(fleet: FleetSpec) -> SimPolicy:
    """llm-d's precise prefix-cache profile. Its index has no pool tier, so GPU blocks only; it reads the
    engines' metrics scraped every 50 ms, and its admission (flow control off, its default) sheds
    negative-priority requests while they read saturated."""
    config = _llmd_config(fleet)
    return ConfiguredPolicy(
        "llm-d",
        config,
        "llm-d",
        decide=False,
        include_pool=False,
        calibrate=False,
        scrape_interval_s=LLMD_SCRAPE_S,
        shed_sheddable=True,
    )


def _with_section(
    name: str, section: Literal["flow_control", "programs"], **settings: object
) -> Callable[[FleetSpec], SimPolicy]:
    """kvroute's default with one section's settings changed (flow_control enabled=False: sent on arrival)."""

    def make(fleet: FleetSpec) -> SimPolicy:
        config = router_config(fleet)
        changed = getattr(config, section).model_copy(update=settings)
        return ConfiguredPolicy(name, config.model_copy(update={section: changed}), "kvroute")

    return make


def _with_flow_control(name: str, **settings: object) -> Callable[[FleetSpec], SimPolicy]:
    return _with_section(name, "flow_control", **settings)


def _dynamo_queued(name: str, policy: Literal["fcfs", "wspt"]) -> Callable[[FleetSpec], SimPolicy]:
    return lambda fleet: DynamoQueued(name, policy, fleet.engine.max_batched_tokens)


POLICIES: dict[str, Callable[[FleetSpec], SimPolicy]] = {
    "round-robin": _configured("round-robin", "round-robin", calibrate=False, decide=False, lookup=False),
    "consistent-hash": lambda fleet: ConsistentHash(),
    "power-of-two": lambda fleet: PowerOfTwo(),
    "sglang-cache-aware": lambda fleet: SGLangCacheAware(),
    "llm-d": _llmd,
    "llm-d+flow-control": lambda fleet: LlmdQueued(
        "llm-d+flow-control", _llmd_config(fleet), "llm-d", LLMD_SCRAPE_S
    ),
    "dynamo": lambda fleet: DynamoCost(),
    "dynamo+queue-fcfs": _dynamo_queued("dynamo+queue-fcfs", "fcfs"),
    "dynamo+queue-wspt": _dynamo_queued("dynamo+queue-wspt", "wspt"),
    "vllm-router-kv-aware": lambda fleet: VllmRouterKvAware(),
    "vllm-router-kv-aware+affinity": lambda fleet: VllmRouterKvAwareAffinity(),
    "vllm-router-kv-aware+programs": lambda fleet: VllmRouterKvAwarePrograms(),
    "dynamo+thunderagent": lambda fleet: DynamoThunderAgent(),
    "vllm-router-sticky": lambda fleet: VllmRouterSticky(),
    "kvroute-no-queue": _with_flow_control("kvroute-no-queue", enabled=False),
    "kvroute": _configured("kvroute", "kvroute"),
}


def _with_scorer(name: str, scorer: str, weight: float) -> Callable[[FleetSpec], SimPolicy]:
    """kvroute's default plus one scorer at weight."""

    def make(fleet: FleetSpec) -> SimPolicy:
        config = router_config(fleet)
        config.policies[name] = PolicyConfig(
            scorers=[*config.policies["kvroute"].scorers, ScorerSpec(type=scorer, weight=weight)]
        )
        return ConfiguredPolicy(name, config, name)

    return make


def _reweighted(
    name: str, scorer: str, weight: float, params: dict[str, object] | None = None
) -> Callable[[FleetSpec], SimPolicy]:
    """kvroute's default with one of its scorers at another weight (and with params, when given)."""

    def make(fleet: FleetSpec) -> SimPolicy:
        config = router_config(fleet)
        scorers = [
            ScorerSpec(type=spec.type, weight=weight, params=spec.params if params is None else params)
            if spec.type == scorer
            else spec
            for spec in config.policies["kvroute"].scorers
        ]
        config.policies[name] = PolicyConfig(scorers=scorers)
        return ConfiguredPolicy(name, config, name)

    return make


def _with_program_room(name: str, weight: float) -> Callable[[FleetSpec], SimPolicy]:
    """kvroute's default with the program-room scorer at weight (0: none)."""

    def make(fleet: FleetSpec) -> SimPolicy:
        config = router_config(fleet)
        scorers = [spec for spec in config.policies["kvroute"].scorers if spec.type != "program-room"]
        if weight:
            scorers.append(ScorerSpec(type="program-room", weight=weight))
        config.policies[name] = PolicyConfig(scorers=scorers)
        return ConfiguredPolicy(name, config, name)

    return make


def _with_memory_hold(fleet: FleetSpec) -> SimPolicy:
    """kvroute's default with requests held in the router, up to 5 s, while no instance has memory."""
    config = router_config(fleet)
    admission = config.admission.model_copy(update={"memory_hold_s": 5.0})
    config = config.model_copy(update={"admission": admission})
    return ConfiguredPolicy("kvroute+memory-hold", config, "kvroute")


def _with_context_load(
    name: str, tokens_weight: float, requests_weight: float
) -> Callable[[FleetSpec], SimPolicy]:
    """kvroute's default with in-flight load counted in context tokens at tokens_weight, and in requests at
    requests_weight (0: left out)."""

    def make(fleet: FleetSpec) -> SimPolicy:
        config = router_config(fleet)
        scorers = [spec for spec in config.policies["kvroute"].scorers if spec.type != "inflight-load"]
        scorers.append(
            ScorerSpec(type="inflight-load", weight=tokens_weight, params={"count": "context_tokens"})
        )
        if requests_weight:
            scorers.append(ScorerSpec(type="inflight-load", weight=requests_weight))
        config.policies[name] = PolicyConfig(scorers=scorers)
        return ConfiguredPolicy(name, config, name)

    return make


def _in_flight_multiplied(fleet: FleetSpec) -> SimPolicy:
    """kvroute's default with ttft-cost's in_flight_exponent at 1: each predicted TTFT x (requests in flight
    + 1), vllm-router kv_aware's multiplier, for the median when KV memory is saturated."""
    config = router_config(fleet)
    scorers = [
        ScorerSpec(type=spec.type, weight=spec.weight, params={**spec.params, "in_flight_exponent": 1.0})
        if spec.type == "ttft-cost"
        else spec
        for spec in config.policies["kvroute"].scorers
    ]
    config.policies["kvroute-in-flight-x"] = PolicyConfig(scorers=scorers)
    return ConfiguredPolicy("kvroute-in-flight-x", config, "kvroute-in-flight-x")


def _replicas(
    name: str, count: int, by_session: bool, share_s: float | None = None
) -> Callable[[FleetSpec], SimPolicy]:
    """count kvroute routers with the default policy in front of the fleet, telling each other their load
    every share_s seconds, or sharing nothing."""

    def make(fleet: FleetSpec) -> SimPolicy:
        return Replicas(name, lambda: POLICIES["kvroute"](fleet), count, by_session, share_s)

    return make


# Variants of kvroute's own configuration, run only when named: what an operator could change.
EXTRA_POLICIES: dict[str, Callable[[FleetSpec], SimPolicy]] = {
    "kvroute+hw-priors": _configured("kvroute+hw-priors", "kvroute", hardware_priors=True),
    "kvroute-priors": _configured("kvroute-priors", "kvroute", calibrate=False, hardware_priors=True),
    "token-cost": _configured("token-cost", "token-cost", calibrate=False, hardware_priors=True),
    # llm-d's kv-cache-utilization scorer: the engines' KV occupancy, which the TTFT model does not see
    "kvroute+kv-usage": _with_scorer("kvroute+kv-usage", "kv-usage", 0.5),
    # a new agent program placed where it fits, other than the default's 2 (0: as before it was the default)
    "kvroute-program-room-0": _with_program_room("kvroute-program-room-0", 0.0),
    "kvroute-program-room-1": _with_program_room("kvroute-program-room-1", 1.0),
    "kvroute-program-room-4": _with_program_room("kvroute-program-room-4", 4.0),
    # room enough only with the whole cache free: a new program scores the KV share its instance has free
    "kvroute-program-room-whole": _reweighted(
        "kvroute-program-room-whole", "program-room", 2.0, {"room": 1.0}
    ),
    # program room without its bound on programs over an instance's even share: new sessions by room alone
    "kvroute-program-room-by-room": _reweighted(
        "kvroute-program-room-by-room", "program-room", 2.0, {"over_even_share": None}
    ),
    # the spread scorer (placements lately, KV in use) weighed as the TTFT cost is, not at 0.1
    "kvroute-spread-1": _reweighted("kvroute-spread-1", "spread", 1.0),
    # agent programs admitted and paused by their KV working sets (router/programs/admission.py)
    "kvroute+program-admission": _with_section(
        "kvroute+program-admission", "programs", start_below=1.0, pause_above=0.95, pause_to=0.9
    ),
    # a program's next turn prefilled while its tool runs, where it is foreseen to go without its KV
    "kvroute+warm-up": _with_section("kvroute+warm-up", "programs", warm_up=True),
    "kvroute+program-admission+warm-up": _with_section(
        "kvroute+program-admission+warm-up",
        "programs",
        start_below=1.0,
        pause_above=0.95,
        pause_to=0.9,
        warm_up=True,
    ),
    "kvroute+memory-hold": _with_memory_hold,
    "kvroute-queue-fcfs": _with_flow_control("kvroute-queue-fcfs", ordering="fcfs"),
    "kvroute-queue-edf": _with_flow_control("kvroute-queue-edf", ordering="edf"),
    "kvroute-in-flight-x": _in_flight_multiplied,
    "kvroute+context-load": _with_context_load("kvroute+context-load", 0.3, 0.0),
    "kvroute+both-load": _with_context_load("kvroute+both-load", 0.3, 0.3),
    "kvroute+both-load-half": _with_context_load("kvroute+both-load-half", 0.15, 0.3),
    "kvroute-2-routers": _replicas("kvroute-2-routers", 2, by_session=True),
    "kvroute-2-routers-per-request": _replicas("kvroute-2-routers-per-request", 2, by_session=False),
    "kvroute-4-routers": _replicas("kvroute-4-routers", 4, by_session=True),
    "kvroute-2-routers-sharing": _replicas("kvroute-2-routers-sharing", 2, by_session=True, share_s=0.05),
    "kvroute-2-routers-per-request-sharing": _replicas(
        "kvroute-2-routers-per-request-sharing", 2, by_session=False, share_s=0.05
    ),
    "kvroute-4-routers-sharing": _replicas("kvroute-4-routers-sharing", 4, by_session=True, share_s=0.05),
    # three replicas behind a round-robin balancer, as `kvroute bench live` runs kvroute-replicas:3[+shared]
    "kvroute-3-routers-per-request": _replicas("kvroute-3-routers-per-request", 3, by_session=False),
    "kvroute-3-routers-per-request-sharing": _replicas(
        "kvroute-3-routers-per-request-sharing", 3, by_session=False, share_s=0.05
    ),
}


def _kvroute_pd(fleet: FleetSpec) -> SimPolicy:
    """kvroute's builtin policy in front of the disaggregated fleet, with disaggregation's defaults
    (local_prefill_max_tokens 256), its legs sent through the conductor as the proxy sends them."""
    return ConfiguredPolicy("kvroute", router_config(fleet), "kvroute")


def _llmd_pd(fleet: FleetSpec) -> SimPolicy:
    config = router_config(fleet)
    config.policies["llm-d-pd"] = PolicyConfig(
        scorers=[ScorerSpec(type="precise-prefix", weight=2.0), ScorerSpec(type="queue-depth", weight=1.0)]
    )
    return LlmdPD(
        "llm-d",
        config,
        "llm-d-pd",
        decide=False,
        include_pool=False,
        calibrate=False,
        scrape_interval_s=LLMD_SCRAPE_S,
    )


# The routers of a disaggregated fleet (--pd), each with its own P/D algorithm.
PD_POLICIES: dict[str, Callable[[FleetSpec], SimPolicy]] = {
    "vllm-router": lambda fleet: VllmRouterPD(),
    "llm-d": _llmd_pd,
    "dynamo": lambda fleet: DynamoPD(),
    "kvroute": _kvroute_pd,
}


def policies_for(fleet: FleetSpec) -> dict[str, Callable[[FleetSpec], SimPolicy]]:
    """The policies a run on fleet can be given, by name."""
    return dict(PD_POLICIES) if fleet.pd is not None else {**POLICIES, **EXTRA_POLICIES}
