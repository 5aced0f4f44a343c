"""Everything the router runs, built from its configuration, started and stopped as one async context.

```
runtime = Runtime(config)          # the parts that need no event loop: instances, index, table
async with runtime:                # sessions, health checks, tokenizers, KV events, load scrapes, peers
    ...                            # route with runtime.routing (router/dispatch/conductor.py)...
```

A reload builds nothing anew that a restart would have to: it applies a new configuration's instances and
routing table to the running parts (apply), and refuses what only a restart can change. With discovery:,
the instances found in Kubernetes join the file's (discovered); a reload of the file keeps them, and what
discovery finds keeps the file's: config is always the file's configuration with the discovered instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from router import allocator, worker_threads
from router.apis.completions.prompt_embeds import DTYPE_NAMES
from router.config import ConfigError, ModelConfig, RouterConfig
from router.discovery.merge import with_discovered
from router.discovery.watcher import Discovered, Discovery
from router.dispatch.answer.relay import Relay
from router.dispatch.assembly import Hooks, RouterParts, build_stages, share_with_peers
from router.dispatch.conductor import Conductor
from router.dispatch.decide.decision import Decider, DeciderOptions, LocalTokenizer
from router.dispatch.intake.admission import Admission
from router.dispatch.intake.routing_table import RoutingTable
from router.dispatch.observe.ab_shared import SHARE_S as AB_SHARE_S
from router.dispatch.observe.ab_shared import SharedABResults
from router.dispatch.observe.events import Event
from router.dispatch.place.sending import Sender
from router.dispatch.wait.flow_gate import FlowGate
from router.index.block_index import BlockIndex, Tier
from router.index.figures import IndexFigures, figures_of
from router.index.index_host import IndexHost
from router.index.index_metrics import IndexCollector
from router.index.pool import (
    IndexOnlyMatches,
    MasterLookup,
    PoolConfirmer,
    PrefixMatches,
    place_instances,
    pool_names,
)
from router.index.remote_index import RemoteIndex, RemoteMatches
from router.index.routing_index import RoutingIndex
from router.index.subscriptions import Subscriptions, events_context
from router.metrics import RouterMetrics
from router.programs.table import followed
from router.prompt.multimodal.fetch import ImageFetcher
from router.prompt.remote_tokenizer import RemoteTokenizer
from router.prompt.settings import TokenizationConfig
from router.prompt.token_cache import CachedChatTokenizer
from router.prompt.tokenization import PromptTokenizer
from router.prompt.tokenizer_check import TokenizerWatch, check_at_start
from router.shared.conversations import SharedConversations
from router.shared.slots import SharedSlots
from router.shared.snapshots import SnapshotChannel
from router.shared.store import SharedStore
from router.supervisor import supervise
from router.tracing import start_tracing
from router.tracing.spans import Tracing
from router.upstreams.health import HealthChecker
from router.upstreams.http_session import upstream_session
from router.upstreams.instances import Upstreams
from router.upstreams.load_scraper import LoadScraper
from router.upstreams.model_tokenizers import (
    TokenizerChoice,
    choose_tokenizers,
    find_model_tokenizer,
    model_roots,
)
from router.upstreams.peer_sync import PeerEndpoints, PeerSync

log = logging.getLogger(__name__)

# What a reload may change; everything else is built into running parts and needs a restart. discovery is
# not: its watch is set up once, at start (a changed selector or source is a new fleet, not an edit).
RELOADABLE = frozenset({"policies", "default_policy", "traffic", "admin", "instances", "flow_control"})
DISCOVERY_MAX_BACKOFF_S = 10.0  # between attempts to reach an API server that is down
FLOW_TICK_S = 0.25  # how often waiting requests look for room that appeared without an event
TOKENIZER_SEARCH_S = 2.0  # how often a model left to its instances' /tokenize looks for its own tokenizer
_NOT_LOADED = "remote: the instances' /tokenize (the tokenizer found here did not load)"


def _shared_through(
    runtime: Runtime, store: SharedStore
) -> dict[str, tuple[Callable[[], Awaitable[None]], float, bool]]:
    """What the router shares through the store, and the loops that keep it: stored responses' conversations,
    its load snapshots on the store's channel, the one A/B test, and flow control's slots of limits in flight
    (router/shared/slots.py)."""
    runtime.routing.responses.share(SharedConversations(store))
    channel = SnapshotChannel(store, runtime.peers.receive, runtime.peers.skipped)
    runtime.peers.send_also(channel.send)
    runtime.shared_ab = shared_ab = _one_ab_test(runtime, store)
    runtime.flow_gate.slots = slots = SharedSlots(store, runtime.peers.router_id)
    return {
        "shared-follow": (channel.follow, store.config.interval_s, False),
        "shared-ab": (shared_ab.share, AB_SHARE_S, False),
        "shared-slots": (slots.renew, slots.renew_s, False),
    }


async def _image_fetcher(config: TokenizationConfig, stack: contextlib.AsyncExitStack) -> ImageFetcher | None:
    """Where images given by URL may be fetched from (tokenization.image_url_domains): their fetcher, over a
    session of its own (the hosts are not the fleet's); None where none may be."""
    if not config.image_url_domains:
        return None
    session = await stack.enter_async_context(aiohttp.ClientSession())
    return ImageFetcher(
        session, config.image_url_domains, config.image_max_bytes, config.image_fetch_timeout_s
    )


def _one_ab_test(runtime: Runtime, store: SharedStore) -> SharedABResults:
    """The replicas' one A/B test (router/dispatch/observe/ab_shared.py): a split set at another replica is
    taken where this router has its policies."""

    def adopt(weights: dict[str, float]) -> None:
        table = runtime.table
        if not weights.keys() <= table.policies.keys():
            raise ValueError("the split names a policy this router does not have")
        runtime.table = table.with_split(weights)

    config = lambda: runtime.config.traffic_weights()  # noqa: E731 (the configuration a reload replaces)
    return SharedABResults(store, runtime.peers.router_id, runtime.table.ab, config, adopt)


@dataclass(frozen=True)
class SharedIndex:
    """The one block index of `kvroute serve --workers N` (router/index/index_host.py): hosts, the process
    that holds it and answers on endpoint (a Unix socket's path); otherwise a worker that asks it there."""

    endpoint: str
    hosts: bool


class Runtime:
    def __init__(
        self,
        config: RouterConfig,
        peers: PeerEndpoints | None = None,
        shared_index: SharedIndex | None = None,
    ) -> None:
        """peers: its sibling workers' endpoints (a worker of several, router/http/workers.py). shared_index:
        where the index is when several processes share it (None: this router's own)."""
        peer_config = PeerEndpoints() if peers is None else peers
        if config.shared.enabled:  # peers heard over the store are timed by its settings
            shared = config.shared
            peer_config = replace(
                peer_config, interval_s=shared.interval_s, stale_after_s=shared.stale_after_s
            )
        self._peer_config = peer_config
        self._shared_index = shared_index
        self.config = config  # what runs: file_config's, with the discovered instances
        self.file_config = config
        self._discovered = Discovered()
        self.upstreams = Upstreams(config)
        self.metrics = RouterMetrics()
        self._context = events_context()  # its I/O threads start with its first socket
        # The index held here (None in a worker that asks its host's), its subscriptions to the engines'
        # KV events, and what the request path tells it.
        self.index: BlockIndex | None = None
        self.subscriptions: Subscriptions | None = None
        self._remote_index: RemoteIndex | None = None
        self.routing_index: RoutingIndex
        if shared_index is None or shared_index.hosts:
            media = config.index.medium_tiers
            tiers: dict[str | None, Tier] = {medium: Tier[tier.upper()] for medium, tier in media.items()}
            self.index = self.routing_index = BlockIndex(
                config.block_size,
                config.index.max_entries,
                config.index.speculative_ttl_s,
                medium_tiers={None: Tier.GPU, **tiers},  # events without a medium are vLLM's own GPU cache
            )
            place_in_pool(self.index, config)
            # Requests in progress hold admission's slots; admission is made with the routing, below.
            busy = lambda: self.admission.admitted > 0  # noqa: E731
            self.subscriptions = Subscriptions(self.index, self.metrics, self._context, busy)
        else:
            self._remote_index = self.routing_index = RemoteIndex(shared_index.endpoint, self.metrics)
        self.metrics.register_on_loop(
            IndexCollector(self.index_figures, lambda: {i.name for i in self.upstreams.instances})
        )
        self.tokenizers: dict[str, LocalTokenizer] = {}  # loaded at start, once the instances have answered
        self.tokenizer_watch = TokenizerWatch(self.metrics)
        self._roots_searched: dict[str, frozenset[str]] = {}  # by model left to /tokenize: roots looked at
        # Replaced whole by a reload or the admin API; a request keeps the one it started with.
        self.table = RoutingTable.from_config(config)
        # Its queues outlive reloads, which change its settings.
        self.flow_gate = FlowGate(config.flow_control, self.upstreams, self.metrics)
        # A request's prefill or the request ended, here or at a peer router: those waiting may go.
        self.room_freed = Event()
        upstreams = self.upstreams
        self.programs = followed(
            config.programs, self.metrics, upstreams.program_working_set, upstreams.kv_capacity
        )
        self.bases = {m.name: m.lora_of for m in config.models}  # models change with a restart only
        self.shared_store: SharedStore | None = None  # replicas' (router/shared/), once started
        self.shared_ab: SharedABResults | None = None  # and their A/B split and results

    async def __aenter__(self) -> Runtime:
        # What runs off the loop (asyncio.to_thread) runs where the signals the router handles are blocked.
        asyncio.get_running_loop().set_default_executor(worker_threads.executor())
        async with contextlib.AsyncExitStack() as stack:  # what started is stopped if the rest cannot start
            await self._start(stack)
            self._exit = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._exit.aclose()

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        config, metrics = self.config, self.metrics
        # Idle upstream connections close before uvicorn's (vLLM's server) 5 s keep-alive would drop them
        # under a request.
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=config.upstream.max_connections_per_instance, keepalive_timeout=4
        )
        # Health checks, /metrics scrapes, /tokenize and the pool master get connections of their own, never
        # queued behind requests (those are bounded by admission): a busy instance is not a dead one.
        control_connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
        session = await stack.enter_async_context(upstream_session(connector))
        control = await stack.enter_async_context(upstream_session(control_connector))
        context = self._context
        stack.callback(context.destroy, linger=0)
        self.health = HealthChecker(self.upstreams, control, config.health, metrics)
        await self.health.check_all()  # their /v1/models too: where a model's tokenizer may be found
        # An index host routes nothing: it neither loads tokenizers nor checks them against the engines'.
        tokenizes = self._shared_index is None or not self._shared_index.hosts
        if tokenizes:
            await self._load_tokenizers(config)
        self._roots_searched = {m.name: self._roots(m) for m in config.models if m.tokenizer is None}
        self._control, self._images = control, await _image_fetcher(config.tokenization, stack)
        self.decider = self._decider(control)
        stack.callback(self.decider.close)
        tracing = start_tracing(config.tracing)
        # At exit, the spans still held are exported, off the loop: the SDK waits up to 30 s for a collector.
        stack.push_async_callback(asyncio.to_thread, tracing.close)
        self.routing = self._routing(session, tracing)
        self.relay = Relay(metrics, config.upstream.stream_idle_timeout_s, config.upstream.response_timeout_s)
        if self.subscriptions is not None:
            stack.push_async_callback(self.subscriptions.stop)
            self.subscriptions.subscribe(config.instances)
        scraper = LoadScraper(self.upstreams, control, config.load, restarted=self._engine_restarted)
        # Memory a peer's request freed may let requests held here go (admission.memory_hold_s). With no
        # sibling workers and no shared store it binds nothing and runs no loop.
        discovery = config.discovery
        self.peers = PeerSync(self._peer_config, self.upstreams, metrics, context, self.room_freed.fire)
        shared_loops = await self._shared(stack)
        share_with_peers(self.peers, self.router_parts, lambda: self.table.policies.values())
        stack.callback(self.peers.close)
        self.peers.start()  # a publish endpoint that cannot be bound stops the router here
        failures = metrics.task_failures
        loops = {
            "health": (self.health.check_due, self.health.tick_s, True),
            "load": (scraper.scrape_all, scraper.interval_s, False),
            "flow_control": (self.flow_gate.tick, FLOW_TICK_S, True),
            **({"tokenizers": (self._adopt_found_tokenizers, TOKENIZER_SEARCH_S, True)} if tokenizes else {}),
            **({"allocator": (_trim_allocator, allocator.TRIM_INTERVAL_S, True)} if allocator.trims else {}),
            **{
                name: (loop, self._peer_config.interval_s, False) for name, loop in self.peers.loops().items()
            },
            **shared_loops,
        }
        tasks = [
            asyncio.create_task(supervise(name, loop, every, failures, first_delay=delayed))
            for name, (loop, every, delayed) in loops.items()
        ]
        tasks += self._index_tasks()
        if tokenizes:
            checked = check_at_start(self.tokenizer_watch, self.tokenizers, self._remotes(control))
            tasks.append(asyncio.create_task(checked))
        if discovery is not None:
            watch = Discovery(discovery, self.discovered, metrics).run
            tasks.append(
                asyncio.create_task(
                    supervise("discovery", watch, 1.0, failures, max_backoff_s=DISCOVERY_MAX_BACKOFF_S)
                )
            )
        stack.push_async_callback(_cancelled, tasks)

    async def _shared(
        self, stack: contextlib.AsyncExitStack
    ) -> dict[str, tuple[Callable[[], Awaitable[None]], float, bool]]:
        """With a shared store: its client, the stored responses' conversations kept there, this router's
        snapshots published on its channel and the loop that follows the replicas' there
        (router/shared/snapshots.py). An index host shares nothing: its workers do."""
        config = self.config.shared
        hosts = self._shared_index is not None and self._shared_index.hosts
        if not config.enabled or hosts:
            return {}
        self.shared_store = store = SharedStore(config, self.metrics)
        stack.push_async_callback(store.close)
        return _shared_through(self, store)

    async def _load_tokenizers(self, config: RouterConfig) -> None:
        """Each model's tokenizer, where the configuration or the instances' answers say it is."""
        choices = await asyncio.to_thread(choose_tokenizers, config.models, self.upstreams.instances)
        self.tokenizers = await asyncio.to_thread(_local_tokenizers, config, choices)
        self.tokenizer_watch.origins = {
            name: choice.origin if name in self.tokenizers or choice.path is None else _NOT_LOADED
            for name, choice in choices.items()
        }

    def _index_tasks(self) -> list[asyncio.Task[None]]:
        """A shared index's side here: the host's answering, or a worker's asking."""
        shared, failures = self._shared_index, self.metrics.task_failures
        if shared is None:
            return []
        if self._remote_index is not None:
            asking = self._remote_index.run
            return [asyncio.create_task(supervise("index-remote", asking, 1.0, failures))]
        assert self.index is not None
        host = IndexHost(
            self.index, self._confirmed, self._as_indexed, self.index_figures, self.metrics, time.monotonic
        )
        answering = lambda: host.serve(shared.endpoint)  # noqa: E731
        return [asyncio.create_task(supervise("index-host", answering, 1.0, failures))]

    def index_figures(self) -> IndexFigures:
        """The index's figures: its own, or its host's as last fetched."""
        if self._remote_index is not None:
            return self._remote_index.figures
        assert self.index is not None and self.subscriptions is not None
        return figures_of(self.index, self.subscriptions.warnings())

    def _engine_restarted(self, name: str) -> None:
        """The load scraper saw a new engine process serve name: the index's subscriptions are told (a worker
        asking a host has none; the host's own scraper tells its)."""
        if self.subscriptions is not None:
            self.subscriptions.engine_restarted(name)

    def _routing(self, session: aiohttp.ClientSession, tracing: Tracing) -> Conductor:
        """The routing service both front doors call, over admission, the send loop and the decider."""
        config, metrics = self.config, self.metrics
        self.router_parts = parts = RouterParts(
            config,
            metrics,
            self.upstreams,
            self.flow_gate,
            self.decider,
            self.programs,
            self.room_freed,
            self.health,
            Sender(session, config.upstream),
        )
        ab_for = lambda policy: self.table.ab_for(policy)  # noqa: E731 (the table in force at each event)
        # (the peers' sync, made after the routing, is looked up when a large request is sent)
        stages = build_stages(parts, Hooks(ab_for, lambda: self.peers.nudge()))
        self.admission: Admission = stages.admission
        metrics.admission_waiting.set_function(lambda: self.admission.waiting)
        return Conductor(
            stages,
            lambda: self.table,
            config.tokenization,
            tracing,
            keyed_clients=config.auth.api_keys_env is not None,
        )

    def warnings(self) -> list[str]:
        subscriptions = self.subscriptions
        ingest = self.index_figures().warnings if subscriptions is None else subscriptions.warnings()
        shared = [] if self.shared_store is None else self.shared_store.warnings()
        return ingest + self.tokenizer_watch.alarms() + shared

    async def _adopt_found_tokenizers(self) -> None:
        """A model that names no tokenizer and had none found at start (its engines not up yet, or found
        by discovery later) is tokenized here once one reports a root this machine holds."""
        found: dict[str, TokenizerChoice] = {}
        for model in self.config.models:
            if model.tokenizer is not None or model.name in self.tokenizers:
                continue
            roots = self._roots(model)
            if self._roots_searched.get(model.name) == roots:  # looked for there already
                continue
            self._roots_searched[model.name] = roots
            if (choice := find_model_tokenizer(model, self.upstreams.instances)) is not None:
                found[model.name] = choice
        if not found:
            return
        loaded = await asyncio.to_thread(_local_tokenizers, self.config, found)
        for name, tokenizer in loaded.items():
            self.tokenizers[name] = tokenizer  # the decider's own dict: its next request is tokenized here
            self.tokenizer_watch.origins[name] = found[name].origin
            log.warning("model %s is tokenized here from now on, with %s", name, found[name].origin)
        await check_at_start(self.tokenizer_watch, loaded, self._remotes(self._control, loaded))

    def _roots(self, model: ModelConfig) -> frozenset[str]:
        """Where model's instances say it is (an adapter: its base), as far as they have said."""
        return frozenset(model_roots(model.lora_of or model.name, self.upstreams.instances))

    def _remotes(
        self, control: aiohttp.ClientSession, models: Iterable[str] | None = None
    ) -> dict[str, list[RemoteTokenizer]]:
        """The /tokenize of each engine serving a model tokenized here, that answered its health check."""
        remotes: dict[str, list[RemoteTokenizer]] = {}
        for model in self.tokenizers if models is None else models:
            urls: dict[str, str] = {}  # an engine's data-parallel ranks share its URL
            for instance in self.upstreams.instances:
                if model in instance.models and instance.healthy:
                    urls.setdefault(instance.url, instance.name)
            remotes[model] = [
                RemoteTokenizer(control, url, model, instance=name) for url, name in urls.items()
            ]
        return remotes

    def apply(self, new: RouterConfig, source: str) -> dict[str, Any]:
        """Take over new's instances (beside those discovered) and routing table; ConfigError when it changes
        what needs a restart. source: where new came from, for the error."""
        fixed = [
            key
            for key in type(new).model_fields
            if key not in RELOADABLE and getattr(new, key) != getattr(self.file_config, key)
        ]
        if fixed:
            raise ConfigError(f"{source}: changing {', '.join(fixed)} needs a restart")
        summary = self._take(with_discovered(new, self._discovered.instances), source)
        self.file_config = new
        return summary

    def discovered(self, fleet: Discovered) -> None:
        """Take what discovery finds now beside the file's instances; ConfigError when it does not fit."""
        summary = self._take(with_discovered(self.file_config, fleet.instances), "discovery")
        self._discovered = fleet
        if summary["added"] or summary["removed"]:
            log.info("discovery: added %s, removed %s", summary["added"], summary["removed"])

    def _take(self, new: RouterConfig, source: str) -> dict[str, Any]:
        old = self.config
        new.require_api_keys(source)
        added, removed, in_place = self.upstreams.update(new)
        # Changed at the same URL: the same engine, and the same object (router/upstreams/instances.py). Its
        # pool membership (unless the file took it out: pool: false) and its metric series (an open breaker's
        # gauge, the calibrated rates, set only when they change) stay. So do its subscriber and index entries
        # when its events endpoints did not change (new models or key): subscribed afresh, it could only
        # rebuild them from the engine's replay buffer, which has lost what was cached long ago (a shared
        # system prompt) and will not announce it again while it stays cached.
        before = {spec.name: (spec.events, spec.replay) for spec in old.instances}
        same_events = {
            spec.name
            for spec in new.instances
            if spec.name in in_place and before[spec.name] == (spec.events, spec.replay)
        }
        left_pool = set(old.pool_members()) - set(new.pool_members())
        index, subscriptions = self.index, self.subscriptions  # None in a worker asking a host, which reloads
        for name in removed:
            if name not in in_place:  # gone: its entries, pool membership, owner bits and series go
                self.metrics.forget_instance(name)
                self.tokenizer_watch.forget(name)
            if index is None or subscriptions is None:
                continue
            if name not in same_events:
                subscriptions.unsubscribe(name)
            if name not in in_place:
                index.forget_instance(name)
                continue
            if name not in same_events:
                index.drop_instance(name)
            if name in left_pool:
                index.leave_pool(name)  # as on a fresh start: back in when it writes to the pool
        # A name back in the file is exported again; moved to another URL in this same reload, the requests
        # the old engine is still serving count in its series too, as labels cannot tell the two apart.
        for instance in added:
            self.metrics.restore_instance(instance.name)
        if index is not None and subscriptions is not None:
            subscriptions.subscribe([spec for spec in added if spec.name not in same_events])
            place_in_pool(index, new)
        self.table, started_afresh = self.table.reloaded(old, new)
        self.flow_gate.control.configure(new.flow_control)
        self.config = new
        return {
            "added": [i.name for i in added],
            "removed": removed,
            "policies": list(new.policies),
            "policies_started_afresh": started_afresh,
            "split": self.table.split.shares(),
        }

    def _decider(self, control: aiohttp.ClientSession) -> Decider:
        config = self.config

        def remote_tokenizer(model: str) -> RemoteTokenizer | None:
            candidates = self.upstreams.candidates(model)
            if not candidates:
                return None
            return RemoteTokenizer(control, candidates[0].url, model, instance=candidates[0].name)

        confirming = config.pool.master_url is not None
        if self._remote_index is not None:
            self._as_indexed: PrefixMatches = RemoteMatches(self._remote_index, confirm=False)
            self._confirmed: PrefixMatches = RemoteMatches(self._remote_index, confirm=confirming)
        else:
            assert self.index is not None
            self._as_indexed = self._confirmed = IndexOnlyMatches(self.index)
            if config.pool.master_url is not None:
                lookup = MasterLookup(config.pool.master_url, control, config.pool.timeout_s)
                names, ttl_s = pool_names(config.models), config.pool.confirm_ttl_s
                self._confirmed = PoolConfirmer(self.index, lookup, names, self.metrics, ttl_s)
        adapters = frozenset(name for name, base in self.bases.items() if base is not None)
        tools_out_when_none = frozenset(
            m.name for m in config.models if m.exclude_tools_when_tool_choice_none
        )
        options = DeciderOptions(
            self._confirmed,
            self._as_indexed,
            adapters,
            config.tokenization.audit_every,
            tools_out_when_none,
            self.tokenizer_watch,
            self.programs,
            lambda model: model_roots(model, self.upstreams.instances),
            self._images,
            {m.name: DTYPE_NAMES[m.dtype] for m in config.models if m.dtype is not None},
        )
        return Decider(
            self.routing_index, self.tokenizers, config.block_size, self.metrics, remote_tokenizer, options
        )


