"""The engine's priority written into a body: appended without decoding, a client's own replaced."""

from __future__ import annotations

import json

import pytest

from router.apis.openai_body import ChatRequest, decode_body
from router.dispatch.intake.engine_priority import engine_priority, with_engine_priority


def test_vllm_runs_the_lowest_value_first_so_the_objectives_priority_is_negated() -> None:
    assert engine_priority(10) == -10
    assert engine_priority(-10) == 10


def test_a_body_without_the_field_keeps_its_bytes_at_priority_0() -> None:
    raw = b'{"model": "m", "messages": []}'
    assert with_engine_priority(raw, 0, named=False) is raw


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[]}',
        b'{"model": "m", "messages": []\n}\n  ',
        b'{"messages":[{"content":"}"}]}',
        b"{}",
    ],
)
def test_a_body_without_the_field_gets_it_appended(raw: bytes) -> None:
    sent = with_engine_priority(raw, -10, named=False)
    assert json.loads(sent) == {**json.loads(raw), "priority": -10}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","priority":-1000,"messages":[{"role":"user","content":"hi"}]}',
        b'{"model":"m","\\u0070riority":-1000,"messages":[{"role":"user","content":"hi"}]}',
    ],
)
def test_a_clients_own_priority_is_replaced_however_it_is_spelled(raw: bytes) -> None:
    named = decode_body(raw, ChatRequest, None).priority is not None
    assert named
    sent = json.loads(with_engine_priority(raw, 10, named))
    assert sent == {**json.loads(raw), "priority": 10}
    assert json.loads(with_engine_priority(raw, 0, named))["priority"] == 0


def test_a_body_already_at_the_engines_priority_keeps_its_bytes() -> None:
    raw = b'{"model":"m","priority":5,"messages":[]}'
    assert with_engine_priority(raw, 5, named=True) is raw
