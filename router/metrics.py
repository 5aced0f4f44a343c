"""The router's Prometheus metrics, all prefixed kvroute_ (but the standard process_ ones), with
low-cardinality labels.

Under `kvroute serve --workers N` (router/http/workers.py) every worker is a router of its own, and whichever
answers a scrape must speak for all of them. The worker pool (their parent) gives the workers one directory
(PROMETHEUS_MULTIPROC_DIR, set before prometheus_client is imported, so its values live in files there:
prometheus_client's multiprocess mode), and a worker's /metrics reads every worker's files:

- counters and histograms are summed over the workers, those that have exited too (a counter never goes
  back): requests, errors, retries, latencies, tokens, A/B inputs;
- but the counters of what every worker sees alike, the engines' KV event streams each worker subscribes to
  and the configuration file each one reloads (SAME_IN_EVERY_WORKER), are the largest worker's count, not
  N times the events;
- gauges are combined by what they mean (multiprocess_mode): requests in flight and the admission queue
  summed over the live workers, an open circuit breaker or a peer heard the highest (max), an instance
  healthy or warm the lowest (min), the TTFT model's rates the most recently set;
- collectors that are not prometheus_client metrics describe state every worker holds alike (the block
  index, built from the same events; the pool master's answer) and are reported by the worker answering;
- the process_ metrics are the answering worker's alone: they describe one process, and no sum of them stays
  a counter when a worker is restarted. Read the host's or the container's CPU and memory instead.

What cannot be combined: a series an instance removed by a reload leaves stays in the files (the worker
that wrote it can only forget its own copy) until the router restarts; and the answering worker's
process_ metrics, above.
"""

from __future__ import annotations

import asyncio
import glob
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Generic, Literal, TypeVar, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created series double the output, unread

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ERROR_BUCKETS = (-1, -0.25, -0.1, -0.05, -0.025, -0.01, 0, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
# An agent's tool calls: mostly under a second, some a minute or more (a build, a test run).
_TOOL_CALL_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)

M = TypeVar("M", bound=MetricWrapperBase)


class Family(Generic[M]):
    """A labelled metric whose children are found once per label values: no lock, no kwargs per request."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], M] = {}
        self._forgotten: set[tuple[int, str]] = set()  # (label position, value) no longer exported

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
            if self._forgotten and any((at, v) in self._forgotten for at, v in enumerate(values)):
                # The requests a removed instance was serving when it left still end on it: their updates go
                # to a child outside the registry instead of bringing its series back.
                self.metric.remove(*values)
        return child

    def drop(self, *values: str) -> None:
        """Drop the series of these label values until the next update makes it again. Under --workers
        the worker's file keeps it, at the value last set (ONLY_WHILE_NONZERO leaves such zeros out)."""
        if self._children.pop(values, None) is not None:
            self.metric.remove(*values)

    def forget(self, label: str, value: str) -> None:
        """Drop the series whose label is value and keep later updates out of /metrics: an instance a
        reload removed must not linger there."""
        at = self._position(label)
        if at is None:
            return
        self._forgotten.add((at, value))
        for values in [values for values in self._children if values[at] == value]:
            del self._children[values]
            self.metric.remove(*values)

    def restore(self, label: str, value: str) -> None:
        """Export value's series again (an instance of that name was added back)."""
        at = self._position(label)
        if at is None or (at, value) not in self._forgotten:
            return
        self._forgotten.discard((at, value))
        for values in [values for values in self._children if values[at] == value]:
            del self._children[values]  # children outside the registry: the next update makes a real one

    def _position(self, label: str) -> int | None:
        names = list(self.metric._labelnames)  # set by prometheus_client's constructor, never changed
        return names.index(label) if label in names else None


