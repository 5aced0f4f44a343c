"""Work the picker's gRPC and HTTP/2 libraries repeat for nothing, skipped.

grpclib runs on h2, hpack and hyperframe, pure Python. Per request through configs/envoy-epp.yaml's three
streams:
- grpclib logs at INFO each stream its peer resets, and Envoy resets the held answering stream at every
  request's end: a line and a file write a request;
- h2 builds `repr(frame)` of every frame it receives (about 12) for a trace logger grpclib never gives it;
- hpack calls `log.debug` for each header it encodes or decodes (about 80 calls);
- hpack decodes the same Huffman-coded `:path` on every stream: Envoy's encoder never indexes a pseudo-header
  but `:authority`, and hpack decodes Huffman a bit at a time in Python (7 us for that path).
At one connection the first cost the picker about 0.1 ms of CPU a request, the next two together as much,
the last 0.03-0.09 (docs/notes/overhead-investigations.md, "What the picker paid for that was not its work").
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import hpack.hpack
import hpack.table
import hyperframe.frame
from hpack.huffman_table import decode_huffman

_HPACK_MODULES = (hpack.hpack, hpack.table)
# Distinct Huffman-coded literals remembered: a gateway sends a handful (the method's path, a few values).
_DECODED_LITERALS = 256


class _Silent:
    """A module's `log` whose debug does nothing: hpack calls only debug."""

    def debug(self, *args: Any, **kwargs: Any) -> None:
        pass


@functools.lru_cache(maxsize=_DECODED_LITERALS)
def _decoded(coded: bytes) -> bytes:
    return decode_huffman(coded)


def _decode_huffman_once(huffman_string: bytes | bytearray | memoryview | None) -> bytes:
    # hpack hands over slices of a memoryview: a key of its own, which keeps no header block alive.
    return _decoded(bytes(huffman_string or b""))


def _short_repr(frame: hyperframe.frame.Frame) -> str:
    # hyperframe's repr also renders the flags and the body in hex: h2 builds it for every frame received.
    return f"{type(frame).__name__}(stream_id={frame.stream_id})"


def trim_library_costs() -> None:
    """Frames' reprs shortened to their type and stream, Huffman-coded literals decoded once; unless their
    loggers are on for DEBUG, grpclib's INFO lines dropped and hpack's debug calls made no-ops. Idempotent."""
    hyperframe.frame.Frame.__repr__ = _short_repr  # type: ignore[method-assign]
    hpack.hpack.decode_huffman = _decode_huffman_once  # type: ignore[attr-defined]
    stream_log = logging.getLogger("grpclib.server")
    if not stream_log.isEnabledFor(logging.DEBUG):
        stream_log.setLevel(logging.WARNING)
    if not logging.getLogger("hpack").isEnabledFor(logging.DEBUG):
        for module in _HPACK_MODULES:
            module.log = _Silent()  # type: ignore[attr-defined]
