"""Memory the C allocator keeps after a burst, given back to the system.

A burst of KV events is queued by ZMQ's receive thread while the index catches up. glibc keeps what those
messages took in that thread's arena once they are freed, and hands none of it back on its own: a `kvroute
serve` that had just followed 2M blocks held about 190 bytes a block where its index takes about 60, and
still did once idle. malloc_trim(0) returns the free pages of every arena: then it holds about 60
(`kvroute bench index`, its host rows).

The trim runs every TRIM_INTERVAL_S in a worker thread, where it holds no lock of Python's (ctypes lets the
GIL go): 0.1-6 ms here, during which a malloc of the event loop's in the arena being trimmed waits. Where
the C library has no malloc_trim (musl, macOS) there is nothing to trim.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

TRIM_INTERVAL_S = 10.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, among the symbols the process has loaded already; None where there is none."""
    try:
        found = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    found.argtypes, found.restype = [ctypes.c_size_t], ctypes.c_int
    return found


_MALLOC_TRIM = _malloc_trim()
trims = _MALLOC_TRIM is not None  # whether trim can give anything back here


def trim() -> bool:
    """Free memory given back to the system, blocking (run it in a thread); whether any was."""
    return _MALLOC_TRIM is not None and bool(_MALLOC_TRIM(0))
