"""Matching a prompt's block chain against the block index: each instance's contiguous prefix, by best tier.

All in C where it counts: one table probe per block and tier gives each block's holders as an owner mask; the
running AND of those masks (owners holding every block so far) never grows, so it is runs of equal masks
(and_runs), and the owners a run loses where it ends match up to there (match_lengths).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import TypeAlias

from router.index._u64map import U64Map, and_runs, match_lengths, matches_on_gpu
from router.index.holdings import Holdings, Tier
from router.index.kv_groups import GroupConstraints
from router.index.speculation import Speculations
from scorers.request import TierMatch

Masks: TypeAlias = list[int] | None  # each block's holders in a tier, as owner bits; None: no one holds any


class Matcher:
    def __init__(self, holdings: Holdings, speculations: Speculations, groups: GroupConstraints) -> None:
        self._holders = holdings.holders
        self._owner_at = holdings.owner_at
        self._speculations = speculations
        self._groups = groups

    def match(self, chain: Sequence[int], include_pool: bool, reusable: int | None) -> dict[str, TierMatch]:
        """BlockIndex.match."""
        gpu, cpu, pool = self._probe(chain, include_pool)
        return self._matched(chain, gpu, cpu, either(either(gpu, cpu), pool), reusable, {})

    def match_with_own(
        self, chain: Sequence[int], reusable: int | None
    ) -> tuple[dict[str, TierMatch], dict[str, TierMatch]]:
        """BlockIndex.match_with_own."""
        gpu, cpu, pool = self._probe(chain)
        held = either(gpu, cpu)
        cuts: dict[tuple[int, int], int] = {}
        own = self._matched(chain, gpu, cpu, held, reusable, cuts)
        if pool is None:
            return own, own
        return self._matched(chain, gpu, cpu, either(held, pool), reusable, cuts), own

    def _probe(self, chain: Sequence[int], include_pool: bool = True) -> tuple[Masks, Masks, Masks]:
        """Each block's holders in the GPU (speculative entries too), CPU and pool tiers; None for a tier no
        one holds anything in, and for every tier when chain is empty."""
        speculations = self._speculations
        speculations.expire()
        if not chain:
            return None, None, None
        holders = self._holders
        gpu = holder_masks(chain, holders[Tier.GPU], speculations.pending)
        cpu = holder_masks(chain, holders[Tier.CPU])
        return gpu, cpu, holder_masks(chain, holders[Tier.POOL]) if include_pool else None

    def _matched(
        self,
        chain: Sequence[int],
        gpu: Masks,
        cpu: Masks,
        held: Masks,
        reusable: int | None,
        cuts: dict[tuple[int, int], int],
    ) -> dict[str, TierMatch]:
        """The matches of held, each block's holders over the tiers counted. A hybrid model's owner's match
        is then cut to what its other KV cache groups allow (cuts: those found already, by owner and match
        length, the owner by its bit's position)."""
        if held is None:
            return {}
        ends = match_lengths(and_runs(held))
        if self._groups:
            groups, limit = self._groups, len(chain) if reusable is None else reusable
            pending = self._speculations.pending
            for at, end in ends.items():
                if groups.constrains(bit := 1 << at):
                    if (found := cuts.get((at, end))) is None:
                        found = cuts[at, end] = groups.cut(bit, chain, min(end, limit), pending)
                    ends[at] = found
            ends = {at: end for at, end in ends.items() if end}
        return self._attribute(ends, gpu, cpu, only_gpu=held is gpu)

    def _attribute(
        self, ends: dict[int, int], gpu: list[int] | None, cpu: list[int] | None, only_gpu: bool
    ) -> dict[str, TierMatch]:
        """Credit each matched block to the best tier its owner holds it in (GPU, then CPU, then pool); ends:
        each owner's match length by its bit's position."""
        if only_gpu:  # the common case, in C
            return matches_on_gpu(ends, self._owner_at, TierMatch)
        if cpu is not None and gpu is not None:
            cpu = list(map(operator.and_, cpu, map(operator.invert, gpu)))  # CPU copies not also on GPU
        matches: dict[str, TierMatch] = {}
        owner_at = self._owner_at
        for at, end in ends.items():
            bit = 1 << at
            on_gpu = _count_with(gpu, bit, end)
            on_cpu = _count_with(cpu, bit, end)
            found = TierMatch(on_gpu, on_cpu, end - on_gpu - on_cpu)
            name = owner_at[at][0]
            known = matches.get(name)
            if known is None or _total(found) > _total(known):
                matches[name] = found
        return matches


def holder_masks(
    chain: Sequence[int], table: U64Map, pending: dict[int, int] | None = None
) -> list[int] | None:
    """Each block's holder mask in a tier's table, or'ed with pending's (speculative entries); None when both
    are empty."""
    if not table and not pending:
        return None
    return table.masks_of(chain, pending)


def either(first: list[int] | None, second: list[int] | None) -> list[int] | None:
    """Each block's holders in either of two tiers' masks (None: a tier no one holds anything in)."""
    if first is None or second is None:
        return second if first is None else first
    return list(map(operator.or_, first, second))


def _count_with(masks: list[int] | None, bit: int, end: int) -> int:
    """How many of the first end masks have bit set, counted in C."""
    if masks is None:
        return 0
    return end - list(map(operator.and_, itertools.islice(masks, end), itertools.repeat(bit))).count(0)


def _total(match: TierMatch) -> int:
    return match.gpu + match.cpu + match.pool
