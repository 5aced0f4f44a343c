"""Bad input, fuzzed: the event decoder, the block index and the subscriber's frame parsing never fail
on anything the wire can carry, and the index keeps its books straight whatever events arrive."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.index.block_index import BlockIndex
from router.index.events import (
    MAX_DATA_PARALLEL_RANK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecoder,
    EventEncoder,
    KVEvent,
    MalformedBatch,
    pack_seq,
)
from router.index.subscriber import KVEventSubscriber, Source
from router.metrics import RouterMetrics
from router.prompt import block_hashing
from scorers.request import TierMatch

FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
decoder = EventDecoder()
reference = EventDecoder(compiled=False)  # msgspec alone: what the compiled decoder must agree with


def _token_lists(value: Any) -> Any:
    if isinstance(value, array):  # decoded token ids
        return value.tolist()
    raise NotImplementedError(type(value).__name__)


encode = msgspec.msgpack.Encoder(enc_hook=_token_lists).encode

# ---- the decoder ----------------------------------------------------------------------------------------

ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, -1, 2**63, 2**64 - 1, -(2**63)]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=12), st.binary(max_size=40))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.one_of(st.text(max_size=8), ints), inner, max_size=6)
    ),
    max_leaves=40,
)
hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=0, max_size=40), st.integers(-(2**63), -1))
token_lists = st.lists(st.integers(-(2**63), 2**64 - 1) | st.integers(0, 50), max_size=40)


@st.composite
def good_events(draw: st.DrawFn) -> KVEvent:
    kind = draw(st.sampled_from([BlockStored, BlockRemoved, AllBlocksCleared]))
    if kind is AllBlocksCleared:
        return AllBlocksCleared()
    medium = draw(st.sampled_from([None, "GPU", "CPU", "cpu", "STORAGE", "elsewhere"]))
    block_hashes = draw(st.lists(hashes, max_size=5))
    if kind is BlockRemoved:
        return BlockRemoved(block_hashes=block_hashes, medium=medium, group_idx=draw(st.none() | ints))
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=draw(st.none() | hashes),
        token_ids=draw(token_lists),
        block_size=draw(ints),
        lora_id=draw(st.none() | ints),
        medium=medium,
        lora_name=draw(st.none() | st.text(max_size=8)),
        extra_keys=draw(st.none() | st.lists(values, max_size=3)),
    )


def wire_form(event: KVEvent, array: bool) -> Any:
    """An event as the plain msgpack value vLLM would send, in map or array encoding."""
    fields = msgspec.structs.asdict(event)
    name = type(event).__name__
    return [name, *fields.values()] if array else {"type": name, **fields}


@st.composite
def mutated(draw: st.DrawFn, wire: Any) -> Any:
    """One event broken the way a buggy or newer engine might break it."""
    how = draw(st.sampled_from(["replace", "drop", "extra", "truncate", "tag", "odd_hash", "whole"]))
    if how == "whole":
        return draw(values)
    if isinstance(wire, dict):
        keys = list(wire)
        key = draw(st.sampled_from(keys))
        if how == "replace":
            wire[key] = draw(values)
        elif how == "drop":
            del wire[key]
        elif how == "extra":
            wire[draw(st.text(max_size=10))] = draw(values)
        elif how == "truncate":
            wire = dict(list(wire.items())[: draw(st.integers(0, len(keys)))])
        elif how == "tag":
            wire["type"] = draw(st.text(max_size=14) | st.sampled_from(["blockstored", "BlockStored ", ""]))
        elif "block_hashes" in wire:
            wire["block_hashes"] = [*wire["block_hashes"], draw(st.binary(max_size=7) | st.floats())]
        return wire
    index = draw(st.integers(0, len(wire) - 1))
    if how == "replace":
        wire[index] = draw(values)
    elif how in ("drop", "truncate"):
        wire = wire[:index]
    elif how == "extra":
        wire = [*wire, *draw(st.lists(values, min_size=1, max_size=3))]
    elif how == "tag":
        wire[0] = draw(st.text(max_size=14) | ints)
    elif len(wire) > 1 and isinstance(wire[1], list):
        wire[1] = [*wire[1], draw(st.binary(max_size=7) | st.floats())]
    return wire


def assert_same(batch: EventBatch, other: EventBatch) -> None:
    assert (batch.ts, batch.data_parallel_rank, batch.skipped_events) == (
        other.ts,
        other.data_parallel_rank,
        other.skipped_events,
    )
    assert list(map(encode, batch.events)) == list(map(encode, other.events))


def check_decoded(payload: bytes, events_sent: int | None = None) -> EventBatch | None:
    """decode gives a batch of well-typed events, every event sent either kept or counted, or MalformedBatch;
    the same as decoding it an event at a time, and as msgspec alone decodes it."""
    try:
        batch = decoder.decode(payload)
    except MalformedBatch:
        with pytest.raises(MalformedBatch):
            decoder._decode_items(payload)
        with pytest.raises(MalformedBatch):
            reference.decode(payload)
        return None
    assert_same(batch, reference.decode(payload))
    # The batch decoded in one call when it can be: as the per-event path would decode it
    assert_same(batch, decoder._decode_items(payload))
    assert isinstance(batch.ts, float)
    assert batch.data_parallel_rank is None or isinstance(batch.data_parallel_rank, int)
    for event in batch.events:
        assert type(event) in (BlockStored, BlockRemoved, AllBlocksCleared)
        wire = encode(event)  # well-typed: re-decodes, strictly, into the same event
        assert encode(msgspec.msgpack.decode(wire, type=KVEvent)) == wire
    if events_sent is not None:
        assert len(batch.events) + batch.skipped_events == events_sent
    return batch


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_decode_or_are_malformed(payload: bytes) -> None:
    check_decoded(payload)


@FUZZ
@given(values)
def test_any_msgpack_value_decodes_or_is_malformed(value: Any) -> None:
    check_decoded(encode(value))


@FUZZ
@given(st.floats() | ints, st.lists(values, max_size=6), st.none() | values)
def test_a_batch_of_arbitrary_events_keeps_or_counts_each_one(ts: Any, events: list[Any], rank: Any) -> None:
    batch = check_decoded(encode([ts, events, rank]), len(events))
    sound_rank = rank is None or (type(rank) is int and 0 <= rank <= MAX_DATA_PARALLEL_RANK)
    if isinstance(ts, float) and math.isfinite(ts) and sound_rank:
        assert batch is not None
    elif (isinstance(ts, float) and not math.isfinite(ts)) or not sound_rank:
        assert batch is None  # a timestamp or a rank no engine sends


@FUZZ
@given(st.data(), st.lists(good_events(), min_size=1, max_size=5), st.booleans())
def test_one_broken_event_costs_at_most_itself(
    data: st.DataObject, events: list[KVEvent], array: bool
) -> None:
    wire = [wire_form(event, array) for event in events]
    broken = data.draw(st.integers(0, len(wire) - 1))
    wire[broken] = data.draw(mutated(wire[broken]))
    batch = check_decoded(encode([1.0, wire]), len(wire))
    assert batch is not None
    assert batch.skipped_events <= 1
    for position, event in enumerate(events):
        if position != broken:  # the intact ones survive, in order, unchanged
            assert any(encode(event) == encode(kept) for kept in batch.events)


@FUZZ
@given(st.data(), st.lists(good_events(), max_size=4), st.booleans())
def test_truncated_or_extended_batches_are_malformed(
    data: st.DataObject, events: list[KVEvent], array: bool
) -> None:
    payload = EventEncoder("array" if array else "map").encode(
        3.5, events, data.draw(st.none() | st.integers(0, 7))
    )
    batch = check_decoded(payload, len(events))
    assert batch is not None and batch.skipped_events == 0
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(MalformedBatch):
        decoder.decode(payload[:cut])
    with pytest.raises(MalformedBatch):
        decoder.decode(payload + data.draw(st.binary(min_size=1, max_size=8)))


@st.composite
def common_events(draw: st.DrawFn) -> dict[str, Any]:
    """An event as vLLM 0.32 sends it (map encoded, every token id a uint32): what the compiled decoder
    reads; sometimes with a field it does not know."""
    blocks = draw(st.integers(0, 4))
    kind = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    event: dict[str, Any] = {"type": kind}
    if kind != "AllBlocksCleared":
        event["block_hashes"] = draw(st.lists(hashes, min_size=blocks, max_size=blocks))
        event["medium"] = draw(st.sampled_from([None, "GPU", "CPU", "é"]))
        event["group_idx"] = draw(st.none() | ints)
    if kind == "BlockStored":
        event["parent_block_hash"] = draw(st.none() | hashes)
        event["token_ids"] = draw(st.lists(st.integers(0, 2**32 - 1), max_size=blocks * 4))
        event["block_size"] = draw(ints)
        event["lora_id"] = draw(st.none() | ints)
        event["lora_name"] = draw(st.none() | st.text(max_size=8))
        event["extra_keys"] = draw(st.sampled_from([None, [None] * blocks]))
        event["kv_cache_spec_kind"] = draw(st.none() | st.sampled_from(["full_attention", "mamba"]))
        event["kv_cache_spec_sliding_window"] = draw(st.none() | ints)
    if draw(st.booleans()):
        event[draw(st.text(max_size=10).filter(lambda key: key not in event))] = draw(values)
    return event


@FUZZ
@given(st.data(), st.lists(common_events(), max_size=4), st.none() | st.integers(0, 255))
def test_common_batches_and_their_corruptions_decode_as_msgspec_alone_decodes_them(
    data: st.DataObject, events: list[dict[str, Any]], rank: int | None
) -> None:
    payload = encode([data.draw(st.floats(width=64) | st.floats(width=32)), events, rank])
    batch = check_decoded(payload, len(events))
    assert batch is None or batch.skipped_events == 0
    # A byte changed, cut or added anywhere: the compiled reader must never read past the payload or accept
    # what msgspec refuses
    position = data.draw(st.integers(0, len(payload) - 1))
    how = data.draw(st.sampled_from(["change", "cut", "insert"]))
    byte = bytes([data.draw(st.integers(0, 255))])
    if how == "change":
        corrupted = payload[:position] + byte + payload[position + 1 :]
    elif how == "cut":
        corrupted = payload[:position] + payload[position + 1 :]
    else:
        corrupted = payload[:position] + byte + payload[position:]
    check_decoded(corrupted)


@pytest.mark.parametrize("depth", [10, 1_000, 200_000])
@pytest.mark.parametrize("where", ["batch", "events", "event", "extra_keys"])
def test_deep_nesting_is_malformed_or_skipped_not_a_recursion_error(depth: int, where: str) -> None:
    nested = b"\x91" * depth + b"\xc0"  # [[[...[None]...]]]
    stored = b"\x85\xa4type\xabBlockStored\xacblock_hashes\x91\x01\xb1parent_block_hash\xc0\xa9token_ids\x90"
    payload = {
        "batch": nested,
        "events": b"\x92\xcb" + encode(1.0)[1:] + nested,
        "event": b"\x92\xcb" + encode(1.0)[1:] + b"\x91" + nested,
        "extra_keys": b"\x92\xcb" + encode(1.0)[1:] + b"\x91" + stored + b"\xaaextra_keys\x91" + nested,
    }[where]
    check_decoded(payload)


@pytest.mark.parametrize(
    "payload",
    [
        b"\x92\xcb" + encode(1.0)[1:] + b"\xdd\xff\xff\xff\xff",  # an array that claims 4 billion events
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",
        b"\xc6\xff\xff\xff\xff",
        encode(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": list(range(50_000)),
                        "parent_block_hash": None,
                        "token_ids": list(range(800_000)),
                        "block_size": 16,
                    }
                ],
            ]
        ),
    ],
)
def test_huge_claimed_or_real_arrays_are_handled(payload: bytes) -> None:
    check_decoded(payload)


# ---- the block index -------------------------------------------------------------------------------------

BS = 4
TOKENS = [(i * 7919) % 1000 for i in range(40)]  # 10 blocks
PROMPT = block_hashing.chain(TOKENS, BS)
CHAINS = [PROMPT, PROMPT[:3], block_hashing.chain([*TOKENS[:9], 4242, *TOKENS[10:]], BS), [1, 2, 3]]
OWNERS = [("a", 0), ("a", 1), ("b", 0), ("c", 2)]
TIER_OF = {None: "gpu", "GPU": "gpu", "CPU": "cpu", "STORAGE": "cpu", "elsewhere": "cpu"}


def vllm_hash(position: int, salt: int, as_bytes: bool) -> int | bytes:
    value = (position + 1) * 1_000_003 + salt * 7 + 2**63
    return value.to_bytes(32, "big") if as_bytes else value


def stored(
    first: int,
    count: int,
    salt: int,
    as_bytes: bool,
    medium: str | None,
    tokens: list[int] = TOKENS,
    block_size: int = BS,
) -> BlockStored:
    return BlockStored(
        block_hashes=[vllm_hash(i, salt, as_bytes) for i in range(first, first + count)],
        parent_block_hash=None if first == 0 else vllm_hash(first - 1, salt, as_bytes),
        token_ids=tokens[first * BS : (first + count) * BS],
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


positions = st.integers(0, 9)
owners = st.sampled_from(OWNERS)
mediums = st.sampled_from(list(TIER_OF))
salts = st.integers(0, 1)


@st.composite
def good_stores(draw: st.DrawFn, medium: st.SearchStrategy[str | None] = mediums) -> tuple[str, Any]:
    first = draw(st.sampled_from([0, 0, *range(1, 9)]))
    count = draw(st.integers(1, 10 - first))
    return "store", (draw(owners), stored(first, count, draw(salts), draw(st.booleans()), draw(medium)))


BAD_HOWS = ("tokens", "short", "size", "mixed", "odd_hash", "extra", "parent", "empty")


@st.composite
def bad_stores(draw: st.DrawFn, hows: tuple[str, ...] = BAD_HOWS) -> tuple[str, Any]:
    """Events the index must count and skip, or take without harm: never fail on."""
    first, count, salt = draw(positions), draw(st.integers(0, 4)), draw(salts)
    medium = draw(st.sampled_from([*TIER_OF, "cpu"]))
    event = stored(first, count, salt, draw(st.booleans()), medium)
    how = draw(st.sampled_from(hows))
    if how == "tokens":
        bad = draw(st.sampled_from([-1, -(2**63), 2**32, 2**64 - 1]))
        event = msgspec.structs.replace(
            event, token_ids=[*event.token_ids[:-1], bad] if event.token_ids else [bad]
        )
    elif how == "short":
        event = msgspec.structs.replace(event, token_ids=event.token_ids[: draw(st.integers(0, 3))])
    elif how == "size":
        event = msgspec.structs.replace(event, block_size=draw(st.sampled_from([0, -4, 3, 8, 2**40])))
    elif how == "mixed" and event.block_hashes:
        event.block_hashes[-1] = vllm_hash(
            first + count - 1, salt, not isinstance(event.block_hashes[0], bytes)
        )
    elif how == "odd_hash":
        event = msgspec.structs.replace(
            event,
            block_hashes=draw(st.lists(hashes, min_size=count, max_size=count)),
            parent_block_hash=draw(st.none() | hashes),
        )
    elif how == "extra":
        extra = draw(st.lists(st.none() | values, max_size=count + 1))
        event = msgspec.structs.replace(event, extra_keys=extra)
    elif how == "parent":
        event = msgspec.structs.replace(event, parent_block_hash=draw(hashes))
    else:
        event = msgspec.structs.replace(event, block_hashes=[], token_ids=[])
    return "store", (draw(owners), event)


def removes(medium: st.SearchStrategy[str | None] = mediums) -> st.SearchStrategy[tuple[str, Any]]:
    event = st.builds(
        lambda ps, salt, as_bytes, medium: BlockRemoved([vllm_hash(p, salt, as_bytes) for p in ps], medium),
        st.lists(positions, max_size=4),
        salts,
        st.booleans(),
        medium,
    )
    return st.tuples(st.just("remove"), st.tuples(owners, event))


def pool_stores() -> st.SearchStrategy[tuple[str, Any]]:
    return st.builds(
        lambda op, without_tokens: (
            op[0],
            (op[1][0], msgspec.structs.replace(op[1][1], token_ids=[])) if without_tokens else op[1],
        ),
        good_stores(st.just("cpu")),
        st.booleans(),
    )


# A prefix cache reset: the GPU block pool's clear, and a SimpleCPUOffloadConnector's after it in one batch
clears = st.tuples(st.just("clear"), st.tuples(owners, st.integers(1, 2)))
drops = st.tuples(st.just("drop"), owners)
speculations = st.tuples(st.just("speculate"), st.tuples(st.sampled_from(["a", "b", "c"]), positions))
waits = st.tuples(st.just("wait"), st.sampled_from([0.5, 1.0, 3.0]))
forgets = st.tuples(st.just("forget"), st.lists(st.tuples(positions, salts), max_size=4))


def run(index: BlockIndex, now: list[float], op: tuple[str, Any]) -> None:
    kind, arg = op
    if kind in ("store", "remove"):
        index.apply(arg[0], [arg[1]])
    elif kind == "clear":
        index.apply(arg[0], [AllBlocksCleared()] * arg[1])
    elif kind == "drop":
        index.drop(arg)
    elif kind == "speculate":
        index.speculate(arg[0], PROMPT, start=arg[1])
    elif kind == "wait":
        now[0] += arg
    elif kind == "forget":
        index.forget_pooled([vllm_hash(p, salt, True) for p, salt in arg])  # type: ignore[misc]


def check_books(index: BlockIndex, bound: int) -> None:
    by_owner = sum(sum(sizes) for sizes in index.entries_by_owner().values())
    assert index.entries == by_owner + index.pool_entries
    assert 0 <= index.entries <= bound
    for chain in CHAINS:
        for include_pool in (True, False):
            for name, found in index.match(chain, include_pool).items():
                assert name in {"a", "b", "c"}
                assert min(found.gpu, found.cpu, found.pool) >= 0
                assert 0 < found.gpu + found.cpu + found.pool <= len(chain)
                assert include_pool or found.pool == 0
        for position, full in index.pooled(chain, 0, len(chain) + 2):
            assert 0 <= position < len(chain) and isinstance(full, bytes)


any_op = st.one_of(
    good_stores(), bad_stores(), removes(), pool_stores(), clears, drops, speculations, waits, forgets
)


@FUZZ
@given(st.lists(any_op, max_size=40), st.sampled_from([3, 12, 10_000]))
def test_any_event_sequence_keeps_the_books_and_the_bound(ops: list[tuple[str, Any]], bound: int) -> None:
    now = [0.0]
    index = BlockIndex(BS, max_entries=bound, speculative_ttl_s=2.0, clock=lambda: now[0])
    for op in ops:
        run(index, now, op)
        check_books(index, bound)


# Hashes the model can place: vLLM's own (one type per event), not arbitrary ones.
modelled_bad = bad_stores(("tokens", "short", "size", "extra", "empty")).filter(
    lambda op: op[1][1].medium != "cpu"
)
gpu_cpu_op = st.one_of(
    good_stores(), modelled_bad, removes(st.sampled_from(list(TIER_OF))), clears, drops, speculations, waits
)


class Model:
    """Per owner, tier, salt and position: a refcount, as vLLM's cache holds it; speculative deadlines."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], dict[tuple[str, int, int], int]] = {o: {} for o in OWNERS}
        self.until: dict[tuple[str, int], float] = {}

    def has(self, owner: tuple[str, int], key: tuple[int, int]) -> bool:
        return any(self.held[owner].get((tier, *key), 0) > 0 for tier in ("gpu", "cpu"))

    def run(self, op: tuple[str, Any], now: float) -> None:
        kind, arg = op
        if kind == "store":
            owner, event = arg
            keys = [self.key(h) for h in event.block_hashes]
            held, tier = self.held[owner], TIER_OF[event.medium]
            if keys and (not event.token_ids or (tier == "cpu" and event.extra_keys is None)):
                # No tokens, or an offload without its extra keys: its copies' vLLM hashes, known ones only
                if event.token_ids and (event.block_size != BS or len(event.token_ids) != len(keys) * BS):
                    return
                for key in [key for key in keys if self.has(owner, key)]:
                    held[(tier, *key)] = held.get((tier, *key), 0) + 1
                return
            if not keys or event.block_size != BS or len(event.token_ids) != len(keys) * BS:
                return
            plain = event.extra_keys is None or event.extra_keys == [None] * len(keys)  # all None: no keys
            if not plain or not all(0 <= t < 2**32 for t in event.token_ids):
                return
            if event.token_ids != TOKENS[keys[0][1] * BS : (keys[-1][1] + 1) * BS]:
                return
            parent = event.parent_block_hash
            if parent is not None and not self.has(owner, self.key(parent)):
                return
            for key in keys:
                held[(tier, *key)] = held.get((tier, *key), 0) + 1
        elif kind == "remove":
            owner, event = arg
            held = self.held[owner]
            for vllm in event.block_hashes:
                slot = (TIER_OF[event.medium], *self.key(vllm))
                if held.get(slot, 0) > 0:
                    held[slot] -= 1
        elif kind == "clear":  # the GPU's blocks, and the CPU's after a second clear
            owner, count = arg
            self.held[owner] = {
                slot: n for slot, n in self.held[owner].items() if slot[0] == "cpu" and count < 2
            }
        elif kind == "drop":
            self.held[arg].clear()
        elif kind == "speculate":
            self.held.setdefault((arg[0], 0), {})  # a speculated instance's first rank: an owner from then on
            for position in range(arg[1], len(PROMPT)):
                self.until[(arg[0], position)] = now + 2.0

    @staticmethod
    def key(vllm: int | bytes) -> tuple[int, int]:
        value = int.from_bytes(vllm[-8:], "big") if isinstance(vllm, bytes) else vllm
        offset = value - 2**63 - 1_000_003
        return offset % 1_000_003 // 7, offset // 1_000_003  # (salt, position)

    def matches(self, now: float) -> dict[str, set[TierMatch]]:
        """Per instance: the matches of its best ranks (ties of different tiers can go either way)."""
        best: dict[str, tuple[int, set[TierMatch]]] = {}
        for owner, held in self.held.items():
            gpu = cpu = 0
            for position in range(len(PROMPT)):
                on = {tier for (tier, _, p), count in held.items() if p == position and count > 0}
                if owner[1] == 0 and self.until.get((owner[0], position), 0.0) > now:
                    on.add("gpu")
                if not on:
                    break
                gpu, cpu = gpu + ("gpu" in on), cpu + (on == {"cpu"})
            total, known = best.get(owner[0], (0, set()))
            if gpu + cpu > total:
                best[owner[0]] = (gpu + cpu, {TierMatch(gpu, cpu)})
            elif gpu + cpu == total and total:
                known.add(TierMatch(gpu, cpu))
        return {name: found for name, (_, found) in best.items()}


