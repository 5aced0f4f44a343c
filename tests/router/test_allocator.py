"""The C allocator's free memory given back (router/allocator.py): by the call itself, and by a real `kvroute
serve` after a burst of KV events."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import pytest

from kvroute.bench.index_workers import measure_router_memory
from router import allocator

pytestmark = pytest.mark.skipif(not allocator.trims, reason="this C library has no malloc_trim")


def test_what_a_thread_freed_between_what_it_keeps_is_given_back() -> None:
    """Freed chunks between kept ones are no heap's top, which glibc trims by itself: only a trim returns
    their pages, as it must those of ZMQ's receive thread."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    kept: list[int] = []

    def churn() -> None:
        chunks = [libc.malloc(64 * 1024) for _ in range(512)]
        for chunk in chunks[::2]:
            libc.free(chunk)
        kept.extend(chunks[1::2])

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    try:
        assert allocator.trim()
    finally:
        for chunk in kept:
            libc.free(chunk)


def test_a_router_keeps_no_more_than_its_index_once_a_burst_of_events_is_over() -> None:
    """400K blocks from 8 publishers: the messages ZMQ queued while the index caught up took 206-234 bytes a
    block at the burst's end (here); a trim interval later the router held 84-102, and 216-229 with the trim
    made a no-op: the bound lies between."""
    memory = measure_router_memory(blocks=400_000, workers=1)
    assert memory.rss_growth_bytes <= memory.burst_rss_growth_bytes
    assert memory.rss_growth_bytes / memory.blocks < 150
