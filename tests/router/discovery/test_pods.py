"""A pod as an instance: ports, role and data parallelism from the configuration or its annotations."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.discovery.pods import PodError, instance_name, instance_of
from router.discovery.settings import DiscoveryConfig
from router.discovery.wire import Pod
from tests.router.discovery.kube_api import pod

CONFIG = DiscoveryConfig(
    selector="app=vllm", role_label="llm-d.ai/role", ports={"http": 8000, "events": 5557}
)  # type: ignore[arg-type]


def _pod(ip: str = "10.0.0.7", labels: dict[str, str] | None = None, **annotations: str) -> Pod:
    raw = pod(
        "vllm-abc",
        labels or {"app": "vllm"},
        ip=ip,
        annotations={f"kvroute.io/{k.replace('_', '-')}": v for k, v in annotations.items()},
    )
    return msgspec.convert(raw, Pod)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            _pod(),
            {
                "name": "vllm-abc",
                "url": "http://10.0.0.7:8000",
                "events": "tcp://10.0.0.7:5557",
                "replay": None,
                "role": "both",
            },
        ),
        (
            _pod(http_port="9000", events_port="6000", replay_port="6001"),
            {"url": "http://10.0.0.7:9000", "events": "tcp://10.0.0.7:6000", "replay": "tcp://10.0.0.7:6001"},
        ),
        (_pod(ip="fd00::7"), {"url": "http://[fd00::7]:8000", "events": "tcp://[fd00::7]:5557"}),
        (_pod(labels={"app": "vllm", "llm-d.ai/role": "decode"}), {"role": "decode"}),
        (_pod(labels={"app": "vllm", "llm-d.ai/role": "decode"}, role="prefill"), {"role": "prefill"}),
        (_pod(data_parallel_size="2"), {"data_parallel_size": 2}),
    ],
)
def test_pod_as_instance(given: Pod, expected: dict[str, Any]) -> None:
    instance = instance_of(given, CONFIG, 8000)
    assert {key: getattr(instance, key) for key in expected} == expected


@pytest.mark.parametrize(
    "given",
    [
        _pod(http_port="http"),
        _pod(http_port="70000"),
        _pod(role="leader"),
        _pod(data_parallel_size="0"),
        _pod(ip="x"),
    ],
)
def test_bad_annotations_leave_the_pod_out(given: Pod) -> None:
    with pytest.raises(PodError):
        instance_of(given, CONFIG, 8000)


def test_names_fit_the_instance_pattern_and_stay_apart() -> None:
    long = "a" * 80
    assert len(instance_name(long)) == 63 and instance_name(long) != instance_name(long + "b")
    assert instance_name("vllm-0") == "vllm-0"
