"""The block index as Prometheus sees it, read at scrape time so ingest and lookup pay nothing for it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.index.figures import IndexFigures
from router.index.holdings import Tier


class IndexCollector:
    def __init__(
        self, figures: Callable[[], IndexFigures], instances: Callable[[], Collection[str]] | None = None
    ) -> None:
        """figures: the index's now (its own, or its host's); instances: the names configured now; an
        instance a reload removed keeps an empty entry in the index, which must not keep its series in
        /metrics."""
        self._figures, self._instances = figures, instances

    def collect(self) -> Iterator[Metric]:
        index = self._figures()
        current = self._instances() if self._instances is not None else None
        blocks: dict[tuple[str, str], int] = {}
        for instance, _, sizes in index.by_owner:  # ranks of an instance add up
            if current is not None and instance not in current:
                continue
            for tier, size in zip(Tier, sizes, strict=True):
                key = (instance, tier.name.lower())
                blocks[key] = blocks.get(key, 0) + size
        family = GaugeMetricFamily(
            "kvroute_index_blocks",
            "Blocks the index holds by instance and tier",
            labels=["vllm_instance", "tier"],
        )
        for labels, size in sorted(blocks.items()):
            family.add_metric(list(labels), size)
        yield family
        yield GaugeMetricFamily(
            "kvroute_index_pool_blocks", "Blocks of the shared pool tier (one entry each)", index.pool_entries
        )
        yield GaugeMetricFamily(
            "kvroute_index_pool_members", "Instances pool blocks count for", index.pool_members
        )
        yield GaugeMetricFamily("kvroute_index_bytes", "Memory the index holds", index.bytes)
        yield GaugeMetricFamily("kvroute_index_max_blocks", "Bound on index entries", index.max_entries)
        yield CounterMetricFamily("kvroute_index_evicted_blocks", "Dropped for the bound", index.evicted)
        yield CounterMetricFamily(
            "kvroute_index_orphaned_blocks",
            "Blocks not indexed: parent never seen, or a token-less store of a key the instance never stored",
            index.orphaned,
        )
        yield CounterMetricFamily("kvroute_index_mismatched_events", "Wrong block size", index.mismatched)