class UnsetGauge(Collector):
    """A gauge without labels that has no sample until it is first set: a prometheus_client Gauge says 0 from
    the start, which for kvroute_pool_master_up is an alert about a pool that is not there."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self._value = value

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self._name, self._documentation)
        if self._value is not None:
            family.add_metric([], self._value)
        return [family]


# What the event loop took of each LoopCollector for the render in progress in a worker thread: set in the
# render's context only (asyncio.to_thread runs it in a copy), so a render on the loop collects afresh.
_TAKEN: ContextVar[dict[LoopCollector, list[Metric]] | None] = ContextVar("metrics_taken", default=None)


RENDER_SWITCH_S = 0.0005


class _SwitchSoon:
    """While any render formats in its worker thread, Python's switch interval is RENDER_SWITCH_S, not 5 ms:
    the formatting holds the GIL, and a request waits for it at each turn of the event loop. With 2,000
    instances (a 1.5 MB text, ~180 ms) /health answered in a p99 of 18-23 ms during scrapes at 5 ms, 6 ms at
    0.5 ms (its idle p99: 2-3 ms); the render took as long."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rendering = 0
        self._previous = sys.getswitchinterval()

    def __enter__(self) -> None:
        with self._lock:
            if self._rendering == 0:
                self._previous = sys.getswitchinterval()
                sys.setswitchinterval(RENDER_SWITCH_S)
            self._rendering += 1

    def __exit__(self, *_: object) -> None:
        with self._lock:
            self._rendering -= 1
            if self._rendering == 0:
                sys.setswitchinterval(self._previous)


_GIL_HANDED_BACK_SOON = _SwitchSoon()


class LoopCollector(Collector):
    """A collector reading what the event loop changes (plain dicts and lists: the block index, the
    instances): collected on the loop, where nothing changes under it, even when a worker thread formats the
    rest of the render. prometheus_client's own metrics are locked, safe to read from any thread."""

    def __init__(self, inner: Collector) -> None:
        self._inner = inner

    def take(self) -> list[Metric]:
        return list(self._inner.collect())

    def collect(self) -> Iterable[Metric]:
        taken = _TAKEN.get()
        return self.take() if taken is None else taken.get(self, [])


# Counters of what every worker sees alike (module docstring): the largest worker's count, not the sum.
SAME_IN_EVERY_WORKER = frozenset(
    {
        "kvroute_kv_events",
        "kvroute_kv_malformed_messages",
        "kvroute_kv_skipped_events",
        "kvroute_kv_sequence_gaps",
        "kvroute_kv_replays",
        "kvroute_kv_engine_restarts",
        "kvroute_config_reloads",
        "kvroute_discovery_watch_restarts",
    }
)
# Gauges whose series live only while they count something: a worker's file keeps a series it dropped, at 0.
ONLY_WHILE_NONZERO = frozenset({"kvroute_flow_control_flow_queued"})
_PUSH_EVERY_S = 1.0


class SharedFunctionGauge(Gauge):
    """A gauge read from a function, in a worker of several: the function's value is written where the other
    workers read it once a second, since no worker can call another's function at scrape time."""

    def set_function(self, f: Callable[[], float]) -> None:
        def push() -> None:
            while True:
                self.set(float(f()))
                time.sleep(_PUSH_EVERY_S)

        threading.Thread(target=push, name=f"push-{self._name}", daemon=True).start()


class _WorkerRegistry(CollectorRegistry):
    """The registry of a worker of several: prometheus_client's metrics write to the shared directory, and
    the other collectors registered (the index's, the process's) are kept to be asked in this process."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True, support_collectors_without_names=True)
        self.local: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        if not isinstance(collector, MetricWrapperBase):
            self.local.append(collector)


class _AllWorkers(Collector):
    """What a worker answers a scrape with: every worker's metrics, combined (module docstring), and this
    worker's other collectors."""

    def __init__(self, path: str, local: list[Collector]) -> None:
        self._path, self._local = path, local

    def collect(self) -> Iterator[Metric]:
        files = glob.glob(os.path.join(self._path, "*.db"))
        for family in _merged(files):
            if family.name in ONLY_WHILE_NONZERO:
                family.samples = [found for found in family.samples if found.value]
            if family.name not in SAME_IN_EVERY_WORKER:
                yield family
        yield from _largest(
            family
            for file in files
            if os.path.basename(file).startswith("counter_")
            for family in _merged([file])
            if family.name in SAME_IN_EVERY_WORKER
        )
        for collector in self._local:
            yield from collector.collect()


