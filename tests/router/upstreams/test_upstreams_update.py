"""A reload's changes to the fleet: which instances keep their state and their requests in flight."""

from __future__ import annotations

from router.config import RouterConfig, parse_config
from router.upstreams.instances import Upstreams


def config(**instance: object) -> RouterConfig:
    entry = {"name": "a", "url": "http://127.0.0.1:9001", **instance}
    return parse_config({"models": [{"name": "m"}, {"name": "n"}], "instances": [entry]})


def test_an_instance_changed_at_the_same_url_keeps_its_requests_in_flight() -> None:
    fleet = Upstreams(config())
    (before,) = fleet.instances
    before.start(prompt_tokens=4000, uncached_tokens=4000)  # a request it is serving
    added, removed, in_place = fleet.update(config(events="tcp://127.0.0.1:5557", models=["m", "n"]))
    assert removed == ["a"] and [i.name for i in added] == ["a"]  # resubscribed, its index entries redone
    assert in_place == {"a"}
    (after,) = fleet.instances
    assert after is before and after.in_flight == 1 and after.pending_prefill_tokens == 4000
    assert after.models == {"m", "n"} and fleet.serves("n")
    after.end(4000, 4000)
    assert (after.in_flight, after.pending_prefill_tokens, after.active_tokens) == (0, 0, 0)


def test_an_instance_moved_to_another_url_starts_afresh() -> None:
    fleet = Upstreams(config())
    (before,) = fleet.instances
    before.start(prompt_tokens=10, uncached_tokens=10)
    assert fleet.update(config(url="http://127.0.0.1:9002")).in_place == set()
    (after,) = fleet.instances
    assert after is not before and after.in_flight == 0


def test_an_added_instance_is_no_candidate_until_its_first_health_check_passes() -> None:
    fleet = Upstreams(config())
    added = parse_config(
        {
            "models": [{"name": "m"}],
            "instances": [
                {"name": "a", "url": "http://127.0.0.1:9001"},
                {"name": "b", "url": "http://127.0.0.1:9002"},
            ],
        }
    )
    fleet.update(added)
    assert [i.name for i in fleet.candidates("m")] == ["a"]
    (new,) = [i for i in fleet.instances if i.name == "b"]
    assert (new.healthy, new.checked) == (False, False)  # due at the health checker's next tick
    assert fleet.update(config(url="http://127.0.0.1:9003")).in_place == set()
    assert fleet.candidates("m") == []  # moved: a new engine, not checked yet either


def test_a_model_whose_instances_are_all_down_is_unavailable_while_the_others_serve() -> None:
    fleet = Upstreams(
        parse_config(
            {
                "models": [{"name": "m"}, {"name": "n"}],
                "instances": [
                    {"name": "a", "url": "http://127.0.0.1:9001", "models": ["m"]},
                    {"name": "b", "url": "http://127.0.0.1:9002", "models": ["n"]},
                    {"name": "c", "url": "http://127.0.0.1:9003", "models": ["n"]},
                ],
            }
        )
    )
    assert fleet.unavailable_models() == []
    by_name = {i.name: i for i in fleet.instances}
    by_name["b"].healthy = False
    assert fleet.unavailable_models() == []  # c still serves n
    by_name["a"].healthy = False
    assert fleet.unavailable_models() == ["m"]


def test_a_models_context_length_is_the_least_its_instances_take() -> None:
    fleet = Upstreams(
        parse_config(
            {
                "models": [{"name": "m"}, {"name": "n"}],
                "instances": [
                    {"name": "a", "url": "http://127.0.0.1:9001", "models": ["m"]},
                    {"name": "b", "url": "http://127.0.0.1:9002", "models": ["m", "n"]},
                ],
            }
        )
    )
    assert fleet.max_model_len("m") is None  # no instance has said yet
    a, b = fleet.instances
    a.max_model_len, b.max_model_len = {"m": 32768}, {"m": 8192, "n": 4096}
    assert (fleet.max_model_len("m"), fleet.max_model_len("n")) == (8192, 4096)
