"""Routing policies under simulation: kvroute's own, built as the router builds them, and the seam peers use.

kvroute's default policy is the configuration's builtin `kvroute` policy, made by
scorers.policy.Policy from a RouterConfig parsed like an operator's YAML, and decided by
router.dispatch.decide.decision.Decider.decide (which also enters speculative blocks), so the simulation runs
the product's code, not a copy of it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, TypeVar, cast

from kvroute.simulate.engine import SimRequest
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.pool import StoreLookup
from kvroute.simulate.view import RouterView, instance_name
from router.config import RouterConfig, parse_config
from router.dispatch.decide.decision import Decider, Prepared, uncached_at_best
from router.dispatch.intake.engine_priority import engine_priority
from router.dispatch.wait.settings import FlowControlConfig
from router.dispatch.wait.waiting import PROGRAM_TICK_S
from router.index.pool import PoolConfirmer
from router.metrics import RouterMetrics
from router.programs.shared import ProgramTurnsShared
from router.programs.table import Programs, followed
from router.programs.warm_ups import WarmUps
from router.shared.settings import SharedConfig
from router.upstreams.instances import Instance
from router.upstreams.peer_load import PeerLoads, own_loads
from router.upstreams.peer_sync import NUDGE_CONTEXT_TOKENS, NUDGED_GAP_S, ProgramTurn
from router.upstreams.room import with_room
from scorers.policy import Policy
from scorers.request import RoutingRequest
from scorers.ttft_features import features_for
from scorers.ttft_model import TTFTFeatures, TTFTPriors

T = TypeVar("T")

PEERS_STALE_AFTER_S: float = SharedConfig().stale_after_s
# A Redis round trip between replicas on one network, as `kvroute bench store` measured one on a host's
# loopback (0.14 ms for a snapshot's fan-out): the time between a snapshot's publishing and its hearing.
STORE_ROUND_TRIP_S = 0.0002
# The objectives the simulated clients name, by priority: the same for every router that reads them.
# The largest body a simulated client sends: a prompt of token ids (kvroute/simulate/conducted.py)
SIM_BODY_BYTES = 2**30
SIM_OBJECTIVES: dict[str, dict[str, Any]] = {"interactive": {"priority": 10}, "batch": {"priority": -10}}


def _at_once(work: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never waits (its lookups answer at once): simulated time does not pass
    while the router decides."""
    try:
        work.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    work.close()
    raise RuntimeError("a simulated router's lookup waited for something")