def _merged(files: list[str]) -> list[Metric]:
    merged: list[Metric] = MultiProcessCollector.merge(files)  # type: ignore[no-untyped-call]
    return merged


def _largest(families: Iterable[Metric]) -> Iterator[Metric]:
    """One family per name, each sample the largest of those with its name and labels."""
    merged: dict[str, tuple[Metric, dict[tuple[str, tuple[tuple[str, str], ...]], Sample]]] = {}
    for family in families:
        _, samples = merged.setdefault(family.name, (family, {}))
        for found in family.samples:
            key = (found.name, tuple(sorted(found.labels.items())))
            if key not in samples or found.value > samples[key].value:
                samples[key] = found
    for family, samples in merged.values():
        family.samples = list(samples.values())
        yield family


def _version() -> str:
    try:
        return version("kvroute")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


# How the processes of `kvroute serve --workers N` combine a gauge's values (module docstring).
GaugeMode = Literal["livemax", "livemin", "livesum", "livemostrecent"]


def _counter(r: CollectorRegistry, name: str, documentation: str, labels: list[str]) -> Family[Counter]:
    return Family(Counter(name, documentation, labels, registry=r))


def _histogram(
    r: CollectorRegistry, name: str, documentation: str, labels: list[str], buckets: tuple[float, ...]
) -> Family[Histogram]:
    return Family(Histogram(name, documentation, labels, buckets=buckets, registry=r))


def _gauge(
    r: CollectorRegistry, name: str, documentation: str, labels: list[str], mode: GaugeMode
) -> Family[Gauge]:
    return Family(Gauge(name, documentation, labels, registry=r, multiprocess_mode=mode))


# RouterMetrics' families, one class per concern; each adds its families to the router's registry as
# attributes of RouterMetrics itself (metrics.requests, metrics.ttft_rate...), in the order they are exported.


class _RequestFamilies:
    def _add_request_families(self, r: CollectorRegistry, shared: bool) -> None:
        """The requests: answered, refused, how long they took, those in flight and those queued."""
        self.requests = _counter(
            r,
            "kvroute_requests",
            "Proxied requests by policy, instance, HTTP status, model and API (chat, completions, responses, "
            "messages, count_tokens, embeddings...)",
            ["policy", "vllm_instance", "status", "model", "api"],
        )
        self.rejected = _counter(
            r, "kvroute_rejected_requests", "Requests the router answered itself with an error", ["reason"]
        )
        self.client_errors = _counter(
            r,
            "kvroute_client_errors",
            "Requests answered 4xx by the router for what the client sent (a wrong API key's 401 "
            "and 429s are in kvroute_rejected_requests_total), by error code; missing_token and "
            "wrong_token: the admin token's 401 and 403",
            ["code"],
        )
        self.ttft = _histogram(
            r,
            "kvroute_time_to_first_byte_seconds",
            "Routing to an answer's (200) first byte: TTFT for streams",
            ["policy", "model"],
            _LATENCY_BUCKETS,
        )
        self.e2e = _histogram(
            r,
            "kvroute_request_duration_seconds",
            "End-to-end time of proxied requests answered 200",
            ["policy", "model"],
            _LATENCY_BUCKETS,
        )
        self.memory_hold = _histogram(
            r,
            "kvroute_memory_hold_seconds",
            "Time requests waited in the router for an instance with KV memory for them "
            "(admission.memory_hold_s; not in the time to first byte)",
            ["model"],
            _LATENCY_BUCKETS,
        )
        self.in_flight = _gauge(
            r,
            "kvroute_instance_in_flight",
            "Requests in flight through this router",
            ["vllm_instance"],
            "livesum",
        )
        self.admission_waiting = (SharedFunctionGauge if shared else Gauge)(
            "kvroute_admission_waiting",
            "Requests waiting for an admission slot: the router's own queue",
            registry=r,
            multiprocess_mode="livesum",
        )


