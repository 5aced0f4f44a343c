"""What a disaggregated request's two legs send: the client's body as the router received it, the engine's
priority included (router/dispatch/intake/engine_priority.py)."""

from __future__ import annotations

import msgspec

from router.dispatch.intake.engine_priority import with_engine_priority
from router.dispatch.place.prefill_leg import Transfer, decode_leg_body, prefill_body
from router.upstreams.instances import Instance


def test_both_legs_carry_the_engine_priority_set_at_receive() -> None:
    raw = with_engine_priority(b'{"model": "m", "messages": [], "max_tokens": 9, "stream": true}', -10, False)
    body = msgspec.json.decode(raw)
    prefill = msgspec.json.decode(prefill_body(body, "mooncake", "t-1"))
    assert prefill["priority"] == -10 and prefill["max_tokens"] == 1 and prefill["stream"] is False
    instance = Instance("prefill-0", "http://prefill-0", frozenset({"m"}))
    decode = msgspec.json.decode(decode_leg_body(body, Transfer(instance, {"transfer_id": "t-1"})))
    assert decode["priority"] == -10 and decode["max_tokens"] == 9
