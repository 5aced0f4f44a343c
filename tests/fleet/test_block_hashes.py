"""The simulated fleet's block hashes against those a real vLLM 0.32 announced (tests/fixtures/vllm, captured
with PYTHONHASHSEED=0 and the default sha256 algorithm): the same tokens under the same seed and keys must
hash alike, so a consumer that reproduces vLLM's hash from tokens finds the fleet's blocks as it would a real
instance's."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from fleet.block_pool import BlockHasher, BlockPool
from kvroute.processes import FleetPorts, running_fleet
from router.index.events import BlockStored, EventDecoder
from tests.support.http import post

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def stored_events(capture: str, seqs: set[int] | None = None) -> list[BlockStored]:
    frames: list[list[bytes]] = msgspec.msgpack.decode((FIXTURES / capture).read_bytes())
    decoder = EventDecoder()
    return [
        event
        for _topic, seq, payload in frames
        if seqs is None or int.from_bytes(seq, "big") in seqs
        for event in decoder.decode(payload).events
        if isinstance(event, BlockStored) and event.medium in (None, "GPU")
    ]


@pytest.mark.parametrize("capture, as_int", [("bytes", False), ("int", True)])
def test_every_block_a_real_vllm_stored_hashes_alike(capture: str, as_int: bool) -> None:
    seed = json.loads((FIXTURES / f"capture_{capture}.json").read_text())["env"]["PYTHONHASHSEED"]
    hasher, pool = BlockHasher(seed), BlockPool(2, 32, int_hashes=as_int)
    events = stored_events(f"events_{capture}.msgpack")
    assert events
    checked = 0
    for event in events:
        if as_int:  # only the low 64 bits are on the wire: check whole chains from the root
            if event.parent_block_hash is not None:
                continue
            hashes = hasher.chain(event.token_ids, event.block_size)
        else:
            parent = event.parent_block_hash
            assert parent is None or isinstance(parent, bytes)
            hashes = hasher.chain(event.token_ids, event.block_size, parent)
        assert [pool.wire_hash(h) for h in hashes] == event.block_hashes
        checked += len(hashes)
    assert checked >= 10


def test_a_cache_salt_keys_the_first_block_as_vllm_does() -> None:
    capture: dict[str, Any] = json.loads((FIXTURES / "lora_capture.json").read_text())
    hasher, pool = (
        BlockHasher(capture["env"]["PYTHONHASHSEED"]),
        BlockPool(2, 32),
    )  # 64-bit hashes on the wire
    by_name = {request["name"]: request for request in capture["requests"]}
    salted, plain = by_name["base-salted"], by_name["base"]
    assert salted["cache_salt"] and salted["model"] == plain["model"] == capture["base_model"]
    for entry in (plain, salted):
        events = stored_events("lora_events.msgpack", set(entry["seqs"]))
        tokens = entry["prompt_token_ids"]
        ours = hasher.chain(tokens, capture["block_size"], salt=entry["cache_salt"])
        announced = [h for event in events for h in event.block_hashes]
        assert announced and [pool.wire_hash(h) for h in ours[: len(announced)]] == announced
    assert (
        hasher.chain(plain["prompt_token_ids"], 32)[0]
        != hasher.chain(salted["prompt_token_ids"], 32, salt="x")[0]
    )


def test_the_fleet_announces_blocks_hashed_with_the_algorithm_and_seed_it_is_given(tmp_path: Path) -> None:
    ports = FleetPorts.allocate(1)
    context = zmq.Context()
    events = context.socket(zmq.SUB)
    events.connect(f"tcp://127.0.0.1:{ports.events}")
    events.setsockopt(zmq.SUBSCRIBE, b"")
    args = ["--prefix-caching-hash-algo", "sha256_cbor", "--hash-seed", "7", "--hash-type", "bytes"]
    try:
        with running_fleet(ports, tmp_path, args):
            base = f"http://127.0.0.1:{ports.http}"
            metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
            for attempt in range(5):  # a batch published before the subscription took hold is not seen
                body = {"model": "tiny-llama", "prompt": list(range(10 + attempt, 80)), "max_tokens": 1}
                assert post(base + "/v1/completions", json.dumps(body).encode())[0] == 200
                if events.poll(3_000):
                    break
            _topic, _seq, payload = events.recv_multipart(zmq.NOBLOCK)
    finally:
        events.close(linger=0)
        context.term()
    assert 'prefix_caching_hash_algo="sha256_cbor"' in metrics
    first = next(e for e in EventDecoder().decode(payload).events if isinstance(e, BlockStored))
    assert first.parent_block_hash is None and len(first.block_hashes) >= 2
    assert first.block_hashes == BlockHasher("7", "sha256_cbor").chain(first.token_ids, 32)
    assert first.block_hashes != BlockHasher("0", "sha256_cbor").chain(first.token_ids, 32)
