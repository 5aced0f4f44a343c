"""What a KV-event message costs the block index as the fleet grows: the messages kvroute bench index
publishes (a chain of BlockStored events each), decoded and applied in process, taking turns among OWNERS
instances, as a router following that many engines takes them. A fleet of more than 80 owners holds each
block's holders as a wide int rather than inline.

    python scripts/measure_index_owners.py --owners 8,2000 --blocks-per-message 1
    python scripts/measure_index_owners.py --owners 8,2000 --blocks-per-message 32
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvroute.bench.index_ingest import _payloads
from router.index.block_index import BlockIndex
from router.index.events import EventDecoder

_BLOCK_SIZE = 16


def microseconds_a_message(owners: int, messages: int, blocks_per_message: int) -> float:
    each = max(1, messages // owners)
    payloads = [
        [frames[2] for frames in _payloads(n, each, blocks_per_message, _BLOCK_SIZE)] for n in range(owners)
    ]
    index = BlockIndex(_BLOCK_SIZE, max_entries=owners * each * blocks_per_message + 1)
    decoder = EventDecoder()
    names = [(f"p{n}", 0) for n in range(owners)]
    gc.disable()  # as in a router past its start (its objects frozen), the collector is not what is measured
    try:
        started = time.process_time()
        for turn in range(each):
            for owner, name in enumerate(names):
                index.apply(name, decoder.decode(payloads[owner][turn]).events)
        return (time.process_time() - started) / (owners * each) * 1e6
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--owners", default="8,2000", help="comma-separated")
    parser.add_argument("--blocks-per-message", type=int, default=1)
    parser.add_argument("--messages", type=int, default=0, help="0: 200,000 of one block, 62,000 of more")
    args = parser.parse_args()
    messages = args.messages or (200_000 if args.blocks_per_message == 1 else 62_000)
    for owners in (int(n) for n in args.owners.split(",")):
        cost = microseconds_a_message(owners, messages, args.blocks_per_message)
        print(f"{owners} owners, {args.blocks_per_message} blocks a message: {cost:.2f} µs a message")


if __name__ == "__main__":
    main()
