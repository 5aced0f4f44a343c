"""The metric families and label sets the dashboard reads, as the router exports them after real traffic."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import metric, sample
from tests.deploy.test_grafana_dashboard import CHARTS, EXPORTED, metric_names
from tests.support.http import post
from tests.support.waiting import eventually

MODEL = "tiny-llama"
SESSION = "metrics-names"
FLEET_NAMES = ("fleet-0", "fleet-1", "fleet-2")
TERMS = ("overhead", "queue", "prefill", "load", "memory", "decode", "attention", "transfer")
# Long enough for several full 32-token blocks, so the engine stores some and says so in KV events.
SYSTEM = "You are a careful coding agent working through a failing test suite, one file at a time. " * 8


@dataclass(frozen=True)
class Served:
    instance: str
    policy: str
    stream: bool


@pytest.fixture(scope="module")
def traffic(router_url: str) -> list[Served]:
    served = []
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, stream in enumerate((False, True, False, True)):
        messages.append({"role": "user", "content": f"Turn {turn}: run the tests in tests/test_{turn}.py."})
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": stream}
        status, headers, payload = post(
            router_url + "/v1/chat/completions", json.dumps(body).encode(), {"x-session-id": SESSION}
        )
        assert status == 200, payload
        served.append(Served(headers["x-kvroute-instance"], headers["x-kvroute-policy"], stream))
        messages.append({"role": "assistant", "content": "Running them now."})
    # KV events and the end of a relayed stream are recorded after the client has its answer.
    for instance in {s.instance for s in served}:
        eventually(
            lambda i=instance: sample(
                router_url, "kvroute_kv_events_total", vllm_instance=i, type="BlockStored"
            )
        )
        eventually(lambda i=instance: sample(router_url, "kvroute_instance_in_flight", vllm_instance=i) == 0)
    return served


def _label_names(url: str) -> dict[str, set[frozenset[str]]]:
    """Family name (counters without _total) -> the label name sets its samples carry, le aside."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        family.name: {frozenset(sample.labels) - {"le"} for sample in family.samples}
        for family in text_string_to_metric_families(text)
        if family.name.startswith("kvroute_")
    }


@pytest.mark.parametrize(
    ("family", "labels"),
    [
        ("kvroute_requests", {"policy", "vllm_instance", "status", "model", "api"}),
        ("kvroute_time_to_first_byte_seconds", {"policy", "model"}),
        ("kvroute_request_duration_seconds", {"policy", "model"}),
        ("kvroute_routing_decision_seconds", {"stage"}),
        ("kvroute_index_blocks", {"vllm_instance", "tier"}),
        ("kvroute_kv_events", {"vllm_instance", "type"}),
        ("kvroute_instance_healthy", {"vllm_instance"}),
        ("kvroute_instance_in_flight", {"vllm_instance"}),
        ("kvroute_ttft_predicted_seconds", {"vllm_instance"}),
        ("kvroute_ttft_observed_seconds", {"vllm_instance"}),
        ("kvroute_ttft_prediction_error_seconds", {"vllm_instance"}),
        ("kvroute_ttft_model_rate", {"vllm_instance", "term"}),
        ("kvroute_ttft_instance_slowdown", {"vllm_instance"}),
        ("kvroute_predicted_cached_tokens", {"policy", "tier"}),
        ("kvroute_prompt_tokens", {"policy"}),
        ("kvroute_session_turns", {"policy", "placement"}),
        ("kvroute_programs", {"vllm_instance", "state"}),
        ("kvroute_program_working_set_tokens", {"vllm_instance"}),
        ("kvroute_program_turns", {"kv", "tool_call"}),
        ("kvroute_index_bytes", set()),
        ("kvroute_admission_waiting", set()),
        ("kvroute_index_pool_blocks", set()),
    ],
)
def test_families_carry_exactly_their_labels(
    router_url: str, traffic: list[Served], family: str, labels: set[str]
) -> None:
    assert _label_names(router_url).get(family) == {frozenset(labels)}


def _counts(served: list[Served]) -> list[tuple[str, dict[str, str], float]]:
    """(sample, labels, at least): what the traffic must have left in the router's metrics."""
    present = float("-inf")
    streams = [s for s in served if s.stream]
    samples: list[tuple[str, dict[str, str], float]] = [
        ("kvroute_routing_decision_seconds_count", {"stage": "prepare"}, len(served)),
        ("kvroute_routing_decision_seconds_count", {"stage": "choose"}, len(served)),
    ]
    for policy, count in Counter(s.policy for s in served).items():
        samples += [
            ("kvroute_time_to_first_byte_seconds_count", {"policy": policy, "model": MODEL}, count),
            ("kvroute_request_duration_seconds_count", {"policy": policy, "model": MODEL}, count),
            ("kvroute_prompt_tokens_total", {"policy": policy}, count),  # each prompt a token at least
        ]
    first = served[0].policy  # one session: its first turn, then each later one where it went
    samples.append(("kvroute_session_turns_total", {"policy": first, "placement": "first"}, 1))
    for s in served:
        samples += [
            (
                "kvroute_requests_total",
                {
                    "policy": s.policy,
                    "vllm_instance": s.instance,
                    "status": "200",
                    "model": MODEL,
                    "api": "chat",
                },
                1,
            ),
            ("kvroute_ttft_predicted_seconds_count", {"vllm_instance": s.instance}, 1),
            ("kvroute_index_blocks", {"vllm_instance": s.instance, "tier": "gpu"}, 1),
            ("kvroute_kv_events_total", {"vllm_instance": s.instance, "type": "BlockStored"}, 1),
            ("kvroute_instance_in_flight", {"vllm_instance": s.instance}, present),
        ]
    for s in streams:
        samples += [
            ("kvroute_ttft_observed_seconds_count", {"vllm_instance": s.instance}, 1),
            ("kvroute_ttft_prediction_error_seconds_count", {"vllm_instance": s.instance}, 1),
            *[
                ("kvroute_ttft_model_rate", {"vllm_instance": s.instance, "term": term}, present)
                for term in TERMS
            ],
            ("kvroute_ttft_instance_slowdown", {"vllm_instance": s.instance}, 0.0),
        ]
    return samples


def test_traffic_is_counted_by_policy_instance_and_stage(router_url: str, traffic: list[Served]) -> None:
    for name, labels, least in _counts(traffic):
        assert metric(router_url, name, **labels) >= least, (name, labels)


@pytest.mark.parametrize("instance", FLEET_NAMES)
def test_every_instance_reports_its_health(router_url: str, traffic: list[Served], instance: str) -> None:
    assert metric(router_url, "kvroute_instance_healthy", vllm_instance=instance) == 1


def test_the_running_router_exports_every_family_the_dashboard_reads(
    router_url: str, traffic: list[Served]
) -> None:
    read = {
        EXPORTED[name].family
        for panel in CHARTS
        for t in panel["targets"]
        for name in metric_names(t["expr"])
    }
    assert read - _label_names(router_url).keys() == set()


def test_a_router_without_a_pool_exports_no_pool_master_state(router_url: str) -> None:
    assert sample(router_url, "kvroute_pool_master_up") is None
