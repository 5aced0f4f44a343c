"""The engine's priority written into a body: appended without decoding, a client's own replaced."""

from __future__ import annotations

import json

import pytest

from router.dispatch.intake.engine_priority import engine_priority, with_engine_priority


def test_vllm_runs_the_lowest_value_first_so_the_objectives_priority_is_negated() -> None:
    assert engine_priority(10) == -10
    assert engine_priority(-10) == 10


def test_a_body_without_the_field_keeps_its_bytes_at_priority_0() -> None:
    raw = b'{"model": "m", "messages": []}'
    assert with_engine_priority(raw, 0) is raw


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[]}',
        b'{"model": "m", "messages": []}\n  ',
        b'{"messages":[{"content":"}"}]}',
    ],
)
def test_a_body_without_the_field_gets_it_appended(raw: bytes) -> None:
    sent = with_engine_priority(raw, -10)
    assert json.loads(sent) == {**json.loads(raw), "priority": -10}


def test_a_clients_own_priority_is_replaced() -> None:
    raw = b'{"model":"m","priority":-1000,"messages":[]}'
    assert json.loads(with_engine_priority(raw, 10)) == {"model": "m", "priority": 10, "messages": []}
    assert json.loads(with_engine_priority(raw, 0))["priority"] == 0


def test_the_word_in_a_message_is_no_field_and_the_body_is_otherwise_unchanged() -> None:
    raw = b'{"model":"m","messages":[{"role":"user","content":"priority"}]}'
    assert json.loads(with_engine_priority(raw, 5)) == {**json.loads(raw), "priority": 5}
    assert with_engine_priority(raw, 0) is raw
