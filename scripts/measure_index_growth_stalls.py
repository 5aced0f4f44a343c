"""Which of the block index's batches hold the event loop longest, and why (its tables' growth): in-process.

Ingests BLOCKS blocks as `kvroute bench index` does (32-block GPU stores from 8 instances in turn), timing
each batch's BlockIndex.apply, and prints each batch that took more than --over-ms: its kernel (system) CPU
time, its page faults, and the tables (U64Maps, router/index/_u64map.pyx) whose move to larger arrays it
started.

A table that outgrows its arrays moves to new ones half again as large, a few entries per insert; but the new
slots are written at hashed, scattered places, so the first batch of the move touches nearly every page of
the new slot table, each a page fault that zeroes a fresh page. The arrays are madvised against huge pages so
that those faults follow the move in 4 KiB steps. In 2 MiB pages, in a VM whose memory the host backs only
once touched (free page reporting gives freed pages back), a fault took 7-9 ms here, and the batch that
started the move of the holders table of 1.35M blocks 70-117 ms, nearly all of it system time. --no-thp
disables huge pages for the whole process (prctl PR_SET_THP_DISABLE), to compare where they are in use.

    .venv/bin/python scripts/measure_index_growth_stalls.py --blocks 2000000
    .venv/bin/python scripts/measure_index_growth_stalls.py --blocks 2000000 --no-thp
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvroute.bench.index import _events  # noqa: E402
from kvroute.bench.index_parts import BLOCK_SIZE  # noqa: E402
from router.index._u64map import MOVE_STEP, U64Map  # noqa: E402
from router.index.block_index import BlockIndex  # noqa: E402
from router.index.holdings import Tier  # noqa: E402
from router.index.subscriber import Owner  # noqa: E402

PR_SET_THP_DISABLE = 41


def gpu_tables(index: BlockIndex, owner: Owner) -> dict[str, U64Map]:
    """The GPU tier's tables a batch of owner's stores into: the holders of each block, and owner's blocks."""
    holdings = index._holdings
    return {"holders": holdings.holders[Tier.GPU], f"{owner[0]}'s": holdings.owners[owner].blocks[Tier.GPU]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2_000_000)
    parser.add_argument("--over-ms", type=float, default=15.0, help="batches that took longer are printed")
    parser.add_argument("--no-thp", action="store_true", help="no transparent huge pages in this process")
    args = parser.parse_args()
    if args.no_thp and ctypes.CDLL(None).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_THP_DISABLE) failed")
    events = list(_events(args.blocks, seed=args.blocks))
    index = BlockIndex(BLOCK_SIZE, max_entries=args.blocks + 1)
    taken: list[float] = []
    gc.collect()
    gc.disable()  # the collector's pauses are another story
    started = time.perf_counter()
    for number, (owner, event) in enumerate(events):
        before = resource.getrusage(resource.RUSAGE_SELF)
        at = time.perf_counter()
        index.apply(owner, (event,))
        taken.append(time.perf_counter() - at)
        if taken[-1] * 1e3 > args.over_ms:
            after = resource.getrusage(resource.RUSAGE_SELF)
            moves = [
                f"{name} ({len(table):,})"
                for name, table in gpu_tables(index, owner).items()
                # begun in this batch: no more moved than its inserts move
                if table.moving and len(table) - table.moving <= len(event.block_hashes) * (MOVE_STEP + 1)
            ]
            print(
                f"batch {number:,} ({number * 32:,} blocks held): {taken[-1] * 1e3:.1f} ms, system "
                f"{(after.ru_stime - before.ru_stime) * 1e3:.1f} ms, page faults "
                f"{after.ru_minflt - before.ru_minflt}; moves started: {', '.join(moves) or 'none'}"
            )
    elapsed = time.perf_counter() - started
    gc.enable()
    taken.sort()
    print(
        f"{args.blocks:,} blocks{' without huge pages' if args.no_thp else ''}: "
        f"{args.blocks / elapsed / 1e6:.2f}M blocks/s; batches over 5 ms: {sum(t > 0.005 for t in taken)}, "
        f"over {args.over_ms:g} ms: {sum(t * 1e3 > args.over_ms for t in taken)}, "
        f"longest {taken[-1] * 1e3:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
