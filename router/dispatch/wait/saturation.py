"""When an instance is saturated: a request sent there now would wait in its engine instead of in the router.

An engine queues what it cannot start at once, first come first served; a request that waits there is
committed to that instance and to that order. An instance is saturated for the router while the prefill it
has queued (this router's and its peers' uncached tokens not yet answered) would keep a new request waiting
longer than `engine_queue_s` (its TTFT model's queue rate says how long a token takes), or while the contexts
in flight there hold more than `kv_usage` of its KV memory (the engine's own admission limit). A request
waits in the router while every instance that could serve it is saturated (for a disaggregated model: every
prefill instance, or every decode instance), so it is placed with the index as it is when it leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.upstreams.instances import Instance


@dataclass(frozen=True, slots=True)
class Saturation:
    engine_queue_s: float
    kv_usage: float

    def queue_full(self, instance: Instance, extra_work: float = 0.0) -> bool:
        """extra_work: uncached tokens assumed queued there besides its own (requests let go, not placed)."""
        return (
            instance.pending_prefill_tokens + extra_work
        ) * instance.ttft_model.queue_rate > self.engine_queue_s

    def memory_full(self, instance: Instance, extra_tokens: int = 0) -> bool:
        capacity = instance.kv_capacity_tokens
        return bool(capacity) and instance.active_tokens + extra_tokens >= self.kv_usage * capacity  # type: ignore[operator]

    def open(self, instance: Instance, extra_work: float = 0.0, extra_tokens: int = 0) -> bool:
        return not self.queue_full(instance, extra_work) and not self.memory_full(instance, extra_tokens)

    def has_room(
        self, candidates: Sequence[Instance], extra_work: float = 0.0, extra_tokens: int = 0
    ) -> bool:
        """Some candidate may take a request now (an aggregated model's, where each does both stages), with
        extra_work and extra_tokens (requests let go from the queue and not yet placed: wherever they go)
        assumed on it too; with none at all, the request goes on to find that out (a 503), not to wait."""
        return not candidates or any(self.open(i, extra_work, extra_tokens) for i in candidates)

    def stages_have_room(
        self,
        prefill: Sequence[Instance],
        decode: Sequence[Instance],
        extra_work: float = 0.0,
        extra_tokens: int = 0,
    ) -> bool:
        """A disaggregated model's: some prefill instance's queue and some decode instance's memory."""
        prefill_open = not prefill or any(not self.queue_full(i, extra_work) for i in prefill)
        decode_open = not decode or any(not self.memory_full(i, extra_tokens) for i in decode)
        return prefill_open and decode_open
