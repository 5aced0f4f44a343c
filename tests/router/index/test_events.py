"""The event decoder: both encodings, both hash types, unknown fields, garbage."""

from __future__ import annotations

from array import array
from typing import Any

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


def fields(event: Any) -> dict[str, Any]:
    """An event's fields, its token ids as a list whichever sequence holds them."""
    values = msgspec.structs.asdict(event)
    if "token_ids" in values:
        values["token_ids"] = list(values["token_ids"])
    return values


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("compiled", [True, False])
def test_round_trip_in_both_encodings(encoding: str, compiled: bool) -> None:
    batch = EventDecoder(compiled).decode(EventEncoder(encoding).encode(12.5, EVENTS, data_parallel_rank=1))
    assert batch.ts == 12.5
    assert batch.data_parallel_rank == 1
    assert batch.skipped_events == 0
    assert [fields(e) for e in batch.events] == [fields(e) for e in EVENTS]
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


# What vLLM 0.32 sends for a plain prefill (reference/vllm-kv-events.md), with a field a later vLLM might add
VLLM_STORED = {
    "type": "BlockStored",
    "block_hashes": [BIG_INT, 2**63],
    "parent_block_hash": 5,
    "token_ids": [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1] * 4,
    "block_size": 16,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
    "kv_cache_spec_sliding_window": None,
    "locality": {"nested": [1, 2.5, b"x", None, True]},
}


def test_vllms_common_batch_decodes_in_c_as_msgspec_decodes_it() -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU", "group_idx": 0}
    payload = msgspec.msgpack.encode([7.25, [VLLM_STORED, removed, {"type": "AllBlocksCleared"}], 3])
    compiled, reference = EventDecoder().decode(payload), EventDecoder(compiled=False).decode(payload)
    stored = compiled.events[0]
    assert isinstance(stored, BlockStored)
    assert type(stored.token_ids) is array and stored.token_ids.typecode == "I"  # no object per token
    assert type(reference.events[0].token_ids) is list  # type: ignore[union-attr]
    assert (compiled.ts, compiled.data_parallel_rank, compiled.skipped_events) == (7.25, 3, 0)
    assert [fields(e) for e in compiled.events] == [fields(e) for e in reference.events]


@pytest.mark.parametrize(
    ("unusual", "kept"),
    [
        ({"token_ids": [1, -1] * 16}, 2),  # no uint32: kept as a list, for the index to count as mismatched
        ({"token_ids": [1, 2**32] * 16}, 2),
        ({"extra_keys": [["adapter"], None]}, 2),  # a block's own keys
        ({"token_ids": [1.5] * 32}, 1),  # no event at all: skipped
        ({"block_size": None}, 1),
        ({"medium": b"GPU"}, 1),
    ],
)
def test_what_the_compiled_decoder_does_not_read_decodes_as_before(
    unusual: dict[str, Any], kept: int
) -> None:
    payload = msgspec.msgpack.encode([1.0, [{**VLLM_STORED, **unusual}, {"type": "AllBlocksCleared"}]])
    compiled, reference = EventDecoder().decode(payload), EventDecoder(compiled=False).decode(payload)
    assert compiled.skipped_events == reference.skipped_events
    assert [fields(e) for e in compiled.events] == [fields(e) for e in reference.events]
    assert len(compiled.events) == kept


_REMOVED_HEAD = b"\x84\xa4type\xacBlockRemoved\xacblock_hashes\x91\x01\xa6medium\xc0"  # then one more key


@pytest.mark.parametrize(
    "event",
    [
        _REMOVED_HEAD + b"\xa1z\xc1",  # a value no msgpack has (0xc1) in a field skipped: no batch at all
        _REMOVED_HEAD + b"\xa4type\xa1x",  # tagged twice, the tags differ: the event is skipped
        _REMOVED_HEAD + b"\xa4type\xacBlockRemoved",  # tagged twice alike: kept
    ],
)
def test_what_msgspec_refuses_in_an_event_the_compiled_decoder_refuses(event: bytes) -> None:
    payload = (
        b"\x92\xcb" + msgspec.msgpack.encode(1.0)[1:] + b"\x92" + msgspec.msgpack.encode(VLLM_STORED) + event
    )
    outcomes = []
    for decoder in (EventDecoder(), EventDecoder(compiled=False)):
        try:
            batch = decoder.decode(payload)
        except MalformedBatch:
            outcomes.append(None)
        else:
            outcomes.append((len(batch.events), batch.skipped_events))
    assert outcomes[0] == outcomes[1]


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


@pytest.mark.parametrize("compiled", [True, False])
def test_a_string_that_is_no_utf8_costs_its_event_only(compiled: bool) -> None:
    """msgspec raises UnicodeDecodeError, not DecodeError, for such a string: it used to escape the decoder
    and end the subscriber's session (a rogue publisher could keep it reconnecting)."""
    good = msgspec.msgpack.encode({"type": "AllBlocksCleared"})
    bad_tag = b"\x81\xa4type\xa2\xc3\x28"  # {"type": <two bytes that are no UTF-8>}
    bad_medium = b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x90\xa6medium\xa1\xff"
    for bad in (bad_tag, bad_medium):
        batch = EventDecoder(compiled).decode(
            b"\x92\xcb" + msgspec.msgpack.encode(1.0)[1:] + b"\x93" + good + bad + good
        )
        assert (batch.skipped_events, len(batch.events)) == (1, 2)


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
