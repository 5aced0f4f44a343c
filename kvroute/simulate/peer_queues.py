"""The queues the peers ship, off by default, as variants: each peer is compared at its best.

Both wait in the simulated router through the same machinery as kvroute's queue (for the order and the
priority bands: router/dispatch/wait/flow_control.py), each with its own rule for when a request may leave:

- Dynamo's router queue (`--router-queue-threshold`, `--router-queue-policy fcfs|wspt`; off since v1.4): a
  worker is busy while its active prefill tokens (the router's own count) pass threshold x its
  max_num_batched_tokens; requests wait while every worker is busy (or others wait), and leave as prefills
  complete and requests end, first come first served or by weighted shortest processing time (the fewest
  uncached tokens where they match most, taken as they arrive), in one class (no fairness between sessions).
  Its priority is a head start in the order; here a priority band, as kvroute's queue has them.
- llm-d's flow control (a feature gate, off by default): the pool is saturated while every endpoint's scraped
  metrics pass its saturation detector's thresholds (5 requests waiting, or 80% of its KV cache in use);
  requests wait while it is, first come first served, fair between flows named by a fairness header.
"""

from __future__ import annotations

from typing import Literal

from kvroute.simulate.engine import SimRequest
from kvroute.simulate.peers import DynamoCost
from kvroute.simulate.policies import SIM_OBJECTIVES, ConfiguredPolicy
from router.config import RouterConfig
from router.dispatch.wait.settings import FlowControlConfig

NO_AGING_TOKENS_PER_S = 1e12  # WSPT orders by work alone: waiting never outweighs a shorter prompt
# The flag's default where it had one (1.1, 1.2; 16 in 1.3; off from 1.4, its value the user's).
DYNAMO_QUEUE_THRESHOLD = 4.0
LLMD_QUEUE_DEPTH = 5
LLMD_KV_USAGE = 0.8


class DynamoQueued(DynamoCost):
    """Dynamo's KV router with its router queue on."""

    queue_flows = "one"

    def __init__(
        self,
        name: str,
        policy: Literal["fcfs", "wspt"],
        max_batched_tokens: int,
        threshold: float = DYNAMO_QUEUE_THRESHOLD,
    ) -> None:
        super().__init__()
        self.name = name
        self._busy_above = threshold * max_batched_tokens
        ordering = "fcfs" if policy == "fcfs" else "spt"
        self.flow_control = FlowControlConfig.model_validate(
            {"ordering": ordering, "aging_tokens_per_s": NO_AGING_TOKENS_PER_S, "objectives": SIM_OBJECTIVES}
        )

    def has_room(self, extra_work: float) -> bool:
        tokens = self._active.prefill_tokens
        return any(tokens[w] + extra_work <= self._busy_above for w in range(len(tokens)))

    def work(self, request: SimRequest) -> float:
        """Its uncached tokens where it matches most, as the queue snapshots them."""
        matches = self.view.matches(request.chain.tolist())
        best = max((m.gpu for m in matches.values()), default=0)
        return float(max(request.trace.input_tokens - best * self.view.block_size, 1))


class LlmdQueued(ConfiguredPolicy):
    """llm-d's endpoint picker with flow control on: it queues instead of shedding."""

    queue_flows = "tenant"
    queue_reads_metrics = True

    def __init__(self, name: str, config: RouterConfig, policy: str, scrape_interval_s: float) -> None:
        super().__init__(
            name,
            config,
            policy,
            decide=False,
            include_pool=False,
            calibrate=False,
            scrape_interval_s=scrape_interval_s,
        )
        settings = {"ordering": "fcfs", "objectives": SIM_OBJECTIVES}
        self.flow_control = FlowControlConfig.model_validate(settings)

    def has_room(self, extra_work: float) -> bool:
        return any(
            i.load is None or (i.load.waiting < LLMD_QUEUE_DEPTH and i.load.kv_usage < LLMD_KV_USAGE)
            for i in self.view.instances
        )
