"""A/B testing across router replicas sharing a real redis-server (router/dispatch/observe/ab_shared.py): a report at
either replica counts both replicas' requests, a reset at one starts both afresh, and a split set at one is
taken by the other."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.processes import FleetPorts, running_router_process
from kvroute.store_servers import StoreServer, running_redis
from tests.router.http.test_admin import AUTH, call, chat, config_of
from tests.router.shared.test_shared_replicas import heard_each_other
from tests.support.waiting import eventually

SESSIONS = 12  # per replica


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def replicas(fleet: FleetPorts, redis_server: StoreServer, tmp_path: Path) -> Iterator[list[str]]:
    shared = {"url": redis_server.url, "namespace": f"test-{uuid.uuid4().hex[:8]}", "stale_after_s": 0.5}
    config = config_of(fleet, shared=shared)
    with (
        running_router_process(config, tmp_path, "replica-a") as (first, _),
        running_router_process(config, tmp_path, "replica-b") as (second, _),
    ):
        heard_each_other([first, second])
        yield [first, second]


def requests_reported(url: str) -> int:
    status, report = call("GET", url + "/admin/ab", headers=AUTH)
    assert status == 200
    return sum(policy["requests"] for policy in report["policies"].values())


def test_each_replica_reports_every_replicas_results_and_one_reset_clears_them_all(
    replicas: list[str],
) -> None:
    for number, url in enumerate(replicas):
        for session in range(SESSIONS):
            chat(url, f"s{number}-{session}")
    for url in replicas:  # written within a second, read by the other
        eventually(lambda url=url: requests_reported(url) == 2 * SESSIONS, what="both replicas' requests")
    status, _ = call("POST", replicas[1] + "/admin/ab/reset", headers=AUTH)
    assert status == 200
    eventually(lambda: requests_reported(replicas[0]) == 0, what="the reset at the other replica")
    chat(replicas[0], "after")
    eventually(lambda: requests_reported(replicas[1]) == 1, what="the next request, counted once")


def test_a_split_set_at_one_replica_is_taken_by_the_other(replicas: list[str]) -> None:
    status, _ = call("PUT", replicas[0] + "/admin/traffic", {"split": {"kvroute": 1}}, headers=AUTH)
    assert status == 200

    def split_at_second() -> dict[str, float]:
        return call("GET", replicas[1] + "/admin/traffic", headers=AUTH)[1]["split"]

    eventually(lambda: split_at_second() == {"kvroute": 1.0}, what="the split at the other replica")
