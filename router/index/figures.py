"""The block index's figures as /metrics and the dashboard report them, in one value that can travel: a worker
of `kvroute serve --workers N` reads its host's (router/index/remote_index.py)."""

from __future__ import annotations

import msgspec

from router.index.block_index import BlockIndex


class IndexFigures(msgspec.Struct, frozen=True, array_like=True):
    entries: int = 0
    max_entries: int = 0
    bytes: int = 0
    pool_entries: int = 0
    pool_members: int = 0
    # (instance, data parallel rank, entries by tier)
    by_owner: list[tuple[str, int, tuple[int, ...]]] = []
    evicted: int = 0
    orphaned: int = 0
    mismatched: int = 0
    # what an operator must fix for the index to be built as configured (a foreign block size)
    warnings: list[str] = []


def figures_of(index: BlockIndex, warnings: list[str]) -> IndexFigures:
    stats = index.stats
    return IndexFigures(
        entries=index.entries,
        max_entries=index.max_entries,
        bytes=index.footprint_bytes(),
        pool_entries=index.pool_entries,
        pool_members=len(index.pool_members()),
        by_owner=[(name, rank, sizes) for (name, rank), sizes in index.entries_by_owner().items()],
        evicted=stats.evicted,
        orphaned=stats.orphaned,
        mismatched=stats.mismatched,
        warnings=warnings,
    )