class _FlowFamilies:
    def _add_flow_families(self, r: CollectorRegistry) -> None:
        """Flow control (router/dispatch/wait/flow_control.py): what waits in the router's queue, for how
        long, and what it let go or refused. By flow: those with requests queued now, at most 100 at once (the
        rest under flow="other")."""
        self.flow_queue_length = _gauge(
            r,
            "kvroute_flow_control_queued",
            "Requests waiting in the router's queue, by objective",
            ["objective"],
            "livesum",
        )
        self.flow_queue_length_by_flow = _gauge(
            r,
            "kvroute_flow_control_flow_queued",
            "Requests waiting in the router's queue, by flow: a series for each of at most 100 flows with "
            'requests queued now (a label of at most 64 characters), the rest under flow="other"',
            ["flow"],
            "livesum",
        )
        self.flow_queue_seconds = _histogram(
            r,
            "kvroute_flow_control_queue_seconds",
            "Time requests waited in the router's queue before being sent (or refused), by objective "
            "(in the time to first byte)",
            ["objective"],
            _LATENCY_BUCKETS,
        )
        self.flow_dispatched = _counter(
            r,
            "kvroute_flow_control_dispatched",
            "Requests flow control let go, by objective: at_once (an instance had room and nobody waited) "
            "or queued",
            ["objective", "how"],
        )
        self.flow_queued = _counter(
            r, "kvroute_flow_control_enqueued", "Requests that waited in the router's queue", ["objective"]
        )
        self.flow_refused = _counter(
            r,
            "kvroute_flow_control_refused",
            "Requests flow control refused (429), by objective and reason: queue_full, flow_queue_full, "
            "queue_timeout, rate_limited",
            ["objective", "reason"],
        )
        self.flow_slot_waits = _counter(
            r,
            "kvroute_flow_control_slot_waits",
            "Requests let go here that waited for a slot of their limit in flight because other replicas "
            "held the last ones (shared.url: the limit is the tenant's across replicas), by objective",
            ["objective"],
        )


class _RoutingFamilies:
    def _add_routing_families(self, r: CollectorRegistry) -> None:
        """The routing decisions: their time, their prefix knowledge, and what the A/B results weigh."""
        self.decision = _histogram(
            r,
            "kvroute_routing_decision_seconds",
            "Routing time by stage: prepare (tokenize, hash, look up) and choose (score, pick)",
            ["stage"],
            _DECISION_BUCKETS,
        )
        self.untokenized = _counter(
            r, "kvroute_untokenized_prompts", "Prompts routed without prefix knowledge, by reason", ["reason"]
        )
        self.index_host_lookups = _counter(
            r,
            "kvroute_index_host_lookups",
            "Under serve --workers: a worker's lookups in the index host's index, by outcome (answered; "
            "late, unreachable: routed without prefix knowledge)",
            ["outcome"],
        )
        self.tokenization_audits = _counter(
            r,
            "kvroute_tokenization_audits",
            "Prompts tokenized here and checked against an instance's /tokenize, by kind (start_text, "
            "start_chat: the probes at start; the audit's chats: plain, with_inputs: tools or "
            "chat_template_kwargs) and result (match, mismatch: an audited model's chats of that kind "
            "go to the engine from then on, failed)",
            ["model", "kind", "result"],
        )
        self.tokenizer_mismatch = _gauge(
            r,
            "kvroute_tokenizer_mismatch",
            "1 once a check since start (the probes at start, or an audit) found the router's token ids "
            "for the model differ from the instance's /tokenize: its prompts hash to blocks no instance "
            "holds; 0: checked and matched",
            ["model", "vllm_instance"],
            "livemax",
        )
        self.predicted_cached = _counter(
            r,
            "kvroute_predicted_cached_tokens",
            "Prompt tokens the chosen instance was predicted to reuse, by policy and tier",
            ["policy", "tier"],
        )
        self.prompt_tokens = _counter(
            r,
            "kvroute_prompt_tokens",
            "Prompt tokens of the requests answered, as the router counted them (none for a prompt "
            "routed without prefix knowledge), by policy: kvroute_predicted_cached_tokens' whole",
            ["policy"],
        )
        self.session_turns = _counter(
            r,
            "kvroute_session_turns",
            "Requests answered that carried a session key, by policy and placement: first (a session "
            "new, or forgotten past 65,536), same (the instance of its last turn), moved",
            ["policy", "placement"],
        )
        self.pd_requests = _counter(
            r,
            "kvroute_pd_requests",
            "Answered requests of disaggregated models by path: disaggregated (a prefill leg, then "
            "the decode leg), skipped (the decode instance held all but disaggregation."
            "local_prefill_max_tokens of the prompt and computed the rest), fallback (no prefill "
            "instance took the prefill leg; the decode instance computed the prompt)",
            ["model", "path"],
        )
        self.pd_leg = _histogram(
            r,
            "kvroute_pd_leg_seconds",
            "Legs of disaggregated requests: prefill (sent to its answer) and decode (sent to its "
            "first byte, the prompt's KV fetched), by instance",
            ["leg", "vllm_instance"],
            _LATENCY_BUCKETS,
        )


