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

_FIELD = b'"priority"'


def engine_priority(objective_priority: int) -> int:
    """vLLM's `priority` for a request of an objective of this priority (lower runs first)."""
    return -objective_priority


def with_engine_priority(raw: bytes, priority: int) -> bytes:
    """The body (a JSON object, decoded already) with `priority` set to priority. A body that does not name
    the field gets it appended without decoding it (none is needed at 0, the engine's default); one that
    may name it (the word in quotes anywhere) is decoded and encoded again."""
    if _FIELD not in raw:
        if priority == 0:
            return raw
        body = raw.rstrip()
        head = body[:-1].rstrip()  # all but the closing brace
        separator = b"" if head.endswith(b"{") else b","
        return b'%s%s"priority":%d}' % (head, separator, priority)
    try:
        fields = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # decode_body took it: cannot happen
        return raw
    if not isinstance(fields, dict):
        return raw
    named = fields.get("priority", 0)
    if type(named) is int and named == priority:  # as it should be already (True == 1, 1.0 == 1: not)
        return raw
    fields["priority"] = priority
    return msgspec.json.encode(fields)


def prioritized(body_for: Callable[[Instance], bytes], priority: int) -> Callable[[Instance], bytes]:
    """A body made for each attempt's instance (a Responses request's), with `priority` set."""
    return partial(_prioritized, body_for, priority)


def _prioritized(body_for: Callable[[Instance], bytes], priority: int, instance: Instance) -> bytes:
    return with_engine_priority(body_for(instance), priority)
