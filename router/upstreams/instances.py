"""The fleet as the router sees it: each instance's address, models, health and in-flight work."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from router.apis.openai_body import DATA_PARALLEL_RANK_HEADER
from router.config import InstanceConfig, Role, RouterConfig, api_key
from router.upstreams.circuit_breaker import CircuitBreaker
from router.upstreams.context_residency import ContextResidency
from router.upstreams.filters import HEALTHY, filtered
from router.upstreams.inflight_blocks import InflightBlocks
from router.upstreams.peer_load import NO_PEER_LOAD, PeerLoad
from router.upstreams.settings import CircuitBreakerConfig
from scorers._candidate_state import CandidateState
from scorers.candidate import EngineLoad
from scorers.request import RoutingRequest
from scorers.ttft_model import FleetModels, TTFTModel, TTFTPriors


@dataclass(frozen=True, slots=True)
class TransferEndpoint:
    """A prefill instance's MooncakeConnector side, as the decode leg names it."""

    engine_id: str | None
    bootstrap_url: str | None


@dataclass(frozen=True)
class InstanceSetup:
    """An instance's state and parts at its start, beyond its name, URL and models."""

    healthy: bool = True
    load: EngineLoad | None = None
    kv_capacity_tokens: int | None = None
    roots: dict[str, str] | None = None
    ttft_model: TTFTModel | None = None  # None: one of its own, with the default priors
    breaker: CircuitBreaker | None = None  # None: one with the default limits
    clock: Callable[[], float] = time.monotonic
    headers: dict[str, str] | None = None
    data_parallel_rank: int | None = None
    block_size: int = 16
    role: Role = "both"
    transfer: TransferEndpoint | None = None


_DEFAULT_SETUP = InstanceSetup()