class _ProgramFamilies:
    def _add_program_families(self, r: CollectorRegistry) -> None:
        """Agent programs (router/programs/): their KV working sets, their tool calls, and whether a next
        turn found the KV its last turn left."""
        self.programs = _gauge(
            r,
            "kvroute_programs",
            "Agent programs whose KV working set is at the instance (alike at every router sharing state), "
            "by state: running (a turn in flight), tool_call (answered, within the tool calls' time-to-live),"
            " paused (in a tool call, its working set given up past programs.pause_above)",
            ["vllm_instance", "state"],
            "livemax",
        )
        self.programs_waiting = _gauge(
            r,
            "kvroute_programs_waiting",
            "Agent programs waiting in the router for KV room (programs.start_below), by kind: back (after "
            "their working set lapsed or was paused, first in line), new",
            ["kind"],
            "livesum",
        )
        self.program_wait_seconds = _histogram(
            r,
            "kvroute_program_wait_seconds",
            "How long a program's turn waited in the router for KV room, by kind (back, new)",
            ["kind"],
            _LATENCY_BUCKETS,
        )
        self.program_pauses = _counter(
            r,
            "kvroute_program_pauses",
            "Programs paused at the instance: in a tool call, their working set given up while the "
            "instance's working sets passed programs.pause_above",
            ["vllm_instance"],
        )
        self.program_warm_ups = _counter(
            r,
            "kvroute_program_warm_ups",
            "Warm-ups sent to the instance (programs.warm_up): a program's last prompt prefilled there while "
            "its tool ran, because its next turn was predicted to move (moves) or its KV to be evicted where "
            "it was (evicted)",
            ["vllm_instance", "reason"],
        )
        self.program_warm_ups_found = _counter(
            r,
            "kvroute_program_warm_ups_found",
            "Next turns of programs warmed up, by what they found at the instance warmed: kept (the warm-up "
            "paid), elsewhere, lost",
            ["kv"],
        )
        self.program_working_set_tokens = _gauge(
            r,
            "kvroute_program_working_set_tokens",
            "The prompt tokens of the programs running or in a tool call at the instance (alike at every "
            "router sharing state): their KV working set, against its KV cache (kv_capacity_tokens)",
            ["vllm_instance"],
            "livemax",
        )
        self.program_turns = _counter(
            r,
            "kvroute_program_turns",
            "Turns of agent programs by what they found of the KV their program's last turn left (first: a "
            "program new or forgotten; kept: at that turn's instance; elsewhere: only another instance or "
            "the pool held it; lost; unknown: routed without prefix knowledge) and by their tool call's "
            "length against the time-to-live (within_ttl, past_ttl; none for a first turn)",
            ["kv", "tool_call"],
        )
        self.program_tool_call_seconds = Histogram(
            "kvroute_program_tool_call_seconds",
            "Tool calls of agent programs: a turn's answer to the program's next turn",
            buckets=_TOOL_CALL_BUCKETS,
            registry=r,
        )
        self.program_ttl_seconds = Gauge(
            "kvroute_program_ttl_seconds",
            "The time-to-live a program's KV working set is counted for after its turn (learned from the "
            "tool calls, programs.ttl_quantile)",
            registry=r,
            multiprocess_mode="livemax",
        )


