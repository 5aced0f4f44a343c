"""vLLM's KV-cache event wire format: typed structs, one decoder for both encodings, frame helpers.

A batch is the msgpack array ``[ts, events, data_parallel_rank]``. Events are tagged structs, encoded as
maps (``{"type": "BlockStored", ...}``, vLLM >= 0.26) or as arrays (``["BlockStored", ...]``, older, trailing
defaults omitted). Unknown keys and extra trailing array items are ignored, as newer vLLM adds fields.
A large batch can be decoded in parts (its envelope, its events' items, runs of events), for a caller that
gives other work turns between them.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeAlias, get_args

import msgspec

from router.index._event_wire import BatchDecoder

BlockHash: TypeAlias = int | bytes

# Replay answers end with this sequence number (-1, signed) and an empty payload.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

# Each rank becomes an index owner and a followed sequence: a bad publisher must not mint them without end.
MAX_DATA_PARALLEL_RANK = 255
# Events a batch may hold. vLLM publishes a batch per engine step: a store per request and KV cache group
# whose blocks filled, a removal per evicted block; its largest defaults (1,024 sequences, 32,768 tokens a
# step in 16-token blocks, a few groups) make some thousands. Each event costs an object before it is decoded:
# a payload of one-byte items would otherwise make 8 million of them from 8 MiB (1.7 s, 400 MB).
MAX_EVENTS = 1 << 17


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]  # decoded: array("I") (router/index/_event_wire.pyx), or a list
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


# What msgspec raises for a payload it cannot decode as asked: UnicodeDecodeError (not DecodeError) for a
# string that is no UTF-8, RecursionError past its nesting depth.
_UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_DATA_PARALLEL_RANK)] | None = None


class _TypedBatch(msgspec.Struct, array_like=True, gc=False):
    """_RawBatch whose events are all map-encoded and well formed, as vLLM sends them: decoded in one call."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_DATA_PARALLEL_RANK)] | None = None


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: msgspec.Raw
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_DATA_PARALLEL_RANK)] | None = None


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None
    skipped_events: int


@dataclass(slots=True)
class EncodedBatch:
    """A batch whose envelope is checked (its timestamp, its rank, an array of at most MAX_EVENTS events) and
    whose events are still encoded: they are a view of its payload, which is all it holds."""

    ts: float
    data_parallel_rank: int | None
    events: msgspec.Raw
    size: int  # the payload's bytes


class MalformedBatch(ValueError):
    """The payload is not a KV event batch at all (or its timestamp or rank is unusable); nothing in it can be
    used."""