class Instance(CandidateState):
    """An engine as the router sees it. What the scorers read of it (scorers/candidate.py: name, load,
    kv_capacity_tokens, context_hold_s, ttft_model and the sums below) are C fields of its base
    (scorers/_candidate_state.pyx), read by the compiled scoring without an attribute lookup each."""

    __slots__ = (
        "_own_in_flight",
        "_own_pending_prefill_tokens",
        "_peers",
        "block_size",
        "breaker",
        "cards_read",
        "checked",
        "clock",
        "contexts",
        "data_parallel_rank",
        "failed_checks",
        "headers",
        "healthy",
        "held",
        "max_model_len",
        "models",
        "program_tokens",
        "programs_alive",
        "role",
        "roots",
        "transfer",
        "url",
    )

    def __init__(
        self, name: str, url: str, models: frozenset[str], setup: InstanceSetup = _DEFAULT_SETUP
    ) -> None:
        clock, block_size = setup.clock, setup.block_size
        super().__init__(name)
        self.url, self.models = url, models
        self.healthy = setup.healthy
        self.checked = False  # a health check has answered (or failed) since the instance came in
        self.load = setup.load
        # From the engine's vllm:cache_config_info once scraped.
        self.kv_capacity_tokens = setup.kv_capacity_tokens
        self.max_model_len: dict[str, int] = {}  # by model, from its /v1/models once healthy
        # By base model, the same (from its /v1/models once healthy): its path (vLLM --model).
        self.roots = {} if setup.roots is None else setup.roots
        self.cards_read = False  # /v1/models answered since it last came up
        self.failed_checks = 0
        self.ttft_model = TTFTModel(TTFTPriors()) if setup.ttft_model is None else setup.ttft_model
        self.breaker = CircuitBreaker() if setup.breaker is None else setup.breaker
        self.clock = clock
        self.contexts = ContextResidency(clock)
        self.context_hold_s = None  # the contexts' hold time, kept as each is released
        # What every request to it carries: the key the instance requires, the data-parallel rank it is.
        self.headers = {} if setup.headers is None else setup.headers
        self.data_parallel_rank = setup.data_parallel_rank  # one rank of an engine; its load is that rank's
        self.block_size = block_size  # the engine's, for the blocks in flight
        self.held = InflightBlocks(block_size)
        self.role: Role = setup.role  # the legs of a disaggregated model's requests it takes
        self.transfer = setup.transfer  # where a decode leg fetches KV this instance prefilled
        # The scorers' in_flight, pending_prefill_tokens and active_tokens are this router's counts and its
        # peers' (their setters below), kept summed as the parts change.
        self._own_in_flight = 0
        self._own_pending_prefill_tokens = 0
        self._peers = NO_PEER_LOAD
        # Set by the agent programs followed (router/programs/): their working sets, and how many are alive.
        self.program_tokens = 0
        self.programs_alive = 0

    def __repr__(self) -> str:
        return f"Instance({self.name!r}, {self.url!r})"

    @property
    def own_in_flight(self) -> int:
        """Requests this router sent there and has not seen finish."""
        return self._own_in_flight

    @own_in_flight.setter
    def own_in_flight(self, requests: int) -> None:
        self._own_in_flight = requests
        self._sum()

    @property
    def own_pending_prefill_tokens(self) -> int:
        """Their uncached prompt tokens not answered yet."""
        return self._own_pending_prefill_tokens

    @own_pending_prefill_tokens.setter
    def own_pending_prefill_tokens(self, tokens: int) -> None:
        self._own_pending_prefill_tokens = tokens
        self._sum()

    @property
    def peers(self) -> PeerLoad:
        """The same of other routers in front of the fleet (router/upstreams/peer_load.py)."""
        return self._peers

    @peers.setter
    def peers(self, load: PeerLoad) -> None:
        self._peers = load
        self._sum()

    def _sum(self) -> None:
        """The scorers' figures again, from this router's parts and its peers': after any of them changes."""
        peers = self._peers
        self.in_flight = self._own_in_flight + peers.in_flight
        self.pending_prefill_tokens = self._own_pending_prefill_tokens + peers.pending_prefill_tokens
        self.active_tokens = self.held.tokens + peers.active_tokens

    @property
    def own_active_tokens(self) -> int:
        return self.held.tokens

    def shared_tokens(self, chain: Sequence[int]) -> int:
        return self.held.shared_tokens(chain)

    def start(self, prompt_tokens: int, uncached_tokens: int, chain: Sequence[int] = ()) -> None:
        """A request was sent here: its context (its whole blocks hash to chain) is held and its uncached
        tokens queue for prefill."""
        self._own_in_flight += 1
        self._own_pending_prefill_tokens += uncached_tokens
        self.contexts.add(prompt_tokens)
        self.held.add(chain, prompt_tokens)
        self._sum()  # once for all three parts

    def end(
        self,
        prompt_tokens: int,
        still_prefilling_tokens: int = 0,
        admitted: bool = True,
        chain: Sequence[int] = (),
    ) -> None:
        """A request sent here is over: answered or failed (admitted: the engine held its context), or
        refused or never delivered."""
        self._own_in_flight -= 1
        self._own_pending_prefill_tokens -= still_prefilling_tokens
        self.held.remove(chain, prompt_tokens)
        self._sum()  # once for all three parts
        if admitted:
            self.contexts.release(prompt_tokens)
            self.context_hold_s = self.contexts.seconds
        else:
            self.contexts.withdraw(prompt_tokens)

    def prefill_done(self, tokens: int) -> None:
        """Tokens of a request in flight here that the engine is past prefilling (its first byte came, or the
        time it was predicted to take passed)."""
        self.own_pending_prefill_tokens -= tokens

    @classmethod
    def from_config(
        cls, config: InstanceConfig, router: RouterConfig, fleet_model: TTFTModel | None = None
    ) -> Instance:
        """fleet_model: the TTFT model of the instances of its role, which its own is pulled towards."""
        breaker: CircuitBreakerConfig = router.circuit_breaker
        return cls(
            name=config.name,
            url=config.url,
            models=frozenset(router.models_of(config)),
            setup=InstanceSetup(
                ttft_model=TTFTModel(router.ttft, fleet_model),
                breaker=CircuitBreaker(breaker.failures, breaker.open_s),
                headers=request_headers(config, router),
                data_parallel_rank=config.data_parallel_rank,
                block_size=router.block_size,
                role=config.role,
                transfer=TransferEndpoint(config.kv_engine_id, config.kv_bootstrap_url),
            ),
        )


def request_headers(instance: InstanceConfig, router: RouterConfig) -> dict[str, str]:
    key_env = router.api_key_env_of(instance)
    key = api_key(key_env) if key_env else ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if instance.data_parallel_rank is not None:  # vLLM's API server sends it to that rank's engine
        headers[DATA_PARALLEL_RANK_HEADER] = str(instance.data_parallel_rank)
    return headers


class FleetChanges(NamedTuple):
    added: list[InstanceConfig]
    removed: list[str]
    in_place: frozenset[str]  # of both: changed at the same URL, the same Instance object