class _TtftModelFamilies:
    def _add_ttft_model_families(self, r: CollectorRegistry) -> None:
        """The TTFT model: its predictions against what came, its calibrated terms, the weight it lends."""
        self.ttft_predicted = _histogram(
            r,
            "kvroute_ttft_predicted_seconds",
            "The TTFT predicted for the chosen instance",
            ["vllm_instance"],
            _LATENCY_BUCKETS,
        )
        self.ttft_observed = _histogram(
            r,
            "kvroute_ttft_observed_seconds",
            "Streams' time to the first chunk, by instance",
            ["vllm_instance"],
            _LATENCY_BUCKETS,
        )
        self.ttft_error = _histogram(
            r,
            "kvroute_ttft_prediction_error_seconds",
            "Streams' observed minus predicted TTFT",
            ["vllm_instance"],
            _ERROR_BUCKETS,
        )
        self.ttft_rate = _gauge(
            r,
            "kvroute_ttft_model_rate",
            "Calibrated TTFT model terms: overhead in seconds; queue, prefill, load, decode and "
            "transfer in seconds per token; attention in seconds per token pair; memory a factor (1: "
            "as predicted)",
            ["vllm_instance", "term"],
            "livemostrecent",
        )
        self.ttft_slowdown = _gauge(
            r,
            "kvroute_ttft_instance_slowdown",
            "How much slower than its fleet's (the instances of its role) an instance's TTFTs come, as "
            "its model measures them: 1 as fast, 2 twice as slow (a degraded or smaller GPU)",
            ["vllm_instance"],
            "livemostrecent",
        )
        self.wait_caused_weight = _gauge(
            r,
            "kvroute_policy_wait_caused_weight",
            "What the policy weighs the wait a request causes by (ttft-cost's wait_caused): requests "
            "expected to arrive behind it at one instance per second it spends there before its "
            "first token, from the arrival rate measured; 0 on an idle fleet or with the term off; "
            "at 2, a request that waits 1 s is charged its uncached tokens' queue time twice",
            ["policy"],
            "livemostrecent",
        )


class _UpstreamFamilies:
    def _add_upstream_families(self, r: CollectorRegistry) -> None:
        """The instances: failures reaching them, retries elsewhere, circuit breakers, health checks."""
        self.upstream_errors = _counter(
            r, "kvroute_upstream_errors", "Failures reaching an instance, by kind", ["vllm_instance", "kind"]
        )
        self.retries = _counter(
            r,
            "kvroute_retries",
            "Requests sent elsewhere after this instance dropped them unanswered",
            ["vllm_instance"],
        )
        self.circuit_open = _gauge(
            r,
            "kvroute_circuit_open",
            "1 from the moment the instance's circuit breaker opens until a probe request succeeds",
            ["vllm_instance"],
            "livemax",
        )
        self.circuit_opens = _counter(
            r, "kvroute_circuit_opens", "Times the instance's circuit breaker opened", ["vllm_instance"]
        )
        self.healthy = _gauge(
            r,
            "kvroute_instance_healthy",
            "1 when the instance passes health checks",
            ["vllm_instance"],
            "livemin",
        )


