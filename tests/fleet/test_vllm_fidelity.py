"""The simulated fleet against a capture from real vLLM 0.32 (tests/fixtures/vllm, scripts/capture_vllm_fixtures.py).

Every captured request is replayed, in order, against one simulated instance configured like the captured
engine (32-token blocks, 72 KV blocks, max_model_len 2048). Output tokens differ (random weights vs our
sampler), so where real vLLM stopped early on EOS the replay asks for the same number of tokens; everything
that depends only on lengths and on the cache's semantics must then match.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvroute.processes import FleetPorts, running_fleet
from router.index.events import BlockRemoved, BlockStored, EventDecoder, KVEvent, unpack_seq
from tests.fleet.layout import key_paths, sse_chunks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
ENGINE_ARGS = [
    "--block-size",
    "32",
    "--kv-blocks",
    "72",
    "--max-model-len",
    "2048",
    "--prefill-tps",
    "1000000",
    "--decode-tps",
    "5000",
]


@dataclass
class Replayed:
    name: str
    status: int
    content_type: str
    body: bytes


@dataclass
class Session:
    capture: dict[str, Any]
    responses: dict[str, Replayed]
    frames: list[list[bytes]]  # from the replay socket, end marker included


def _frames(path: Path) -> list[list[bytes]]:
    frames: list[list[bytes]] = msgspec.msgpack.decode(path.read_bytes())
    return frames


def _request(url: str, method: str, body: Any) -> tuple[int, str, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers["content-type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["content-type"], error.read()


def _replay_request(replay_port: int) -> list[list[bytes]]:
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while dealer.poll(10_000):
            frames.append(dealer.recv_multipart())
            if unpack_seq(frames[-1][2]) == -1:
                return frames
        raise AssertionError("no end marker from the replay socket")
    finally:
        context.destroy(linger=0)


def _replay(hash_type: str, tmp: Path) -> Session:
    capture = json.loads((FIXTURES / "capture_int.json").read_text())
    ports = FleetPorts.allocate(1)
    responses = {}
    with running_fleet(ports, tmp, [*ENGINE_ARGS, "--hash-type", hash_type]):
        base = f"http://127.0.0.1:{ports.http}"
        for recorded in capture["requests"]:
            body = recorded["request"]
            response = recorded.get("response")
            if isinstance(response, dict) and response.get("choices", [{}])[0].get("finish_reason") == "stop":
                body = {**body, "max_tokens": response["usage"]["completion_tokens"]}  # real vLLM hit EOS
            method = recorded["method"]
            status, content_type, payload = _request(base + recorded["path"], method, body)
            responses[recorded["name"]] = Replayed(recorded["name"], status, content_type, payload)
        frames = _replay_request(ports.replay)
    return Session(capture, responses, frames)


@pytest.fixture(scope="module", params=["int", "bytes"])
def session(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    yield _replay(request.param, tmp_path_factory.mktemp(f"fidelity-{request.param}"))


def _decode(frames: list[list[bytes]]) -> list[list[KVEvent]]:
    decoder = EventDecoder()
    batches = []
    for frame in frames:
        batch = decoder.decode(frame[-1])
        assert batch.skipped_events == 0
        assert batch.data_parallel_rank == 0
        batches.append(batch.events)
    return batches


def _shape(batches: list[list[KVEvent]]) -> list[list[tuple[str, int]]]:
    return [[(type(e).__name__, len(getattr(e, "block_hashes", ()))) for e in events] for events in batches]


def _hash_structure(batches: list[list[KVEvent]]) -> list[list[int]]:
    """Each hash replaced by the order of its first appearance: equal structures mean the same blocks were
    stored, re-stored, chained and evicted, whatever the hash function."""
    first_seen: dict[object, int] = {}

    def canon(h: object) -> int:
        return first_seen.setdefault(h, len(first_seen))

    structure = []
    for events in batches:
        for event in events:
            if isinstance(event, BlockStored):
                parent = -1 if event.parent_block_hash is None else canon(event.parent_block_hash)
                structure.append([parent, *(canon(h) for h in event.block_hashes)])
            elif isinstance(event, BlockRemoved):
                structure.append([-2, *(canon(h) for h in event.block_hashes)])
            else:
                structure.append([-3])
    return structure


def test_event_batches_match_real_vllm_one_for_one(session: Session) -> None:
    ours = session.frames[:-1]
    real = _frames(FIXTURES / "events_int.msgpack")
    assert [unpack_seq(f[2]) for f in ours] == list(range(len(real)))
    assert _shape(_decode(ours)) == _shape(_decode([f[1:] for f in real]))


def test_evictions_duplicates_and_chains_match_real_vllm(session: Session) -> None:
    real = _decode(_frames(FIXTURES / "events_int.msgpack"))
    assert _hash_structure(_decode(session.frames[:-1])) == _hash_structure(real)


def test_prompt_blocks_carry_the_same_token_ids_as_real_vllm(session: Session) -> None:
    real = _decode(_frames(FIXTURES / "events_int.msgpack"))
    ours = _decode(session.frames[:-1])
    compared = 0
    for recorded in session.capture["requests"]:
        response = recorded.get("response")
        if not recorded["seqs"] or not isinstance(response, dict) or "usage" not in response:
            continue
        prompt_tokens = response["usage"]["prompt_tokens"]
        seq = recorded["seqs"][0]
        real_stored = [e for e in real[seq] if isinstance(e, BlockStored)]
        our_stored = [e for e in ours[seq] if isinstance(e, BlockStored)]
        for real_event, our_event in zip(real_stored, our_stored, strict=True):
            if real_event.parent_block_hash is None and len(real_event.token_ids) <= prompt_tokens:
                assert our_event.token_ids == real_event.token_ids, recorded["name"]
                compared += 1
    assert compared >= 5


def test_hash_types_follow_the_setting(session: Session) -> None:
    stored = [e for events in _decode(session.frames[:-1]) for e in events if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    if all(isinstance(h, int) for h in hashes):
        assert all(0 <= h < 2**64 for h in hashes)  # type: ignore[operator]
    else:
        assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    real_keys = list(msgspec.msgpack.decode(_frames(FIXTURES / "events_int.msgpack")[0][2])[1][0])
    our_keys = list(msgspec.msgpack.decode(session.frames[0][-1])[1][0])
    assert our_keys == real_keys


def test_replay_frames_have_vllms_layout(session: Session) -> None:
    real = _frames(FIXTURES / "replay_int.msgpack")
    ours = session.frames
    assert len(ours) == len(real)
    assert [len(f) for f in ours] == [len(f) for f in real]
    assert [f[0] for f in ours] == [f[0] for f in real] == [b""] * len(real)
    assert ours[-1][1:] == real[-1][1:] == [b"", (-1).to_bytes(8, "big", signed=True), b""]


@pytest.mark.parametrize("name", ["chat", "completion", "models", "tokenize_chat", "reset_prefix_cache"])
def test_json_bodies_have_vllms_keys(session: Session, name: str) -> None:
    recorded = {r["name"]: r for r in session.capture["requests"]}[name]
    replayed = session.responses[name]
    assert replayed.status == recorded["status"]
    assert replayed.content_type.split(";")[0] == recorded["content_type"].split(";")[0]
    assert key_paths(json.loads(replayed.body)) == key_paths(recorded["response"])


@pytest.mark.parametrize("name", ["chat_stream", "completion_stream"])
def test_stream_chunks_have_vllms_keys(session: Session, name: str) -> None:
    recorded = {r["name"]: r for r in session.capture["requests"]}[name]
    ours, real = sse_chunks(session.responses[name].body.decode()), sse_chunks(recorded["sse"])
    assert len(ours) == len(real)
    assert [key_paths(c) for c in ours] == [key_paths(c) for c in real]
    assert session.responses[name].body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    "name", ["tokenize_chat", "tokenize_chat_gen", "tokenize_completion", "reset_prefix_cache"]
)
def test_identical_bodies(session: Session, name: str) -> None:
    recorded = {r["name"]: r for r in session.capture["requests"]}[name]
    assert json.loads(session.responses[name].body) == recorded["response"]


@pytest.mark.parametrize("name", ["error_too_long", "error_prompt_too_long", "error_unknown_model"])
def test_errors_match_vllm_word_for_word(session: Session, name: str) -> None:
    recorded = {r["name"]: r for r in session.capture["requests"]}[name]
    assert session.responses[name].status == recorded["status"]
    assert json.loads(session.responses[name].body) == recorded["response"]


def test_usage_matches_including_the_clamped_budget(session: Session) -> None:
    for recorded in session.capture["requests"]:
        response = recorded.get("response")
        if isinstance(response, dict) and "usage" in response:
            ours = json.loads(session.responses[recorded["name"]].body)["usage"]
            assert ours == response["usage"], recorded["name"]


def test_metrics_use_vllms_names_labels_and_prefix_counts(session: Session) -> None:
    recorded = {r["name"]: r for r in session.capture["requests"]}["metrics"]

    def samples(text: str) -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("vllm:"):
                    found.setdefault(sample.name, []).append(sample)
        return found

    real, ours = samples(recorded["text"]), samples(session.responses["metrics"].body.decode())
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in ours, name
    for name, our_samples in ours.items():
        assert name in real, name
        assert {tuple(sorted(s.labels)) for s in our_samples} == {tuple(sorted(s.labels)) for s in real[name]}
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
    ):
        assert ours[name][0].value == real[name][0].value, name
