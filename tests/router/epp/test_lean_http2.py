"""router/epp/lean_http2.py: the picker's HTTP/2 libraries skip the work done only for debug output (and keep
it when their logger is on for DEBUG), and decode a Huffman-coded literal once."""

from __future__ import annotations

import logging

import hpack
import hpack.hpack
import hpack.table
import pytest
from hyperframe.frame import DataFrame

from router.epp.lean_http2 import _decoded, trim_library_costs

HEADERS = [
    (":method", "POST"),
    (":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
    ("te", "trailers"),
]


def debug_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every logging debug call made from now on, by its logger's name."""
    calls: list[str] = []
    original = logging.Logger.debug

    def counted(self: logging.Logger, *args: object, **kwargs: object) -> None:
        calls.append(self.name)
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(logging.Logger, "debug", counted)
    return calls


def real_loggers(monkeypatch: pytest.MonkeyPatch) -> None:
    """hpack's own loggers back, as before any picker in this process skipped them."""
    for module in (hpack.hpack, hpack.table):
        monkeypatch.setattr(module, "log", logging.getLogger(module.__name__))


def test_a_frame_is_shown_by_its_type_and_stream_not_its_body() -> None:
    trim_library_costs()
    assert repr(DataFrame(7, data=b"a body not rendered")) == "DataFrame(stream_id=7)"


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_hpack_calls_debug_only_when_its_logger_is_on_for_it(
    level: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_loggers(monkeypatch)
    caplog.set_level(level, logger="hpack")
    trim_library_costs()
    calls = debug_calls(monkeypatch)
    assert list(hpack.Decoder().decode(hpack.Encoder().encode(HEADERS))) == HEADERS  # type: ignore[comparison-overlap]
    if level == logging.DEBUG:
        assert calls and set(calls) <= {"hpack.hpack", "hpack.table"}
    else:
        assert calls == []


def test_a_huffman_coded_literal_is_decoded_once() -> None:
    trim_library_costs()
    trim_library_costs()  # idempotent
    _decoded.cache_clear()
    encoded = hpack.Encoder().encode(HEADERS, huffman=True)
    for _ in range(3):
        assert list(hpack.Decoder().decode(encoded)) == HEADERS  # type: ignore[comparison-overlap]
    info = _decoded.cache_info()
    assert info.misses >= 1 and info.hits == 2 * info.misses
