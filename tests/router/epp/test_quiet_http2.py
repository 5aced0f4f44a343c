"""router/epp/quiet_http2.py: the picker's HTTP/2 libraries skip the work done only for debug output, and
keep it when their logger is on for DEBUG."""

from __future__ import annotations

import logging

import hpack
import hpack.hpack
import hpack.table
import pytest
from hyperframe.frame import DataFrame

from router.epp.quiet_http2 import skip_debug_only_work

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
    skip_debug_only_work()
    assert repr(DataFrame(7, data=b"a body not rendered")) == "DataFrame(stream_id=7)"


def test_hpack_makes_no_debug_call_when_its_logger_is_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_loggers(monkeypatch)
    caplog.set_level(logging.INFO, logger="hpack")
    skip_debug_only_work()
    calls = debug_calls(monkeypatch)
    assert list(hpack.Decoder().decode(hpack.Encoder().encode(HEADERS))) == HEADERS  # type: ignore[comparison-overlap]
    assert calls == []


def test_hpack_logs_as_before_when_its_logger_is_on_for_debug(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_loggers(monkeypatch)
    caplog.set_level(logging.DEBUG, logger="hpack")
    skip_debug_only_work()
    calls = debug_calls(monkeypatch)
    hpack.Decoder().decode(hpack.Encoder().encode(HEADERS))
    assert calls and set(calls) <= {"hpack.hpack", "hpack.table"}