class _KvEventFamilies:
    def _add_kv_event_families(self, r: CollectorRegistry) -> None:
        """The engines' KV event streams the index is built from (SAME_IN_EVERY_WORKER's, most of them)."""
        self.kv_events = _counter(
            r,
            "kvroute_kv_events",
            "KV-cache events received, by instance and event type "
            "(kvroute_index_mismatched_events: those whose blocks the index could not hold)",
            ["vllm_instance", "type"],
        )
        self.kv_malformed = _counter(
            r,
            "kvroute_kv_malformed_messages",
            "KV event messages with bad frames or payloads",
            ["vllm_instance"],
        )
        self.kv_skipped_events = _counter(
            r,
            "kvroute_kv_skipped_events",
            "Undecodable single events inside otherwise good batches",
            ["vllm_instance"],
        )
        self.kv_gaps = _counter(
            r,
            "kvroute_kv_sequence_gaps",
            "Jumps forward in a KV event stream's sequence numbers",
            ["vllm_instance"],
        )
        self.kv_replays = _counter(
            r,
            "kvroute_kv_replays",
            "Replays of missed KV events from an instance's buffer, by result",
            ["vllm_instance", "result"],
        )
        self.kv_warm = _gauge(
            r,
            "kvroute_kv_warm",
            "1 once the events an instance published before this router subscribed were replayed into "
            "the index; 0 while they are missing (replay pending, failed, or no replay endpoint)",
            ["vllm_instance"],
            "livemin",
        )
        self.kv_restarts = _counter(
            r,
            "kvroute_kv_engine_restarts",
            "Engine restarts seen as a KV event sequence starting over",
            ["vllm_instance"],
        )
        self.kv_last_event = _gauge(
            r,
            "kvroute_kv_last_event_timestamp_seconds",
            "Engine time of the newest KV event batch",
            ["vllm_instance"],
            "livemax",
        )


