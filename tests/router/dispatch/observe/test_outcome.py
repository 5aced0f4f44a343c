"""What an attempt's first byte tells, and in which order (router/dispatch/observe/outcome.py)."""

from __future__ import annotations

from typing import ClassVar

from router.dispatch.decide.decision import Decision
from router.dispatch.observe.ab import ABStats
from router.dispatch.observe.events import Event
from router.dispatch.observe.observers import Observers
from router.dispatch.observe.outcome import Asked, Outcome
from router.metrics import RouterMetrics
from router.upstreams.instances import Instance
from scorers.policy import Policy
from scorers.policy_config import builtin_policies
from scorers.ttft_model import TTFTFeatures


class _Answer:
    status = 200
    headers: ClassVar[dict[str, str]] = {}

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_room_a_first_byte_frees_is_judged_by_a_model_that_learnt_from_it() -> None:
    # Flow control's saturation reads the TTFT model's queue rate: the requests let go when room frees must
    # see the sample that freed it, as they would a moment later.
    now = [0.0]
    instance = Instance("a", "http://a", frozenset({"m"}))
    seen: list[tuple[int, int]] = []
    room_freed = Event()
    room_freed.subscribe(
        lambda: seen.append((instance.ttft_model.observations, instance.own_pending_prefill_tokens))
    )
    observers = Observers(RouterMetrics(), lambda _: ABStats(), room_freed, clock=lambda: now[0])
    features = TTFTFeatures(queued_tokens=0, uncached_tokens=512, loaded_tokens=0)
    decision = Decision(instance, 512, 32, 0, 512, features, 0.2)
    policy = Policy("kvroute", builtin_policies()["kvroute"])
    outcome = Outcome.start(observers, decision, Asked(policy, "m", streamed=True), None)
    now[0] = 0.3
    outcome.answered(_Answer(), b"data: {}\n\n", attempts=1)
    assert seen == [(1, 0)]
