"""The block index as Prometheus sees it, read at scrape time so ingest and lookup pay nothing for it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.index.block_index import BlockIndex, Tier


class IndexCollector:
    def __init__(self, index: BlockIndex, instances: Callable[[], Collection[str]] | None = None) -> None:
        """instances: the names configured now; an instance a reload removed keeps an empty entry in the
        index, which must not keep its series in /metrics."""
        self._index, self._instances = index, instances

    def collect(self) -> Iterator[Metric]:
        index = self._index
        current = self._instances() if self._instances is not None else None
        blocks: dict[tuple[str, str], int] = {}
        for (instance, _), sizes in index.entries_by_owner().items():  # ranks of an instance add up
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
            "kvroute_index_pool_members", "Instances pool blocks count for", len(index.pool_members())
        )
        yield GaugeMetricFamily("kvroute_index_bytes", "Memory the index holds", index.footprint_bytes())
        yield GaugeMetricFamily("kvroute_index_max_blocks", "Bound on index entries", index.max_entries)
        stats = index.stats
        yield CounterMetricFamily("kvroute_index_evicted_blocks", "Dropped for the bound", stats.evicted)
        yield CounterMetricFamily(
            "kvroute_index_orphaned_blocks",
            "Blocks not indexed: parent never seen, or a token-less store of a key the instance never stored",
            stats.orphaned,
        )
        yield CounterMetricFamily("kvroute_index_mismatched_events", "Wrong block size", stats.mismatched)