class Upstreams:
    def __init__(self, config: RouterConfig, instances: list[Instance] | None = None) -> None:
        """instances: config's, made already (a simulated router's, on the trace's clock); None: made here."""
        self._fleet_models = FleetModels(config.ttft)
        if instances is None:
            instances = [self._instance(i, config) for i in config.instances]
        self.instances = instances
        self.models = [m.name for m in config.models]
        self._configs = {i.name: i for i in config.instances}
        self._index()

    def _instance(self, spec: InstanceConfig, config: RouterConfig) -> Instance:
        return Instance.from_config(spec, config, self._fleet_models.of(spec.role))

    def _index(self) -> None:
        self._by_model = {model: [i for i in self.instances if model in i.models] for model in self.models}
        self._by_name = {i.name: i for i in self.instances}
        self._any_request = {model: RoutingRequest(model) for model in self.models}  # what filters are shown
        self._disaggregated = frozenset(
            model for model, instances in self._by_model.items() if any(i.role != "both" for i in instances)
        )

    def update(self, config: RouterConfig) -> FleetChanges:
        """Take config's instances: unchanged ones keep their state (health, load, calibration, requests in
        flight); changed ones count as removed and added. A removed instance gets no new requests; those in
        flight finish, as they hold it. A changed one at the same URL is the same engine (other events
        endpoints or models): it stays the same object, so the requests it is serving still count against
        it, and they end on it."""
        kept = {i.name: i for i in self.instances if self._configs.get(i.name) in config.instances}
        added = [i for i in config.instances if i.name not in kept]
        removed = [name for name in self._configs if name not in kept]
        previous_by_name = {i.name: i for i in self.instances}
        instances, in_place = [], set()
        for spec in config.instances:
            instance = kept.get(spec.name)
            if instance is None:
                previous = previous_by_name.get(spec.name)
                if previous is not None and (previous.url, previous.data_parallel_rank) == (
                    spec.url,
                    spec.data_parallel_rank,
                ):
                    previous.models = frozenset(config.models_of(spec))
                    previous.headers = request_headers(spec, config)
                    previous.role = spec.role
                    previous.transfer = TransferEndpoint(spec.kv_engine_id, spec.kv_bootstrap_url)
                    instance = previous
                    in_place.add(spec.name)
                else:
                    # Not a candidate until its first health check passes (at the health checker's next
                    # tick): an engine added before it is up must not fail the first requests sent to it.
                    instance = self._instance(spec, config)
                    instance.healthy = False
            instances.append(instance)
        self.instances = instances
        self._configs = {i.name: i for i in config.instances}
        self._index()
        return FleetChanges(added, removed, frozenset(in_place))

    def program_working_set(self, name: str, tokens: int, programs: int) -> None:
        """The agent programs' KV working sets at instance name are tokens now, of programs alive
        (router/programs/)."""
        instance = self._by_name.get(name)
        if instance is not None:
            instance.program_tokens, instance.programs_alive = tokens, programs

    def kv_capacity(self, name: str) -> int | None:
        """Instance name's KV cache tokens, once known."""
        instance = self._by_name.get(name)
        return None if instance is None else instance.kv_capacity_tokens

    def serves(self, model: str) -> bool:
        return bool(self._by_model.get(model))

    def disaggregated(self, model: str) -> bool:
        """Whether model's requests go in a prefill leg and a decode leg (it has a prefill or decode
        instance)."""
        return model in self._disaggregated

    def candidates(
        self, model: str, exclude: frozenset[str] = frozenset(), leg: Role = "decode"
    ) -> list[Instance]:
        """Healthy instances serving model whose circuit breaker lets a request through, in configuration
        order; of a disaggregated model, those taking leg (a decode leg is also where a whole request goes).
        When every healthy one's breaker is open the breakers step aside (as Envoy's panic mode): a client
        whose requests make every engine fail must not black out the model for everyone."""
        serving = self._by_model.get(model)
        if not serving:
            return []
        # HEALTHY's first filter makes a new list: the fleet's own is never handed out.
        found = [i for i in serving if i.name not in exclude] if exclude else serving
        return filtered(HEALTHY[leg], self._any_request[model], found)

    def only_model(self) -> str | None:
        """The model a request that names none is for: the one configured, if there is one only."""
        return self.models[0] if len(self.models) == 1 else None

    def served_models(self) -> list[str]:
        return [m for m in self.models if self._by_model[m]]

    def max_model_len(self, model: str) -> int | None:
        """The longest context every instance of model that told it takes: a client sizing its prompts by it
        fits wherever it is routed."""
        lengths = [i.max_model_len[model] for i in self._by_model.get(model, ()) if model in i.max_model_len]
        return min(lengths) if lengths else None

    def unavailable_models(self) -> list[str]:
        """Models configured with instances of which none is healthy: their requests get 503s."""
        return [m for m in self.served_models() if not any(i.healthy for i in self._by_model[m])]
