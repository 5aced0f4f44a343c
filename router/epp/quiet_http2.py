"""What the picker's HTTP/2 libraries do for debug output nobody reads, skipped.

grpclib runs on h2, hpack and hyperframe, pure Python. h2 builds `repr(frame)` of every frame it receives
for a trace logger grpclib never gives it, and hpack calls `log.debug` for each header it encodes or
decodes (about 80 calls a request through configs/envoy-epp.yaml's three streams). Together they cost the
picker about 0.1 ms of CPU a request at one connection (docs/benchmarks.md, section 6), 6% of it.
"""

from __future__ import annotations

import logging
from typing import Any

import hpack.hpack
import hpack.table
import hyperframe.frame

_HPACK_MODULES = (hpack.hpack, hpack.table)


class _Silent:
    """A module's `log` whose debug does nothing: hpack calls only debug."""

    def debug(self, *args: Any, **kwargs: Any) -> None:
        pass


def _short_repr(frame: hyperframe.frame.Frame) -> str:
    # hyperframe's repr also renders the flags and the body in hex: h2 builds it for every frame received.
    return f"{type(frame).__name__}(stream_id={frame.stream_id})"


def skip_debug_only_work() -> None:
    """Frames' reprs shortened to their type and stream, and hpack's debug calls made no-ops unless its
    logger is on for DEBUG. Idempotent."""
    hyperframe.frame.Frame.__repr__ = _short_repr  # type: ignore[method-assign]
    if logging.getLogger("hpack").isEnabledFor(logging.DEBUG):
        return
    for module in _HPACK_MODULES:
        module.log = _Silent()  # type: ignore[attr-defined]
