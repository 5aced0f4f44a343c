"""Engine load from each instance's vLLM /metrics: queue depth, running requests and KV-cache usage; and
the pool's load rate as its engine measured it (kvroute bench calibrate reads it).

A load that has not been refreshed within stale_after_s is cleared to None, so scorers never route on it.
The same scrape tells when an instance restarted (a later process start time after it stopped answering):
its cache is empty then, even before its first KV event says so.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable

import aiohttp

from router.bounded_read import read_at_most
from router.upstreams.instances import Instance, Upstreams
from router.upstreams.settings import LoadConfig
from scorers.candidate import EngineLoad

log = logging.getLogger(__name__)

WAITING = b"vllm:num_requests_waiting"
RUNNING = b"vllm:num_requests_running"
KV_USAGE = b"vllm:kv_cache_usage_perc"
START_TIME = b"process_start_time_seconds"
CACHE_CONFIG = b"\nvllm:cache_config_info{"
POOL_LOAD_SECONDS = b"vllm:mooncake_store_operation_time_seconds_sum"
POOL_LOAD_KEYS = b"vllm:mooncake_store_operation_keys_total"
POOL_LOADS_OK = (b'operation="load_get"', b'status="ok"')
MIN_POOL_LOAD_KEYS = 64
_NUM_GPU_BLOCKS = re.compile(rb'[{,]num_gpu_blocks="(\d+)"')
_BLOCK_SIZE = re.compile(rb'[{,]block_size="(\d+)"')

# vLLM gzips /metrics for clients that accept it: ~0.7 ms of its CPU and ~0.09 ms of ours per scrape
# to save 50 KB, nine times the cost of the parse below.
_UNCOMPRESSED = {"Accept-Encoding": "identity"}
# An engine's /metrics: some hundred KB, a few MB with many data-parallel ranks; a larger answer is not read.
MAX_METRICS_BYTES = 32 * 2**20


def _line_start(text: bytes, head: bytes, start: int) -> int:
    """Where the next line beginning with head[1:] starts at or after start, or -1."""
    found = text.find(head, start)
    return -1 if found == -1 else found + 1


def _engine_label(engine: int | None) -> tuple[bytes, bytes] | None:
    """The label of one data-parallel engine's samples (vLLM labels each engine's by its index), as it reads
    first and after another label."""
    return None if engine is None else (b'{engine="%d"' % engine, b',engine="%d"' % engine)


def metric_samples(
    text: bytes, name: bytes, engine: int | None = None, labels: tuple[bytes, ...] = ()
) -> list[float] | None:
    """Every value of the family name, one per labelled sample (of one engine, if given, and with every one of
    labels, as `key="value"`); None if absent or any value is unusable."""
    values: list[float] = []
    head = b"\n" + name
    label = _engine_label(engine)
    at = 0 if text.startswith(name) else _line_start(text, head, 0)
    while at != -1:
        end = text.find(b"\n", at)
        rest = text[at + len(name) : len(text) if end == -1 else end]
        kept = True
        if rest[:1] == b"{":
            labels_end = rest.rfind(b"}") + 1  # label values may hold spaces; the value never holds "}"
            if label is not None:
                kept = label[0] in rest[:labels_end] or label[1] in rest[:labels_end]
            kept = kept and all(wanted in rest[:labels_end] for wanted in labels)
            rest = rest[labels_end:]
        elif label is not None or labels:
            kept = False
        # Else another engine's, or another name with this prefix, as vllm:num_requests_waiting_by_reason.
        if rest[:1] == b" " and kept:
            fields = rest.split()  # the value, then an optional timestamp
            try:
                value = float(fields[0])
            except (ValueError, IndexError):
                return None
            if not (math.isfinite(value) and value >= 0):
                return None
            values.append(value)
        if end == -1:
            break
        if text.startswith(name, end + 1):
            at = end + 1
        elif values:
            break  # the exposition format keeps a family's samples together: the rest holds no more
        else:
            at = _line_start(text, head, end)
    return values or None


def parse_engine_load(text: bytes, engine: int | None = None) -> EngineLoad | None:
    """The load in a vLLM /metrics body, of one data-parallel engine or summed over them; None unless all
    three are there.

    A targeted scan rather than prometheus_client's parser. On the captured 56 KB vLLM body (Python 3.11):
    ~10 us here against ~13 ms for text_string_to_metric_families, that is 0.005% of a core per instance at
    5 scrapes a second against 6.5%.
    """
    waiting, running = metric_samples(text, WAITING, engine), metric_samples(text, RUNNING, engine)
    usage = metric_samples(text, KV_USAGE, engine)
    if waiting is None or running is None or usage is None:
        return None
    if max(usage) > 1:  # a fraction; a percentage (or garbage) would make every prompt wait for memory
        return None
    # Mean usage: with equal engines it is the instance's used fraction of all its blocks, and vLLM's own
    # data-parallel balancer sends a new request to a less loaded engine, so the fullest one overstates it.
    return EngineLoad(waiting=sum(waiting), running=sum(running), kv_usage=sum(usage) / len(usage))


def cache_configs(text: bytes, engine: int | None) -> list[tuple[int, int]] | None:
    """(num_gpu_blocks, block_size) of each engine (or the one given), from the labels of
    vllm:cache_config_info; None if any is not known yet (vLLM fills num_gpu_blocks after profiling)."""
    configs = []
    label = _engine_label(engine)
    at = text.find(CACHE_CONFIG)
    while at != -1:
        end = text.find(b"\n", at + 1)
        labels = text[at : len(text) if end == -1 else end]
        at = text.find(CACHE_CONFIG, at + 1)
        if label is not None and label[0] not in labels and label[1] not in labels:
            continue
        blocks, size = _NUM_GPU_BLOCKS.search(labels), _BLOCK_SIZE.search(labels)
        if blocks is None or size is None:
            return None
        configs.append((int(blocks.group(1)), int(size.group(1))))
    return configs


def parse_kv_capacity(text: bytes, engine: int | None = None) -> int | None:
    """Tokens the KV cache of one data-parallel engine holds, or of all summed: vLLM publishes its cache
    configuration as the labels of vllm:cache_config_info (num_gpu_blocks x block_size); None if absent."""
    configs = cache_configs(text, engine)
    if not configs:
        return None
    return sum(blocks * size for blocks, size in configs) or None


def pool_load_rate(seconds: float, keys: float, block_size: int) -> float | None:
    """Seconds a prompt token takes to load from the pool, from an engine's loads so far (a key is a block);
    None until they number MIN_POOL_LOAD_KEYS, below which one slow get would set it."""
    if keys < MIN_POOL_LOAD_KEYS or block_size <= 0 or not math.isfinite(seconds):
        return None
    return seconds / keys / block_size


def parse_pool_load_rate(text: bytes, engine: int | None = None) -> float | None:
    """The pool's load rate an engine measured, seconds a token: vLLM's Mooncake store connector times each
    batch of keys it gets from the store and counts them (vllm:mooncake_store_operation_*, the successful
    operation="load_get"); None without a connector, or before it loaded enough."""
    seconds = metric_samples(text, POOL_LOAD_SECONDS, engine, POOL_LOADS_OK)
    keys = metric_samples(text, POOL_LOAD_KEYS, engine, POOL_LOADS_OK)
    configs = cache_configs(text, engine)
    if seconds is None or keys is None or not configs:
        return None
    return pool_load_rate(sum(seconds), sum(keys), configs[0][1])


def parse_start_time(text: bytes) -> float | None:
    """The serving process's start time (prometheus_client's process collector), if the body has one."""
    values = metric_samples(text, START_TIME)
    return max(values) if values else None


class LoadScraper:
    def __init__(
        self,
        fleet: Upstreams,
        session: aiohttp.ClientSession,
        config: LoadConfig,
        clock: Callable[[], float] = time.monotonic,
        restarted: Callable[[str], None] = lambda name: None,
    ) -> None:
        """restarted: told the name of an instance that came back as a new process."""
        self._fleet, self._session, self._clock = fleet, session, clock
        self._restarted = restarted
        self._started: dict[str, float] = {}  # instance -> latest process start time seen
        self._unanswered: set[str] = set()  # instances whose /metrics failed since they last answered
        self.interval_s = config.scrape_interval_s
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._stale_after_s = self._stale_s = config.stale_after_s
        self._per_round = max(1, math.floor(config.max_scrapes_per_s * config.scrape_interval_s))
        self._rounds = 1  # the rounds it takes to read every engine
        self._turn = 0  # the engine the next round's share starts at, when a round reads only a share
        self._last_ok: dict[str, float] = {}

    async def scrape_all(self) -> None:
        """One round: the engines' /metrics (every engine's, or this round's share of a large fleet),
        concurrently, once for all its data-parallel ranks; loads older than stale_after_s cleared (that many
        rounds a cycle times, for a fleet read in shares)."""
        by_url: dict[str, list[Instance]] = {}
        for instance in self._fleet.instances:
            by_url.setdefault(instance.url, []).append(instance)
        urls = self._share(list(by_url))
        await asyncio.gather(*(self._scrape(url, by_url[url]) for url in urls))

    def _share(self, urls: list[str]) -> list[str]:
        """The engines this round reads: all of them, or, where they outnumber what max_scrapes_per_s allows a
        round, the next share of them in turn."""
        rounds = max(1, math.ceil(len(urls) / self._per_round))
        if rounds != self._rounds:
            log.info(
                "reading the load of %d engines over %d rounds (load.max_scrapes_per_s): each every %.1fs",
                len(urls),
                rounds,
                rounds * self.interval_s,
            )
            self._rounds, self._stale_s = rounds, self._stale_after_s * rounds
        if rounds == 1:
            return urls
        start = self._turn % len(urls)
        self._turn = start + self._per_round
        return (urls[start:] + urls[:start])[: self._per_round]

    async def _scrape(self, url: str, instances: list[Instance]) -> None:
        """An engine the health checks found down is not asked: they probe it, and it is asked here again once
        up; its load goes stale meanwhile, as an unanswered one's does. Each refused connection left ~75
        objects in reference cycles (aiohttp's error and its traceback), which a young collection then took
        3-5 ms to walk: with 8 engines down, that held the event loop about once a second."""
        body = None
        try:
            if any(instance.healthy for instance in instances):
                metrics = self._session.get(url + "/metrics", headers=_UNCOMPRESSED, timeout=self._timeout)
                async with metrics as response:
                    if response.status == 200:
                        body = await read_at_most(response, MAX_METRICS_BYTES)
        except (TimeoutError, aiohttp.ClientError):
            pass
        for instance in instances:
            self._take(instance, body)

    def _take(self, instance: Instance, body: bytes | None) -> None:
        """The instance's load from its engine's /metrics body (None: no usable answer)."""
        load, started = None, None
        if body is not None:
            rank = instance.data_parallel_rank
            load, started = parse_engine_load(body, rank), parse_start_time(body)
            instance.kv_capacity_tokens = parse_kv_capacity(body, rank) or instance.kv_capacity_tokens
        self._check_restart(instance.name, answered=load is not None, started=started)
        now = self._clock()
        if load is not None:
            if instance.load is None and instance.name in self._last_ok:
                log.info("load of instance %s is fresh again", instance.name)
            instance.load = load
            self._last_ok[instance.name] = now
        elif instance.load is not None:
            age = now - self._last_ok.get(instance.name, -math.inf)
            if age > self._stale_s:
                log.warning("load of instance %s is stale: no usable /metrics for %.1fs", instance.name, age)
                instance.load = None

    def _check_restart(self, name: str, answered: bool, started: float | None) -> None:
        """A restart needs a silence first: servers with several API processes report several start times."""
        if not answered:
            self._unanswered.add(name)
            return
        if started is None:
            return
        known = self._started.get(name)
        if known is not None and started > known and name in self._unanswered:
            log.warning("instance %s restarted: its cached blocks are gone", name)
            self._restarted(name)
        self._started[name] = started if known is None else max(known, started)
        self._unanswered.discard(name)