class SimPolicy:
    """A router's policy in the simulation: told where requests start, answer and finish."""

    name = "policy"
    scrape_interval_s: float | None = None  # engine /metrics it reads, scraped this often
    memory_hold_s = 0.0  # the router holds requests no instance has memory for
    # (router/dispatch/wait/memory_gate.py)
    sync_interval_s: float | None = None  # sync() runs this often
    flow_control: FlowControlConfig | None = (
        None  # the router queues requests (router/dispatch/wait/flow_control.py)
    )
    priors: TTFTPriors | None = None  # its instances' TTFT models start from these; None: kvroute's defaults
    # With flow_control, a request's flow: its tenant (the trace's flow), else its session; or its tenant
    # alone (a fairness header); or one flow for all.
    queue_flows: Literal["tenant-or-session", "tenant", "one"] = "tenant-or-session"
    queue_reads_metrics = False  # has_room reads the engines' scraped metrics
    routers = 1  # the routers in front of the fleet, each with its own queue (Replicas: several)
    share_latency_s = 0.0  # between routers' snapshots and their peers hearing them (a store's round trip)
    # The request numbers that end their sessions (their last turns): what a client that tells its router a
    # session is over (Dynamo's session_final) marks.
    last_turns: frozenset[int] = frozenset()
    # kvroute's own router: run through the product's conductor (kvroute/simulate/conducted.py)
    conducts = False

    def bind(self, view: RouterView) -> None:
        self.view = view

    def route(self, request: SimRequest) -> int:
        """The instance (its number) for request, not one of request.tried; may set
        request.uncached_estimate."""
        raise NotImplementedError

    def admit(self, request: SimRequest, send: Callable[[SimRequest], None]) -> bool:
        """Whether request goes to route() now, on arrival; False: the policy holds it and calls
        send(request) when it may go (a router's own admission by its own rule)."""
        return True

    def work(self, request: SimRequest) -> float:
        """The uncached tokens request would compute at best, for the router's queue to order by."""
        return float(request.trace.input_tokens)

    def engine_priority(self, request: SimRequest) -> int:
        """vLLM's `priority` the router sends request with (router/dispatch/intake/engine_priority.py): 0 for
        a router that sends none."""
        return 0

    def has_room(self, extra_work: float) -> bool | None:
        """With flow_control, whether its queue lets a request go now by its own rule (a peer's); None: by
        kvroute's (router/dispatch/wait/saturation.py)."""
        return None

    def sheds(self, request: SimRequest) -> bool:
        """Whether the router refuses request on arrival (429) for the fleet's load."""
        return False

    def instances_for(self, request: SimRequest) -> list[Instance]:
        """The bookkeeping of the router that sent request: what it counts in flight on each instance."""
        return self.view.instances

    def router_of(self, request: SimRequest) -> int:
        """Which router request reaches (the load balancer's choice), before its queue."""
        return 0

    def counts_of(self, router: int) -> list[Instance]:
        """What router counts in flight on each instance: what its queue judges room by."""
        return self.view.instances

    def placed_here(self) -> dict[str, str]:
        """Where it sent sessions' turns since the last call (session key -> instance), for its peers."""
        return {}

    def placed_elsewhere(self, placements: dict[str, str]) -> None:
        """Where a peer sent sessions' turns."""

    def share_programs(self) -> None:
        """From now on, tell peers the agent programs' turns it starts and ends (programs_here)."""

    def programs_here(self) -> list[ProgramTurn]:
        """The programs' turns it started and ended since the last call, for its peers."""
        return []

    def programs_elsewhere(self, peer: str, turns: list[ProgramTurn]) -> None:
        """The programs' turns a peer started and ended."""

    def sync(self) -> None:
        """What runs every sync_interval_s (routers telling each other their load)."""

    def first_token(self, request: SimRequest) -> None:
        pass

    def finished(self, request: SimRequest) -> None:
        pass

    def refused(self, request: SimRequest) -> None:
        """The instance refused the request (its queue was full): it never started."""

    def warm_up(self, request: SimRequest) -> tuple[int, int] | None:
        """Where the router prefills request's prompt while its program runs a tool, request just answered
        (router/programs/warm_ups.py), and the prompt tokens it counts as uncached there; None: nowhere."""
        return None


def priors_for(fleet: FleetSpec) -> TTFTPriors:
    """The TTFT priors of an operator who measured this hardware (the `+hw-priors` variants; kvroute's own
    start from its defaults and learn): the engine's prefill rate and attention cost, the pool's load rate, a
    decode step as the overhead; of a disaggregated fleet, its link's transfer rate."""
    engine = fleet.engine
    per_token = 1.0 / engine.prefill_tokens_per_s
    priors = TTFTPriors(
        overhead_s=engine.decode_step_s,
        queue_s_per_token=per_token,
        prefill_s_per_token=per_token,
        load_s_per_token=fleet.pool.load_s_per_token if fleet.pool is not None else per_token,
        decode_s_per_token=engine.decode_step_s,
        attention_s_per_pair=engine.attention_s_per_pair,
    )
    if fleet.pd is None:
        return priors
    return priors.model_copy(update={"transfer_s_per_token": fleet.pd.transfer_s_per_token})