class _ControlFamilies:
    def _add_control_families(self, r: CollectorRegistry) -> None:
        """The router's own running: background tasks, reloads, peer routers, discovery, the pool's master."""
        self.task_failures = _counter(
            r, "kvroute_background_task_failures", "Failed iterations of background tasks", ["task"]
        )
        self.index_host_malformed = Counter(
            "kvroute_index_host_malformed_messages",
            "Under serve --workers: messages to the index host that it could not read, passed over",
            registry=r,
        )
        self.config_reloads = _counter(
            r, "kvroute_config_reloads", "Configuration reloads by result (ok, invalid)", ["result"]
        )
        self.peer_routers = Gauge(
            "kvroute_peer_routers",
            "Other routers whose load this router heard within shared.stale_after_s (replicas on the shared "
            "store; with --workers, its sibling workers too)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.shared_store_up = Gauge(
            "kvroute_shared_store_up",
            "1 while the replicas' shared store (shared.url) answers, 0 while it does not (each replica then "
            "carries on with what it knows); 0 too where none is configured",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.shared_store_errors = _counter(
            r,
            "kvroute_shared_store_errors",
            "Operations on the shared store that failed (it was unreachable or too slow), by operation "
            "(publish, follow, conversation_read, conversation_write, slots)",
            ["operation"],
        )
        self.peer_snapshots = _counter(
            r,
            "kvroute_peer_snapshots",
            "Load snapshots received from other routers, by result (applied, malformed: not "
            "decodable, own: this router's own, too_many_peers, repeated: heard already, over another way)",
            ["result"],
        )
        self.discovery_watch_restarts = _counter(
            r,
            "kvroute_discovery_watch_restarts",
            "Kubernetes discovery sessions that broke (410 Gone, connection lost, API server down) "
            "and were started again, by source; the last known instances serve meanwhile",
            ["source"],
        )
        self.discovered_instances = _gauge(
            r,
            "kvroute_discovered_instances",
            "Instances discovery found (Ready pods, a target per data-parallel rank), by source",
            ["source"],
            "livemax",
        )
        self.pool_master_up = UnsetGauge(
            "kvroute_pool_master_up",
            "1 when the Mooncake master answered the last pool lookup; 0: routing without pool credit "
            "(no sample before the first lookup, none without a pool)",
            registry=r,
        )
        self.pool_lookups = _counter(
            r, "kvroute_pool_lookups", "Pool blocks looked up on the Mooncake master, by answer", ["result"]
        )


class RouterMetrics(
    _RequestFamilies,
    _FlowFamilies,
    _RoutingFamilies,
    _ProgramFamilies,
    _TtftModelFamilies,
    _UpstreamFamilies,
    _KvEventFamilies,
    _ControlFamilies,
):
    """Every family the router exports, each an attribute (metrics.ttft(policy, model).observe(...))."""

    def __init__(self) -> None:
        # Set by the WorkerPool of `kvroute serve --workers N` for its workers (module docstring).
        self.shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        # A collector that named nothing when registered is still asked by a scrape naming samples (name[]).
        self.registry = r = (
            _WorkerRegistry()
            if self.shared_dir
            else CollectorRegistry(auto_describe=True, support_collectors_without_names=True)
        )
        self._exported = self.registry
        if isinstance(r, _WorkerRegistry) and self.shared_dir:  # a scrape answers for every worker
            self._exported = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
            self._exported.register(_AllWorkers(self.shared_dir, r.local))
        self._on_loop: list[LoopCollector] = []
        self._rendering: dict[frozenset[str], asyncio.Future[bytes]] = {}
        self._one_render = asyncio.Lock()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds, start time
        build = Gauge(
            "kvroute_build_info",
            "The running router's version; always 1",
            ["version"],
            registry=r,
            multiprocess_mode="livemax",
        )
        build.labels(_version()).set(1)
        self._add_request_families(r, shared=bool(self.shared_dir))
        self._add_flow_families(r)
        self._add_routing_families(r)
        self._add_program_families(r)
        self._add_ttft_model_families(r)
        self._add_upstream_families(r)
        self._add_kv_event_families(r)
        self._add_control_families(r)

    def forget_instance(self, name: str) -> None:
        for family in self._families():
            family.forget("vllm_instance", name)

    def restore_instance(self, name: str) -> None:
        for family in self._families():
            family.restore("vllm_instance", name)

    def _families(self) -> list[Family[Any]]:
        return [family for family in vars(self).values() if isinstance(family, Family)]

    def register_on_loop(self, collector: Collector) -> None:
        """Exports collector, which reads what the event loop changes: read on the loop by render_off_loop."""
        on_loop = LoopCollector(collector)
        self.registry.register(on_loop)
        self._on_loop.append(on_loop)

    def render(self, names: frozenset[str] = frozenset()) -> bytes:
        """The exposition; given names (a scrape's name[] parameters, which a scrape config's params send),
        only the samples of those names: a fleet of thousands renders megabytes, one family a few lines."""
        if not names:
            return generate_latest(self._exported)
        return generate_latest(cast(Collector, self._exported.restricted_registry(names)))

    def _render_yielding(self, names: frozenset[str]) -> bytes:
        """render(), in a worker thread that hands the GIL back to the event loop soon after it asks."""
        with _GIL_HANDED_BACK_SOON:
            return self.render(names)

    async def render_off_loop(self, names: frozenset[str] = frozenset()) -> bytes:
        """render()'s text, the loop held only to collect the LoopCollectors: formatting thousands of series
        takes tens of milliseconds, every request stalled meanwhile. Scrapes of the same names that come while
        a render is in flight share it; renders of different names run one after another, so scrapes naming
        many sets cannot make many at once."""
        rendering = self._rendering.get(names)
        if rendering is None:
            self._rendering[names] = rendering = asyncio.ensure_future(self._render_in_thread(names))
        # A scrape whose client goes away leaves the render to the others sharing it.
        return await asyncio.shield(rendering)

    async def _render_in_thread(self, names: frozenset[str]) -> bytes:
        try:
            async with self._one_render:
                _TAKEN.set({collector: collector.take() for collector in self._on_loop})
                return await asyncio.to_thread(self._render_yielding, names)
        finally:
            del self._rendering[names]
