"""The event decoder: both encodings, both hash types, unknown fields, garbage."""

from __future__ import annotations

import msgspec
import pytest

from router.index.events import (
    MAX_DATA_PARALLEL_RANK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecoder,
    EventEncoder,
    MalformedBatch,
    pack_seq,
    unpack_seq,
)

BIG_INT = 2**64 - 1  # vLLM's integer hashes are unsigned 64-bit
STORED = BlockStored(
    block_hashes=[BIG_INT, 7],
    parent_block_hash=None,
    token_ids=list(range(64)),
    block_size=32,
    lora_id=None,
    medium="GPU",
    lora_name=None,
    extra_keys=[None, None],
    group_idx=0,
)
STORED_BYTES = BlockStored(
    block_hashes=[b"\x01" * 32],
    parent_block_hash=b"\x02" * 32,
    token_ids=list(range(32)),
    block_size=32,
    lora_id=None,
    medium="cpu",
    lora_name="adapter",
)
EVENTS = [STORED, STORED_BYTES, BlockRemoved(block_hashes=[BIG_INT], medium="GPU"), AllBlocksCleared()]


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_round_trip_in_both_encodings(encoding: str) -> None:
    batch = EventDecoder().decode(EventEncoder(encoding).encode(12.5, EVENTS, data_parallel_rank=1))
    assert batch.ts == 12.5
    assert batch.data_parallel_rank == 1
    assert batch.skipped_events == 0
    assert [msgspec.structs.asdict(e) for e in batch.events] == [msgspec.structs.asdict(e) for e in EVENTS]
    assert isinstance(batch.events[0], BlockStored)
    assert isinstance(batch.events[2], BlockRemoved)
    assert isinstance(batch.events[3], AllBlocksCleared)


def test_map_encoding_matches_vllm_keys() -> None:
    payload = msgspec.msgpack.decode(EventEncoder("map").encode(1.0, [STORED]))
    assert payload[0] == 1.0 and len(payload) == 2  # a None rank is omitted
    assert list(payload[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ]


def test_short_arrays_unknown_keys_and_extra_items_are_accepted() -> None:
    payload = msgspec.msgpack.encode(
        [
            2.0,
            [
                ["BlockStored", [1], None, [5] * 16, 16, None, "GPU"],  # an older, shorter array
                ["BlockRemoved", [1], "GPU", 0, "future", "fields"],
                {
                    "type": "BlockRemoved",
                    "block_hashes": [2],
                    "medium": None,
                    "locality": "LOCAL",
                    "new": [1],
                },
            ],
        ]
    )
    batch = EventDecoder().decode(payload)
    assert batch.skipped_events == 0
    assert batch.data_parallel_rank is None
    stored = batch.events[0]
    assert isinstance(stored, BlockStored) and stored.lora_name is None and stored.block_size == 16
    assert [e.block_hashes for e in batch.events] == [[1], [1], [2]]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad_event",
    [
        {"type": "Unheard"},
        {"type": "BlockStored"},
        {"type": "BlockRemoved", "block_hashes": "nope", "medium": None},
        ["BlockStored", [1]],
        ["NoSuchEvent", 1, 2],
        {"type": "BlockRemoved", "block_hashes": [1.5], "medium": None},
        42,
        [],
    ],
)
def test_a_bad_event_is_skipped_and_counted_while_its_neighbours_survive(bad_event: object) -> None:
    good = {"type": "AllBlocksCleared"}
    batch = EventDecoder().decode(msgspec.msgpack.encode([1.0, [good, bad_event, good]]))
    assert batch.skipped_events == 1
    assert len(batch.events) == 2


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"garbage",
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["x", []]),
        msgspec.msgpack.encode([1.0, [], 0])[:-1],
    ],
)
def test_a_payload_that_is_not_a_batch_raises_malformed(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        EventDecoder().decode(payload)


@pytest.mark.parametrize("rank", [-1, MAX_DATA_PARALLEL_RANK + 1, 2**63])
def test_a_rank_out_of_range_is_malformed(rank: int) -> None:
    with pytest.raises(MalformedBatch):
        EventDecoder().decode(msgspec.msgpack.encode([1.0, [], rank]))


def test_the_highest_rank_is_accepted() -> None:
    batch = EventDecoder().decode(msgspec.msgpack.encode([1.0, [], MAX_DATA_PARALLEL_RANK]))
    assert batch.data_parallel_rank == MAX_DATA_PARALLEL_RANK


@pytest.mark.parametrize("ts", [float("inf"), float("-inf"), float("nan")])
def test_a_timestamp_that_is_not_finite_is_malformed(ts: float) -> None:
    with pytest.raises(MalformedBatch):
        EventDecoder().decode(msgspec.msgpack.encode([ts, []]))


def test_sequence_frames() -> None:
    assert pack_seq(0) == b"\x00" * 8
    assert unpack_seq(pack_seq(2**64 - 2)) == 2**64 - 2
    assert unpack_seq((-1).to_bytes(8, "big", signed=True)) == -1