def place_in_pool(index: BlockIndex, config: RouterConfig) -> None:
    """Tell the index each instance's pool name and the pool members the configuration names."""
    names = pool_names(config.models)
    served = {i.name: [names[model] for model in config.models_of(i)] for i in config.instances}
    place_instances(index, served, set(config.pool_members()))


async def _trim_allocator() -> None:
    """The C allocator's free memory given back (router/allocator.py), off the event loop."""
    await asyncio.to_thread(allocator.trim)


async def _cancelled(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _local_tokenizers(config: RouterConfig, choices: dict[str, TokenizerChoice]) -> dict[str, LocalTokenizer]:
    """One per tokenizer directory: a base model and its LoRA adapters share it, and its token cache (the
    same ids)."""
    cache = config.tokenization
    by_path: dict[Path, LocalTokenizer] = {}
    for path, configured in {c.path: c.configured for c in choices.values() if c.path is not None}.items():
        try:
            tokenizer = PromptTokenizer(path)
        except Exception as exc:
            if configured:
                raise
            # Found, not named: one that will not load here leaves the model to its instances' /tokenize.
            log.warning(
                "the tokenizer at %s does not load (%s): its models go to the instances' /tokenize", path, exc
            )
            continue
        by_path[path] = CachedChatTokenizer(tokenizer, cache.cache_max_entries, cache.cache_max_tokens)
    return {name: by_path[c.path] for name, c in choices.items() if c.path is not None and c.path in by_path}
