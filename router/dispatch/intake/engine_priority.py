"""A request's priority handed to the engine: vLLM's `priority` field, set from the request's objective.

vLLM run with `--scheduling-policy priority` orders its waiting queue by `priority`, the lowest value first,
and preempts the lowest-ranked request when KV memory runs out; with the default `fcfs` it ignores the field.
The router's objectives rank the other way (a higher priority leaves the router's queue first), so the
engine gets the objective's priority negated. Once a request is in an engine's queue the router cannot
reorder it: without this, a batch flood queued at the engine keeps an interactive request behind all of it.

The router, not the client, sets it: a client's own `priority` is replaced, else any client could put itself
ahead of every tenant in the engine's queue. vLLM's chat, completions and Responses APIs take the field; its
Anthropic Messages API has none (it drops unknown fields), so those requests keep the engine's order.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import msgspec

from router.upstreams.instances import Instance

_BLANK = b" \t\r\n"
_OPEN = ord("{")


def engine_priority(objective_priority: int) -> int:
    """vLLM's `priority` for a request of an objective of this priority (lower runs first)."""
    return -objective_priority


def with_engine_priority(raw: bytes, priority: int, named: bool) -> bytes:
    """The body (a JSON object, decoded already) with `priority` set to priority. named: the body names the
    field (as decoded, so a key spelled with escapes counts). One that does not gets it after its last
    member, in one copy and without decoding it (an agent's body is hundreds of kilobytes), or nothing at 0,
    the engine's default; one that does is decoded and encoded again."""
    if not named:
        if priority == 0:
            return raw
        end = raw.rfind(b"}")
        last = end - 1
        while last >= 0 and raw[last] in _BLANK:
            last -= 1
        separator = b"" if raw[last] == _OPEN else b","
        return b"".join((memoryview(raw)[:end], separator, b'"priority":%d}' % priority))
    try:
        fields = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # decode_body took it: cannot happen
        return raw
    if not isinstance(fields, dict):
        return raw
    named_value = fields.get("priority", 0)
    if type(named_value) is int and named_value == priority:  # as it should be already (True, 1.0: not)
        return raw
    fields["priority"] = priority
    return msgspec.json.encode(fields)


def prioritized(
    body_for: Callable[[Instance], bytes], priority: int, named: bool
) -> Callable[[Instance], bytes]:
    """A body made for each attempt's instance (a Responses request's), with `priority` set."""
    return partial(_prioritized, body_for, priority, named)


def _prioritized(
    body_for: Callable[[Instance], bytes], priority: int, named: bool, instance: Instance
) -> bytes:
    return with_engine_priority(body_for(instance), priority, named)
