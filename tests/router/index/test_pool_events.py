"""The pool tier fed with what real vLLM 0.32 and its MooncakeStoreConnector published (captured by
scripts/capture_mooncake_events.py): a prompt computed on A and written to the pool, loaded from the pool
by B, extended on A; a chat computed on B and loaded by A."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.index.block_index import BlockIndex
from router.index.events import EventDecoder
from router.index.pool import pool_key
from router.prompt import block_hashing
from scorers.request import TierMatch

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"
CAPTURE: dict[str, Any] = json.loads((FIXTURES / "mooncake_capture.json").read_text())
FRAMES: list[list[Any]] = msgspec.msgpack.decode((FIXTURES / "mooncake_events.msgpack").read_bytes())
BLOCK = CAPTURE["block_size"]
A, B = "vllm-0", "vllm-1"


def request(name: str) -> dict[str, Any]:
    return next(r for r in CAPTURE["requests"] if r["name"] == name)


def replayed(until: str | None = None) -> BlockIndex:
    """The index after every captured batch, or only those published up to the request named until."""
    last_seq: dict[str, int] = {}
    if until is not None:
        for entry in CAPTURE["requests"][: [r["name"] for r in CAPTURE["requests"]].index(until) + 1]:
            for instance, seqs in entry["seqs"].items():
                last_seq[instance] = max(seqs)
    index, decoder = BlockIndex(BLOCK), EventDecoder()
    for instance, _topic, seq, payload in FRAMES:
        if until is None or int.from_bytes(seq, "big") <= last_seq.get(instance, -1):
            index.apply((instance, 0), decoder.decode(payload).events)
    return index


def chain(name: str) -> list[int]:
    return block_hashing.chain(request(name)["prompt_token_ids"], BLOCK)


def test_the_connectors_pool_writes_form_one_shared_tier() -> None:
    index = replayed()
    assert index.pool_members() == [A, B]
    assert index.pool_entries == CAPTURE["batch_query_keys"]["keys_from_events"] == 8
    assert index.stats.orphaned == index.stats.mismatched == index.stats.unkeyed == 0
    # A computed all six blocks; B loaded four of them from the pool (and announced them as its own) and
    # can load the other two.
    assert index.match(chain("a_extend")) == {A: TierMatch(gpu=6), B: TierMatch(gpu=4, pool=2)}


def test_before_b_has_written_to_the_pool_it_gets_no_pool_credit() -> None:
    index = replayed(until="a_cold")
    assert index.match(chain("a_cold")) == {A: TierMatch(gpu=4)}
    index = replayed(until="b_chat_cold")  # B has written now; A's extension is in the pool
    assert index.match(chain("a_extend"))[B] == TierMatch(gpu=4, pool=2)


@pytest.mark.parametrize("name", ["a_cold", "a_extend", "b_chat_cold"])
def test_pool_keys_built_from_the_events_are_the_keys_the_connector_wrote(name: str) -> None:
    index = replayed()
    written = {key for r in CAPTURE["requests"] for key in r["new_pool_keys"]}
    blocks = index.pooled(chain(name), 0, len(chain(name)))
    assert blocks and {pool_key(CAPTURE["pool_model_name"], full) for _, full in blocks} <= written
