"""vLLM's KV-cache event wire format: typed structs, one decoder for both encodings, frame helpers.

A batch is the msgpack array ``[ts, events, data_parallel_rank]``. Events are tagged structs, encoded as
maps (``{"type": "BlockStored", ...}``, vLLM >= 0.26) or as arrays (``["BlockStored", ...]``, older, trailing
defaults omitted). Unknown keys and extra trailing array items are ignored, as newer vLLM adds fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, TypeAlias, get_args

import msgspec

BlockHash: TypeAlias = int | bytes

# Replay answers end with this sequence number (-1, signed) and an empty payload.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

# Each rank becomes an index owner and a followed sequence: a bad publisher must not mint them without end.
MAX_DATA_PARALLEL_RANK = 255


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


# Array encoding (older vLLM): positional, and older versions send fewer trailing fields, so every field
# after the first ones has a default here. Decoded arrays are converted to the canonical structs above.
class _BlockStoredArray(msgspec.Struct, array_like=True, gc=False, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _BlockRemovedArray(msgspec.Struct, array_like=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _AllBlocksClearedArray(msgspec.Struct, array_like=True, gc=False, tag="AllBlocksCleared"):
    pass


_ArrayEvent: TypeAlias = _BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray
# The one registration of the event types: each with its array form. The decoder and encoder read it, the
# subscriber counts each type in it, and the index refuses to load unless it handles exactly these. A new type
# goes here, in KVEvent and in the array union above, and then in BlockIndex.apply.
EVENT_TYPES: dict[type[Any], type[Any]] = {
    BlockStored: _BlockStoredArray,
    BlockRemoved: _BlockRemovedArray,
    AllBlocksCleared: _AllBlocksClearedArray,
}
_FROM_ARRAY_FORM: dict[type[Any], type[Any]] = {array: event for event, array in EVENT_TYPES.items()}
if set(EVENT_TYPES) != set(get_args(KVEvent)) or set(_FROM_ARRAY_FORM) != set(get_args(_ArrayEvent)):
    raise TypeError("EVENT_TYPES, KVEvent and _ArrayEvent must name the same event types")


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_DATA_PARALLEL_RANK)] | None = None


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None
    skipped_events: int


class MalformedBatch(ValueError):
    """The payload is not a KV event batch at all (or its timestamp or rank is unusable); nothing in it can be
    used."""


class EventDecoder:
    """Decodes batch payloads of either encoding; a bad event is skipped and counted, not fatal."""

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(_RawBatch)
        self._map_event = msgspec.msgpack.Decoder(KVEvent)
        self._array_event = msgspec.msgpack.Decoder(_ArrayEvent)

    def decode(self, payload: bytes) -> EventBatch:
        try:
            raw = self._batch.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # too deeply nested
            raise MalformedBatch(str(exc)) from exc
        if not math.isfinite(raw.ts):  # it tells a replayed batch's live copy from a new process's batch
            raise MalformedBatch(f"batch timestamp {raw.ts} is not finite")
        events: list[KVEvent] = []
        skipped = 0
        for item in raw.events:
            try:
                events.append(self._decode_event(item))
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                skipped += 1
        return EventBatch(raw.ts, events, raw.data_parallel_rank, skipped)

    def _decode_event(self, item: msgspec.Raw) -> KVEvent:
        # msgpack arrays start with 0x90-0x9f, 0xdc or 0xdd; everything else is tried as a map.
        view = memoryview(item)
        if view.nbytes and (0x90 <= view[0] <= 0x9F or view[0] in (0xDC, 0xDD)):
            event = self._array_event.decode(item)
            return _FROM_ARRAY_FORM[type(event)](*msgspec.structs.astuple(event))  # type: ignore[no-any-return]
        return self._map_event.decode(item)  # type: ignore[no-any-return]


class EventEncoder:
    """Encodes batches as vLLM does, in map (default) or array encoding."""

    def __init__(self, encoding: str = "map") -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"unknown event encoding {encoding!r}: use 'map' or 'array'")
        self._array = encoding == "array"
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: list[KVEvent], data_parallel_rank: int | None = None) -> bytes:
        wire_events: list[Any] = events
        if self._array:
            wire_events = [EVENT_TYPES[type(event)](*msgspec.structs.astuple(event)) for event in events]
        batch: list[Any] = [ts, wire_events]
        if data_parallel_rank is not None:
            batch.append(data_parallel_rank)
        return self._encoder.encode(batch)


def pack_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes) -> int:
    """Sequence numbers are unsigned, except the replay end marker (-1)."""
    if frame == END_OF_REPLAY:
        return -1
    return int.from_bytes(frame, "big")
