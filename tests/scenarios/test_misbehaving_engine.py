"""An engine that misbehaves at the byte level (tests/support/misbehaving_engine.py): whatever it sends, the
client gets an answer in OpenAI's shape or the bytes as the engine sent them, the router's memory stays
bounded, and the request's slot is freed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

from kvroute.processes import running_router, running_router_process
from tests.conftest import metric
from tests.support.fake_upstreams import only_instance
from tests.support.http import post
from tests.support.misbehaving_engine import JSON_HEAD, SSE_HEAD, Misbehaviour, misbehaving

STREAM = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
WHOLE = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 3}).encode()
CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'
DONE = b"data: [DONE]\n\n"
_MIB = 2**20


def _events(payload: bytes) -> list[bytes]:
    return [event for event in payload.split(b"\n\n") if event.strip()]


def peak_rss_mib(pid: int) -> float:
    """The process's resident memory at its highest so far (VmHWM)."""
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_an_engine_header_the_router_cannot_re_encode_is_passed_on_and_frees_the_slot(tmp_path: Path) -> None:
    """vLLM echoes the client's x-request-id; an engine may send bytes that are not Latin-1 text (0xff 0xfe,
    or UTF-8). The router passes the bytes on as they came, and every request ends: with two slots, eight
    such answers in a row are all answered, and none is left in flight."""
    for request_id in (b"\xff\xfe", "€".encode()):
        engine = Misbehaviour(SSE_HEAD + b"x-request-id: " + request_id + b"\r\n", lambda: [CHUNK, DONE])
        with misbehaving(engine) as port:
            config = only_instance("odd", port) | {"admission": {"max_in_flight": 2, "queue_timeout_s": 1}}
            with running_router(config, tmp_path) as url:
                for _ in range(8):
                    status, headers, payload = post(url + "/v1/completions", STREAM)
                    assert status == 200, payload
                    assert _events(payload) == [CHUNK.strip(), DONE.strip()]
                    assert headers["x-request-id"].encode("latin-1") == request_id  # the bytes, unchanged
                assert metric(url, "kvroute_instance_in_flight", vllm_instance="odd") == 0


def test_a_stream_closed_mid_event_without_framing_ends_with_an_error_event_and_done(tmp_path: Path) -> None:
    """A body with neither length nor chunking ends when the engine closes: a close in the middle of an event
    is a broken stream, not its end. The half event is dropped; an error event and [DONE] follow."""
    with misbehaving(Misbehaviour(SSE_HEAD, lambda: [CHUNK, CHUNK[:40]])) as port:
        with running_router(only_instance("closing", port), tmp_path) as url:
            status, _, payload = post(url + "/v1/completions", STREAM)
            assert status == 200
            events = _events(payload)
            assert events[0] == CHUNK.strip()
            assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "stream_broken", events
            assert events[2:] == [DONE.strip()]
            assert metric(url, "kvroute_upstream_errors_total", vllm_instance="closing", kind="stream") == 1


def test_an_engine_error_sent_as_an_event_stream_reaches_the_client_in_openai_shape(tmp_path: Path) -> None:
    body = b"data: engine exploded\n\n"
    head = b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/event-stream\r\n"
    head += b"content-length: %d\r\n" % len(body)
    with misbehaving(Misbehaviour(head, lambda: [body])) as port:
        with running_router(only_instance("erring", port), tmp_path) as url:
            status, headers, payload = post(url + "/v1/completions", STREAM)
            assert status == 500 and headers["content-type"] == "application/json", headers
            error = json.loads(payload)["error"]
            assert "engine exploded" in error["message"] and error["type"] == "upstream_error"


def test_response_timeout_bounds_a_whole_answer_that_drips(tmp_path: Path) -> None:
    """response_timeout_s is the longest a whole answer may take, not the longest between two of its bytes:
    an answer dripping a byte every 0.3 s never completes within 1.5 s and is answered 504."""
    answer = b'{"choices":[{"text":"slow"}]}'
    drops = [answer[i : i + 1] for i in range(len(answer))]
    engine = Misbehaviour(JSON_HEAD + b"content-length: %d\r\n" % len(answer), lambda: drops, pause_s=0.3)
    with misbehaving(engine) as port:
        config = only_instance("dripping", port) | {"upstream": {"response_timeout_s": 1.5}}
        with running_router(config, tmp_path) as url:
            started = time.monotonic()
            status, _, payload = post(url + "/v1/completions", WHOLE)
            elapsed = time.monotonic() - started
            assert status == 504 and b"response_timeout_s" in payload, payload
            assert elapsed < 5, f"answered after {elapsed:.1f} s, past the 1.5 s limit"


