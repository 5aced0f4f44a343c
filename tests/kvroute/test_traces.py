from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path

import pytest

from kvroute.traces import MOONCAKE_TRACE, Trace, TraceRequest, agentic_trace, load_trace, mooncake_trace


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_load_trace_converts_milliseconds_and_sorts(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
            {"timestamp": 1000, "input_length": 512, "output_length": 7, "hash_ids": [0]},
        ],
    )
    trace = load_trace(path)
    assert trace.name == "t"
    assert trace.block_tokens == 512
    assert [r.arrival_s for r in trace.requests] == [0.0, 2.0]
    assert trace.requests[1] == TraceRequest(2.0, 600, 5, (0, 2))


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"timestamp": 0, "input_length": 10, "output_length": 1}',
        '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [0]}',
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}',
        '{"timestamp": "0", "input_length": 10, "output_length": 1, "hash_ids": [0]}',
        "[1, 2]",
    ],
)
def test_malformed_lines_name_their_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n' + line + "\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed"):
        load_trace(path)


def test_with_rate_compresses_arrivals_head_keeps_the_first_and_skip_the_rest() -> None:
    trace = Trace("t", 512, tuple(TraceRequest(float(s), 10, 1, (0,)) for s in (0, 2, 4)))
    assert [r.arrival_s for r in trace.with_rate(2).requests] == [0.0, 1.0, 2.0]
    assert trace.head(2).requests == trace.requests[:2]
    assert [r.arrival_s for r in trace.skip(1).requests] == [0.0, 2.0]  # from the first one left
    assert trace.skip(1).name == "t after 1" and trace.skip(0) is trace
    assert trace.skip(3).requests == ()
    with pytest.raises(ValueError):
        trace.skip(-1)
    with pytest.raises(ValueError):
        trace.with_rate(0)


def test_agentic_sessions_grow_by_prefix_and_share_the_system_prompt() -> None:
    trace = agentic_trace(seed=3, sessions=12)
    assert trace == agentic_trace(seed=3, sessions=12)
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    last: dict[str, TraceRequest] = {}
    for request in trace.requests:
        assert request.session is not None
        assert len(request.block_ids) == -(-request.input_tokens // 512)
        assert request.block_ids[:7] == tuple(range(7))  # 4,000 shared tokens: 7 full blocks
        previous = last.get(request.session)
        if previous is not None:
            assert request.block_ids[: len(previous.block_ids)] == previous.block_ids
            assert request.input_tokens > previous.input_tokens
            assert 1.0 <= request.arrival_s - previous.arrival_s <= 80.0
        last[request.session] = request
    assert len(last) == 12
    ratio = sum(r.input_tokens for r in trace.requests) / sum(r.output_tokens for r in trace.requests)
    assert ratio == pytest.approx(131, rel=0.02)
    assert max(r.input_tokens for r in trace.requests) <= 180_000


def test_xz_traces_read_as_plain_ones(tmp_path: Path) -> None:
    records = [{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]}]
    plain = _write(tmp_path / "t.jsonl", records)
    compressed = tmp_path / "t.jsonl.xz"
    compressed.write_bytes(lzma.compress(plain.read_bytes()))
    assert load_trace(compressed) == load_trace(plain)  # named "t" too
    compressed.write_bytes(lzma.compress(b"not json\n"))
    with pytest.raises(ValueError, match=r"t\.jsonl\.xz:1: malformed"):
        load_trace(compressed)


# SHA-256 of FAST25-release/traces/conversation_trace.jsonl in kvcache-ai/Mooncake (kvroute/data/README.md)
MOONCAKE_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def test_the_packaged_mooncake_trace() -> None:
    assert MOONCAKE_TRACE.parent.name == "data" and MOONCAKE_TRACE.parent.parent.name == "kvroute"
    assert hashlib.sha256(lzma.decompress(MOONCAKE_TRACE.read_bytes())).hexdigest() == MOONCAKE_SHA256
    trace = mooncake_trace()
    assert trace.name == "mooncake-conversation" and trace.block_tokens == 512
    assert len(trace.requests) == 12_031
    first = trace.requests[0]
    assert (first.arrival_s, first.input_tokens, first.output_tokens) == (0.0, 6758, 500)
    assert first.block_ids == tuple(range(14))
    assert trace.requests[1].block_ids[:2] == (0, 14)  # shares the first block with the first request
    assert all(len(r.block_ids) == -(-r.input_tokens // 512) for r in trace.requests)
    assert trace.duration_s == pytest.approx(3537.0, abs=1.0)
    assert all(r.session is None for r in trace.requests[:100])
