from __future__ import annotations

import pytest

from router.upstreams.instances import Instance, InstanceSetup
from router.upstreams.room import waiting, with_room
from scorers.candidate import EngineLoad


def _instance(name: str, own_in_flight: int = 0, load: EngineLoad | None = None) -> Instance:
    instance = Instance(name, f"http://{name}", frozenset({"m"}), setup=InstanceSetup(load=load))
    instance.own_in_flight = own_in_flight
    return instance


@pytest.mark.parametrize(
    ("own_in_flight", "load", "expected"),
    [
        (5, None, 0.0),  # never scraped: unknown, not full
        (0, EngineLoad(waiting=30, running=10, kv_usage=0.5), 30.0),  # the scrape
        (50, EngineLoad(waiting=30, running=10, kv_usage=0.5), 40.0),  # sent since: beyond what ran then
    ],
)
def test_waiting_is_the_scraped_queue_or_what_was_sent_beyond_it(
    own_in_flight: int, load: EngineLoad | None, expected: float
) -> None:
    assert waiting(_instance("a", own_in_flight, load)) == expected


def _loaded(name: str, queued: int) -> Instance:
    return _instance(name, load=EngineLoad(waiting=queued, running=8, kv_usage=0.9))


@pytest.mark.parametrize(
    ("queues", "max_waiting", "expected"),
    [
        ([64, 10], None, ["a", "b"]),  # no limit known: the engines queue
        ([60, 10], 64, ["b"]),  # within a few requests of its limit: not while another has room
        ([59, 10], 64, ["a", "b"]),
        ([63, 62], 64, ["a", "b"]),  # every queue near full: all of them (a refusal is retried elsewhere)
    ],
)
def test_an_instance_near_its_queue_limit_is_not_a_candidate_while_another_has_room(
    queues: list[int], max_waiting: int | None, expected: list[str]
) -> None:
    instances = [_loaded(name, queued) for name, queued in zip("ab", queues, strict=True)]
    assert [i.name for i in with_room(instances, 1024, max_waiting)] == expected


def test_the_routers_own_in_flight_limit_comes_first() -> None:
    full, quiet = _instance("full", own_in_flight=4), _loaded("quiet", 63)
    assert [i.name for i in with_room([full, quiet], 4, 64)] == ["quiet"]
    assert with_room([full], 4, 64) == []