def _huge_answer(text_mib: int) -> Iterator[bytes]:
    yield b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"'
    for _ in range(text_mib):
        yield b"y" * _MIB
    yield b'"}],"usage":{"prompt_tokens":1,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":0}}}'


def test_a_whole_answer_larger_than_what_is_held_is_relayed_as_it_arrives(tmp_path: Path) -> None:
    """A whole answer is not held in full: 512 MiB of it pass through a router whose peak memory grows by
    far less, and the client gets every byte, the usage at its end included. The growth measured 4-6 MiB
    (16-73, at 256 and at 512 MiB alike, before the answer was read 256 KiB at a time), back to idle after:
    an answer held whole would grow it by its size."""
    text_mib = 512
    with misbehaving(Misbehaviour(JSON_HEAD, lambda: _huge_answer(text_mib))) as port:
        with running_router_process(only_instance("huge", port), tmp_path) as (url, router):
            before = peak_rss_mib(router.process.pid)
            status, _, payload = post(url + "/v1/completions", WHOLE)
            grown = peak_rss_mib(router.process.pid) - before
            length, usage = len(payload), json.loads(payload).get("usage") if status == 200 else None
            del payload  # kept out of pytest's report of a failure: its repr would be gigabytes
            assert status == 200 and length > text_mib * _MIB
            assert usage is not None and usage["completion_tokens"] == 7
            assert grown < text_mib / 4, f"the router's peak memory grew {grown:.0f} MiB"


def test_an_answer_head_past_what_a_header_may_hold_fails_cleanly_and_frees_the_slot(tmp_path: Path) -> None:
    """A header of 64 KiB: the HTTP client refuses the answer; the client gets a 502 in OpenAI's shape."""
    engine = Misbehaviour(JSON_HEAD + b"x-padding: " + b"p" * 65536 + b"\r\n", lambda: [b"{}"])
    with misbehaving(engine) as port:
        with running_router(only_instance("verbose", port), tmp_path) as url:
            status, _, payload = post(url + "/v1/completions", WHOLE)
            assert status == 502 and json.loads(payload)["error"]["code"] == "upstream_failed", payload
            assert metric(url, "kvroute_instance_in_flight", vllm_instance="verbose") == 0


def test_an_answer_head_that_never_ends_times_out(tmp_path: Path) -> None:
    """Headers sent a byte a second, never ending: the whole answer's deadline ends it."""
    head = b"HTTP/1.1 200 OK\r\n" + b"x-slow: " + b"s" * 100
    engine = Misbehaviour(b"", lambda: [head[i : i + 1] for i in range(len(head))], pause_s=0.2)
    with misbehaving(engine) as port:
        config = only_instance("slow-head", port) | {"upstream": {"response_timeout_s": 1.5}}
        with running_router(config, tmp_path) as url:
            started = time.monotonic()
            status, _, payload = post(url + "/v1/completions", WHOLE)
            assert status == 504 and b"response_timeout_s" in payload, payload
            assert time.monotonic() - started < 5


def test_a_stream_event_that_never_ends_is_relayed_as_it_comes(tmp_path: Path) -> None:
    """An engine that writes one event of 3 MiB without its blank line is not held past 1 MiB: the client gets
    most of it as it came (the last part still held when the connection closes is dropped), then the event
    ended, an error event and [DONE]: the close broke the stream in the middle of an event."""
    endless = b"data: " + b"x" * (3 * _MIB)
    engine = Misbehaviour(
        SSE_HEAD, lambda: [CHUNK] + [endless[i : i + _MIB] for i in range(0, len(endless), _MIB)]
    )
    with misbehaving(engine) as port:
        with running_router(only_instance("endless", port), tmp_path) as url:
            status, _, payload = post(url + "/v1/completions", STREAM)
            assert status == 200 and payload.startswith(CHUNK + endless[: 2 * _MIB])
            events = _events(payload)
            assert events[-1] == DONE.strip() and len(events) == 4, [event[:60] for event in events]
            assert json.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == "stream_broken"