class EventDecoder:
    """Decodes batch payloads of either encoding; a bad event is skipped and counted, not fatal."""

    def __init__(self, compiled: bool = True) -> None:
        """compiled=False: msgspec alone, the reference the compiled decoder is tested against."""
        self._typed = msgspec.msgpack.Decoder(_TypedBatch)
        self._batch = msgspec.msgpack.Decoder(_RawBatch)
        self._envelope = msgspec.msgpack.Decoder(_Envelope)
        self._items = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._map_event = msgspec.msgpack.Decoder(KVEvent)
        self._common = BatchDecoder(
            BlockStored, BlockRemoved, AllBlocksCleared, MAX_DATA_PARALLEL_RANK, compiled
        )
        self._array_event = msgspec.msgpack.Decoder(_ArrayEvent)

    def decode(self, payload: bytes) -> EventBatch:
        common = self._common.decode(payload)  # in C, what every live batch of vLLM's is
        if common is not None:
            ts, events, rank = common
        else:
            try:
                typed = self._typed.decode(payload)
            except _UNDECODABLE:
                return self._decode_items(payload)  # older vLLM's array encoding, a bad event, or no batch
            ts, events, rank = typed.ts, typed.events, typed.data_parallel_rank
        if not math.isfinite(ts):
            raise MalformedBatch(f"batch timestamp {ts} is not finite")
        return EventBatch(ts, events, rank, 0)

    def _decode_items(self, payload: bytes) -> EventBatch:
        """decode, an event at a time: one that is no event is skipped and counted."""
        try:
            raw = self._batch.decode(payload)
        except _UNDECODABLE as exc:
            raise MalformedBatch(str(exc)) from exc
        if not math.isfinite(raw.ts):  # it tells a replayed batch's live copy from a new process's batch
            raise MalformedBatch(f"batch timestamp {raw.ts} is not finite")
        events: list[KVEvent] = []
        skipped = 0
        for item in raw.events:  # as events() does: inline, as every live batch comes this way
            try:
                events.append(self._decode_event(item))
            except _UNDECODABLE:
                skipped += 1
        return EventBatch(raw.ts, events, raw.data_parallel_rank, skipped)

    def envelope(self, payload: bytes) -> EncodedBatch:
        """A batch to decode in parts (items, then events): its events are checked to be an array of at most
        MAX_EVENTS, and are left as they are."""
        try:
            raw = self._envelope.decode(payload)
        except _UNDECODABLE as exc:
            raise MalformedBatch(str(exc)) from exc
        if not math.isfinite(raw.ts):
            raise MalformedBatch(f"batch timestamp {raw.ts} is not finite")
        count = _array_length(memoryview(raw.events))
        if count is None:
            raise MalformedBatch("the batch's events are not an array")
        if count > MAX_EVENTS:
            raise MalformedBatch(f"{count} events in a batch; an engine step makes at most thousands")
        return EncodedBatch(raw.ts, raw.data_parallel_rank, raw.events, len(payload))

    def items(self, batch: EncodedBatch) -> list[msgspec.Raw]:
        """batch's events, each still encoded: its envelope, decoded, parsed them, so this cannot fail."""
        return self._items.decode(batch.events)

    def events(self, items: Iterable[msgspec.Raw]) -> tuple[list[KVEvent], int]:
        """The events among items, and how many items were none (skipped)."""
        events: list[KVEvent] = []
        skipped = 0
        for item in items:
            try:
                events.append(self._decode_event(item))
            except _UNDECODABLE:
                skipped += 1
        return events, skipped

    def complete(self, batch: EncodedBatch) -> EventBatch:
        """batch decoded at once, as decode would have."""
        events, skipped = self.events(self.items(batch))
        return EventBatch(batch.ts, events, batch.data_parallel_rank, skipped)

    def _decode_event(self, item: msgspec.Raw) -> KVEvent:
        # msgpack arrays start with 0x90-0x9f, 0xdc or 0xdd; everything else is tried as a map.
        view = memoryview(item)
        if view.nbytes and (0x90 <= view[0] <= 0x9F or view[0] in (0xDC, 0xDD)):
            array_form = self._array_event.decode(item)
            converted: KVEvent = _FROM_ARRAY_FORM[type(array_form)](*msgspec.structs.astuple(array_form))
            return converted
        # typed variables, not ignores: msgspec's stubs type decode() differently across releases
        common: KVEvent | None = self._common.event(item)
        return self._map_event.decode(item) if common is None else common


class EventEncoder:
    """Encodes batches as vLLM does, in map (default) or array encoding."""

    def __init__(self, encoding: str = "map") -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"unknown event encoding {encoding!r}: use 'map' or 'array'")
        self._array = encoding == "array"
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encodable)

    def encode(self, ts: float, events: list[KVEvent], data_parallel_rank: int | None = None) -> bytes:
        wire_events: list[Any] = events
        if self._array:
            wire_events = [EVENT_TYPES[type(event)](*msgspec.structs.astuple(event)) for event in events]
        batch: list[Any] = [ts, wire_events]
        if data_parallel_rank is not None:
            batch.append(data_parallel_rank)
        return self._encoder.encode(batch)


def _encodable(value: Any) -> Any:
    """Decoded events' token ids (array("I")) as msgpack arrays, as they came."""
    if isinstance(value, array):
        return value.tolist()
    raise NotImplementedError(f"{type(value).__name__} is not an event field's type")


def _array_length(view: memoryview) -> int | None:
    """The length of the msgpack array view begins with; None when it is no array."""
    if not view.nbytes:
        return None
    first = view[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F
    if first == 0xDC and view.nbytes >= 3:
        return int.from_bytes(view[1:3], "big")
    if first == 0xDD and view.nbytes >= 5:
        return int.from_bytes(view[1:5], "big")
    return None


def pack_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes) -> int:
    """Sequence numbers are unsigned, except the replay end marker (-1)."""
    if frame == END_OF_REPLAY:
        return -1
    return int.from_bytes(frame, "big")