def router_config(fleet: FleetSpec, priors: TTFTPriors | None = None) -> RouterConfig:
    """The configuration an operator would write for the simulated fleet; its TTFT priors kvroute's defaults
    unless given."""
    raw: dict[str, Any] = {
        "models": [{"name": fleet.model}],
        "block_size": fleet.engine.block_size,
        "instances": [
            {"name": instance_name(n), "url": f"http://{instance_name(n)}", "role": fleet.role(n)}
            for n in range(fleet.instances)
        ],
        "ttft": (priors or TTFTPriors()).model_dump(),
        # The operator knows where the engines refuse, if they do (EngineSpec.max_waiting, a 503)
        "admission": {"max_waiting_per_instance": fleet.engine.max_waiting},
        # and the objectives its clients name (kvroute/simulate/workloads.py tenants_trace)
        "flow_control": {"objectives": SIM_OBJECTIVES},
        # Simulated time stands still while the router decodes a body: no worker thread (the trace's loop
        # has none) would change when anything happens; and a prompt of token ids is several bytes a token.
        "tokenization": {"thread_above_bytes": SIM_BODY_BYTES, "max_tokenized_bytes": SIM_BODY_BYTES},
    }
    return parse_config(raw, source="simulation")


class ConfiguredPolicy(SimPolicy):
    """A policy from a RouterConfig, routed through router.dispatch.decide.decision.Decider as the proxy
    routes it. kvroute's own (decide=True) runs through its conductor (kvroute/simulate/conducted.py), which
    reads config and policy_name; route() and the hooks below are its steps for traces with images only.

    decide=False asks the policy directly, for peers whose algorithm kvroute's scorers express but which
    neither speculate nor know the pool (llm-d); lookup=False skips the index for policies that never read
    it (round robin).
    """

    def __init__(
        self,
        name: str,
        config: RouterConfig,
        policy: str,
        *,
        decide: bool = True,
        lookup: bool = True,
        include_pool: bool = True,
        calibrate: bool = True,
        scrape_interval_s: float | None = None,
        shed_sheddable: bool = False,
    ) -> None:
        """shed_sheddable: refuse requests of negative priority while the fleet reads saturated, as llm-d's
        admission does by default without flow control (sheds())."""
        self.name = name
        self._shed_sheddable = shed_sheddable
        self.scrape_interval_s = scrape_interval_s if scrape_interval_s else config.load.scrape_interval_s
        self.config, self.policy_name = config, policy
        self.conducts = decide  # peers built from kvroute's scorers (decide=False) route by route() alone
        self._decide, self._include_pool, self._calibrate = decide, include_pool, calibrate
        self._lookup = lookup
        self._limit = config.admission.max_in_flight_per_instance
        self.priors = config.ttft
        self._max_waiting = config.admission.max_waiting_per_instance if decide else None
        if decide:  # the proxy's own admission; peers built from scorers (llm-d) have none
            self.memory_hold_s = config.admission.memory_hold_s
            if config.flow_control.enabled:
                self.flow_control = config.flow_control

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        metrics = RouterMetrics()
        self._router = Decider(view.index, {}, view.block_size, metrics)
        # The agent programs the router follows (router/programs/), on the trace's clock: what starts one, and
        # the working sets the program-room scorer reads at each instance.
        self._programs = followed(
            self.config.programs,
            metrics,
            lambda name, tokens, programs: _set_working_set(view, name, tokens, programs),
            lambda name: view.instances[view.by_name[name]].kv_capacity_tokens,
            view.loop.clock,
        )
        self._warm_ups = WarmUps(self.config.programs.warm_up, self._programs, metrics)
        self._program_turns: ProgramTurnsShared | None = None  # with replicas sharing (Replicas)
        self._send: Callable[[SimRequest], None] = lambda request: None
        self._program_ticking = False
        self._turns: dict[int, tuple[RoutingRequest, str]] = {}  # by request number: sent, not yet answered
        self._placed: dict[str, str] = {}  # sessions' turns placed since peers were last told
        # Simulated time: session affinity's TTL expires as it would on the trace's clock.
        self._policy = Policy(
            self.policy_name, self.config.policies[self.policy_name], view.loop.clock, view.tie_rng
        )
        self._pool: PoolConfirmer | None = None
        if view.pool is not None and self._include_pool:
            # The simulated instances' pool keys carry no pool name: the index files their blocks under "".
            self._pool = PoolConfirmer(
                view.index,
                StoreLookup(view.pool),
                {view.model: ""},
                metrics,
                self.config.pool.confirm_ttl_s,
                view.loop.clock,
            )

    def routing(self, request: SimRequest) -> RoutingRequest:
        """The request as the router's decision sees it: its blocks and where they are held."""
        view = self.view
        chain = request.chain.tolist()
        if not self._lookup:
            matches = {}
        elif self._pool is None:
            matches = view.matches(chain, include_pool=False)
        else:
            matches = _at_once(self._pool.matches(view.model, chain))
        return RoutingRequest(
            model=view.model,
            session_key=request.session,
            prompt_tokens=request.trace.input_tokens,
            prompt_blocks=len(chain),
            block_size=view.block_size,
            matches=matches,
            chain=chain,
            new_program=request.session is not None and self._programs.placed_anew(request.session),
            programs_come_back=self._programs.come_back,
        )

    def work(self, request: SimRequest) -> float:
        return float(uncached_at_best(self.routing(request)))

    def admit(self, request: SimRequest, send: Callable[[SimRequest], None]) -> bool:
        """A new program waits while the programs alive fill every instance's KV cache, as the proxy's
        waiting stage holds it (router/programs/admission.py); it is sent as room frees."""
        programs, session = self._programs, request.session
        gate = programs.gate
        if session is None or not gate.enabled or programs.alive(session):
            return True
        self._send = send
        view = self.view
        if programs.starts_now(request.trace.input_tokens, view.instances):
            return True
        gate.hold(
            request, session, request.trace.input_tokens, lambda: view.instances, programs.known(session)
        )
        self._tick_programs()
        return False

    def _tick_programs(self) -> None:
        """While programs wait, room is looked for every PROGRAM_TICK_S as well, as the proxy looks
        (router/dispatch/wait/waiting.py): a tool call's time-to-live lapses on no event."""
        if not self._program_ticking and len(self._programs.gate):
            self._program_ticking = True
            loop = self.view.loop
            loop.at(loop.now + PROGRAM_TICK_S, self._program_ticked)

    def _program_ticked(self) -> None:
        self._program_ticking = False
        self._room_freed()
        self._tick_programs()

    def _room_freed(self) -> None:
        for request in self._programs.let_go():
            self._send(cast(SimRequest, request))

    def engine_priority(self, request: SimRequest) -> int:
        """kvroute's: its objective's priority, negated, unless flow_control.engine_priority is off; peers
        built from its scorers (decide=False) send none."""
        flow_control = self.config.flow_control
        if not self._decide or not flow_control.engine_priority:
            return 0
        return engine_priority(flow_control.objective(request.trace.objective)[1].priority)

    def sheds(self, request: SimRequest) -> bool:
        """llm-d's legacy admission (flow control off, its default): a request whose objective has a negative
        priority is refused while its utilization detector reads the pool saturated: the mean over the
        endpoints of max(waiting / 5, KV usage / 0.8) at 1.0 or more (pkg/epp/.../saturationdetector)."""
        objective = request.trace.objective
        if not self._shed_sheddable or objective is None:
            return False
        if SIM_OBJECTIVES.get(objective, {}).get("priority", 0) >= 0:
            return False
        scores = [
            0.0 if i.load is None else max(i.load.waiting / 5, i.load.kv_usage / 0.8)
            for i in self.view.instances
        ]
        return sum(scores) / len(scores) >= 1.0

    def candidates(self, instances: Sequence[Instance]) -> list[Instance]:
        """Those with room for another request (router/upstreams/room.py), or all when none has."""
        return with_room(instances, self._limit, self._max_waiting) or list(instances)

    def route(self, request: SimRequest) -> int:
        view = self.view
        routing = self.routing(request)
        untried = [i for n, i in enumerate(view.instances) if n not in request.tried]
        candidates = self.candidates(untried)
        if self._decide:
            decision = self._router.decide(Prepared(routing), self._policy, candidates)
            instance: Instance = decision.instance
            request.uncached_estimate = decision.uncached_tokens
            request.policy_state = decision.features
        else:
            instance = candidates[self._policy.choose(routing, candidates)]
            request.uncached_estimate = features_for(routing, instance).uncached_tokens
        if request.session is not None:
            self._turns[request.number] = routing, instance.name
        if routing.session_key is not None:
            self._placed[routing.session_key] = instance.name
        return view.by_name[instance.name]

    def placed_here(self) -> dict[str, str]:
        placed, self._placed = self._placed, {}
        return placed

    def placed_elsewhere(self, placements: dict[str, str]) -> None:
        for session_key, instance in placements.items():
            self._policy.placed_elsewhere(session_key, instance)

    def share_programs(self) -> None:
        if isinstance(self._programs, Programs):
            self._program_turns = ProgramTurnsShared(self._programs)

    def programs_here(self) -> list[ProgramTurn]:
        return [] if self._program_turns is None else self._program_turns.shared()

    def programs_elsewhere(self, peer: str, turns: list[ProgramTurn]) -> None:
        if self._program_turns is not None:
            self._program_turns.heard(peer, turns)

    def first_token(self, request: SimRequest) -> None:
        """The proxy calibrates the chosen instance's TTFT model with every first chunk it sees, timed from
        the attempt's start as router/dispatch/observe/outcome.py times it: its wait in the router's queue is
        no part of what the features describe."""
        features = request.policy_state
        if self._calibrate and isinstance(features, TTFTFeatures):
            ttft = request.first_token_s - request.dispatched_s
            self.view.instances[request.instance].ttft_model.observe(features, ttft)
        turn = self._turns.pop(request.number, None)
        if turn is not None:  # the proxy tells its programs at the answer's first byte
            self._programs.turn_started(*turn, request.dispatched_s)
        self._room_freed()

    def finished(self, request: SimRequest) -> None:
        if request.session is not None:
            self._programs.turn_ended(request.session)
        self._room_freed()

    def refused(self, request: SimRequest) -> None:
        self._turns.pop(request.number, None)

    def warm_up(self, request: SimRequest) -> tuple[int, int] | None:
        """As the proxy warms a program's next turn (router/dispatch/place/warm_up.py): where its policy
        foresees that turn going, by the index as it stands once the turn is answered."""
        warm_ups = self._warm_ups
        if not warm_ups.enabled or request.session is None:
            return None
        view = self.view
        prompt = self.routing(request)
        candidates = self.candidates(view.instances)
        foreseen = candidates[self._policy.predict(prompt, candidates)]
        warm = warm_ups.where(prompt, instance_name(request.instance), foreseen, candidates)
        if warm is None:
            return None
        warm_ups.sent(request.session, warm)
        return view.by_name[warm.instance.name], warm.uncached_tokens