@FUZZ
@given(st.lists(gpu_cpu_op, max_size=50))
def test_gpu_and_cpu_event_sequences_agree_with_a_reference_model(ops: list[tuple[str, Any]]) -> None:
    """Refcounts per tier and owner, orphans never indexed, removed blocks never matched until stored again,
    speculative entries until they expire: the index's matches equal the model's after every step."""
    now = [0.0]
    index = BlockIndex(BS, speculative_ttl_s=2.0, clock=lambda: now[0])
    model = Model()
    for op in ops:
        run(index, now, op)
        model.run(op, now[0])
        expected = model.matches(now[0])
        found = index.match(PROMPT)
        assert found.keys() == expected.keys()
        for name, match in found.items():
            assert match in expected[name]
        check_books(index, index.max_entries)


# ---- the subscriber's frames -----------------------------------------------------------------------------


class NullSink:
    def apply(self, owner: tuple[str, int], events: Any) -> None: ...

    def drop(self, owner: tuple[str, int]) -> None: ...


@pytest.fixture(scope="module")
def subscriber() -> Iterator[KVEventSubscriber]:
    context = zmq.asyncio.Context()
    yield KVEventSubscriber(Source("a", "tcp://127.0.0.1:1"), NullSink(), RouterMetrics(), context)
    context.term()


good_payloads = st.builds(
    lambda events: EventEncoder().encode(1.0, events), st.lists(good_events(), max_size=3)
)
frame = st.one_of(st.binary(max_size=12), st.integers(0, 2**64 - 1).map(pack_seq), good_payloads)


@FUZZ
@given(st.lists(frame, max_size=4))
def test_any_frames_parse_to_a_numbered_batch_or_count_as_malformed(
    subscriber: KVEventSubscriber, frames: list[bytes]
) -> None:
    malformed = subscriber._malformed._value.get()  # type: ignore[attr-defined]
    numbered = subscriber._parse(frames)
    counted = subscriber._malformed._value.get() - malformed  # type: ignore[attr-defined]
    if numbered is None:
        assert counted == 1
    else:
        seq, batch = numbered
        assert counted == 0 and len(frames) == 3 and 0 <= seq < 2**64 and isinstance(batch, EventBatch)