class Replicas(SimPolicy):
    """Several routers in front of one fleet, as an operator runs them for availability: each has its own
    index (fed the same events), its own counts of what it sent, its own TTFT models, session affinity and
    queue (flow control, as the routers it is made of have it). The load balancer in front of them sends each
    session to one router (by a hash of its key), or, with by_session=False, each request to the next router
    in turn. With share_s, each router tells the others through the shared store every share_s seconds what it
    has in flight on each instance, its flows' counts, where it placed sessions' turns and the agent programs'
    turns it started and ended (router/shared/), and at once (within NUDGED_GAP_S) after a request with a
    large context, heard share_latency_s later; without, they share nothing. kvroute's own replicas run
    through their conductors (kvroute/simulate/conducted_run.py), sharing through the product's PeerSync;
    sync() and the hooks below serve the run's own steps (traces with images, and policies made for tests)."""

    def __init__(
        self,
        name: str,
        make: Callable[[], SimPolicy],
        count: int,
        by_session: bool = True,
        share_s: float | None = None,
    ) -> None:
        self.name, self._make, self._count, self._by_session = name, make, count, by_session
        self.conducts = make().conducts  # kvroute's replicas, each through its own conductor
        self.sync_interval_s = share_s
        self.routers = count
        self.share_latency_s = STORE_ROUND_TRIP_S
        self._next = 0
        self._nudged = False  # an exchange is due within NUDGED_GAP_S

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self.members = [self._make() for _ in range(self._count)]
        for number, router in enumerate(self.members):
            router.bind(view if number == 0 else view.replica())
        first = self.members[0]
        self.scrape_interval_s, self.flow_control = first.scrape_interval_s, first.flow_control
        self.queue_flows = first.queue_flows
        if any(router.memory_hold_s for router in self.members):
            # run.py holds requests in one queue judged on the first router's counts
            raise ValueError("several routers are simulated without holding requests for memory")
        self._peer_loads = [PeerLoads(PEERS_STALE_AFTER_S, view.loop.clock) for _ in self.members]
        if self.sync_interval_s is not None:
            for router in self.members:
                router.share_programs()

    def sync(self) -> None:
        snapshots = [own_loads(router.view.instances) for router in self.members]
        placed = [router.placed_here() for router in self.members]
        programs = [router.programs_here() for router in self.members]

        def deliver() -> None:
            for number, (router, loads) in enumerate(zip(self.members, self._peer_loads, strict=True)):
                for peer, snapshot in enumerate(snapshots):
                    if peer != number:
                        loads.update(str(peer), snapshot)
                        router.placed_elsewhere(placed[peer])
                        router.programs_elsewhere(str(peer), programs[peer])
                loads.apply(router.view.instances)

        self.view.loop.at(self.view.loop.now + self.share_latency_s, deliver)

    def router_of(self, request: SimRequest) -> int:
        if self._by_session and request.session is not None:
            return zlib.crc32(request.session.encode()) % self._count
        self._next = (self._next + 1) % self._count
        return self._next

    def counts_of(self, router: int) -> list[Instance]:
        return self.members[router].view.instances

    def route(self, request: SimRequest) -> int:
        instance = self.members[request.router].route(request)
        if self.sync_interval_s is not None and request.trace.input_tokens >= NUDGE_CONTEXT_TOKENS:
            self._nudge()
        return instance

    def _nudge(self) -> None:
        """A large request was sent: the routers tell each other at once, as PeerSync.nudge has them, the
        nudges within NUDGED_GAP_S in one exchange."""
        if self._nudged:
            return
        self._nudged = True

        def exchange() -> None:
            self._nudged = False
            self.sync()

        self.view.loop.at(self.view.loop.now + NUDGED_GAP_S, exchange)

    def work(self, request: SimRequest) -> float:
        return self.members[request.router].work(request)

    def instances_for(self, request: SimRequest) -> list[Instance]:
        return self.members[request.router].view.instances

    def engine_priority(self, request: SimRequest) -> int:
        return self.members[request.router].engine_priority(request)

    def first_token(self, request: SimRequest) -> None:
        self.members[request.router].first_token(request)

    def finished(self, request: SimRequest) -> None:
        self.members[request.router].finished(request)

    def refused(self, request: SimRequest) -> None:
        self.members[request.router].refused(request)


def _set_working_set(view: RouterView, name: str, tokens: int, programs: int) -> None:
    instance = view.instances[view.by_name[name]]
    instance.program_tokens, instance.programs_alive = tokens, programs
