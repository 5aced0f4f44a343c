"""Router replicas sharing state through a real redis-server (router/shared/): they find each other on the
store with nothing naming the others, one tenant's limit on requests in flight holds across them as one
limit, and losing the store loses no request: each replica warns, carries on alone, and shares again once
the store is back."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvroute.processes import FleetPorts, running_router_process
from kvroute.store_servers import StoreServer, running_redis, start_redis
from router.dispatch.observe.routing_headers import CACHED_BLOCKS_HEADER, INSTANCE_HEADER
from tests.conftest import metric, sample
from tests.support.http import get_json, post
from tests.support.waiting import eventually

TENANT_LIMIT = 2
BLOCK = 32  # FleetPorts.router_config's block size
FAIRNESS = "x-gateway-inference-fairness-id"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def replica_config(fleet: FleetPorts, url: str, namespace: str) -> dict[str, object]:
    # A store slower than timeout_s is one a replica carries on without (its limits then its own): on a busy
    # test machine a round trip may take a while, which is not what these tests are about.
    shared = {"url": url, "namespace": namespace, "interval_s": 0.05, "stale_after_s": 0.5, "timeout_s": 2.0}
    flow_control = {"per_flow": {"max_in_flight": TENANT_LIMIT}}
    return fleet.router_config(shared=shared, flow_control=flow_control, health={"interval_s": 0.2})


@pytest.fixture
def two_replicas(fleet: FleetPorts, redis_server: StoreServer, tmp_path: Path) -> Iterator[list[str]]:
    namespace = f"test-{uuid.uuid4().hex[:8]}"  # replicas of this test only
    config = replica_config(fleet, redis_server.url, namespace)
    with (
        running_router_process(config, tmp_path, "replica-a") as (first, _),
        running_router_process(config, tmp_path, "replica-b") as (second, _),
    ):
        yield [first, second]


def heard_each_other(replicas: list[str]) -> None:
    for url in replicas:
        eventually(lambda url=url: metric(url, "kvroute_peer_routers") == len(replicas) - 1, what="a peer")
        # An operation sent while the store was away may fail just after it is back: up again at the next.
        eventually(lambda url=url: metric(url, "kvroute_shared_store_up") == 1, what="the store up")


def chat(url: str, tenant: str, max_tokens: int = 1) -> int:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": f"{tenant} asks again"}],
        "max_tokens": max_tokens,
    }
    status, _, _ = post(url + "/v1/chat/completions", json.dumps(body).encode(), {FAIRNESS: tenant})
    return status


def engine_requests(fleet: FleetPorts) -> int:
    """Requests running or waiting at every instance of the fleet."""
    return sum(
        int(sample(f"http://127.0.0.1:{fleet.http + n}", name) or 0)
        for n in range(fleet.count)
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
    )


def sustained(seen: list[int]) -> list[int]:
    """The fleet's counts that held for two samples in a row. One sample reads the instances one after
    another: a request that ends at one already read while the next starts at one read later shows both
    for one sample, never for two; a request past the limit decodes for hundreds of samples."""
    return [min(pair) for pair in itertools.pairwise(seen)]


def tenant_chats(
    fleet: FleetPorts, replicas: list[str], count: int, max_tokens: int, gap_s: float = 0.0
) -> tuple[list[int], list[int]]:
    """count chats of one tenant, through the replicas in turn, each in a thread of its own started gap_s
    after the last: their statuses, and the fleet's requests running or waiting every 20 ms meanwhile."""
    statuses: list[int] = []
    senders = [
        threading.Thread(
            target=lambda n=n: statuses.append(chat(replicas[n % len(replicas)], "tenant-a", max_tokens))
        )
        for n in range(count)
    ]
    seen: list[int] = []
    for sender in senders:
        sender.start()
        time.sleep(gap_s)
    while any(sender.is_alive() for sender in senders):
        seen.append(engine_requests(fleet))
        time.sleep(0.02)
    return statuses, seen


def test_replicas_find_each_other_on_the_store_and_share_a_tenants_limit(
    fleet: FleetPorts, two_replicas: list[str]
) -> None:
    heard_each_other(two_replicas)
    # Each request decodes for about a second: 6 of one tenant, alternately through each replica, 0.1 s apart.
    statuses, seen = tenant_chats(fleet, two_replicas, 6, 1000, gap_s=0.1)
    assert statuses == [200] * 6
    # Alone, each replica lets 2 go at once: 4 together most of the time. Sharing, each request takes its slot
    # on the store before it goes (router/shared/slots.py), so the tenant never has more than 2 in flight,
    # however the replicas' snapshots lag.
    assert max(sustained(seen)) == TENANT_LIMIT, seen


def test_a_tenants_limit_in_flight_is_strict_across_three_replicas_sent_to_at_once(
    fleet: FleetPorts, redis_server: StoreServer, tmp_path: Path
) -> None:
    """Twelve half-second requests of one tenant limited to 3, all sent at once through three replicas in
    turn: each replica would let 3 go on what its peers told it (nothing yet), so only the store's slots keep
    the tenant at 3."""
    limit, namespace = 3, f"test-{uuid.uuid4().hex[:8]}"
    config = replica_config(fleet, redis_server.url, namespace)
    config["flow_control"] = {"per_flow": {"max_in_flight": limit}}
    # Slots live on a lease of 3 x stale_after_s: a replica whose loop the busy machine holds up longer
    # than that would lose its slots to its peers (as a dead one does).
    config["shared"] = {**config["shared"], "stale_after_s": 2.0}  # type: ignore[dict-item]
    with contextlib.ExitStack() as stack:
        replicas = [
            stack.enter_context(running_router_process(config, tmp_path, f"replica-{n}"))[0] for n in range(3)
        ]
        heard_each_other(replicas)
        statuses, seen = tenant_chats(fleet, replicas, 12, 500)
        waits = "kvroute_flow_control_slot_waits_total"
        waited = sum(sample(url, waits, objective="default") or 0 for url in replicas)
    assert statuses == [200] * 12
    assert max(sustained(seen)) == limit, seen
    assert waited > 0  # the replicas did race for the last slots: the store settled it


@contextlib.contextmanager
def kept_busy(replicas: list[str], statuses: list[int]) -> Iterator[None]:
    """Chats through the replicas in turn, one after another in a thread, until the block ends."""
    done = threading.Event()

    def busy() -> None:
        turn = 0
        while not done.is_set():
            statuses.append(chat(replicas[turn % len(replicas)], f"tenant-{turn % 3}", 16))
            turn += 1

    thread = threading.Thread(target=busy, name="kept-busy", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(60)


def test_losing_the_store_loses_no_request_and_its_return_shares_again(
    fleet: FleetPorts, tmp_path: Path
) -> None:
    """The store killed and started again while requests flow through both replicas."""
    server = start_redis(tmp_path / "redis")
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    config = replica_config(fleet, server.url, namespace)
    statuses: list[int] = []
    try:
        with (
            running_router_process(config, tmp_path, "replica-a") as (first, _),
            running_router_process(config, tmp_path, "replica-b") as (second, _),
            kept_busy([first, second], statuses),
        ):
            replicas = [first, second]
            heard_each_other(replicas)
            server.child.stop()
            for url in replicas:
                eventually(lambda url=url: metric(url, "kvroute_shared_store_up") == 0, what="the store lost")
                health = get_json(url + "/health")
                assert health["status"] == "degraded"
                assert any("shared store" in warning for warning in health["warnings"]), health
            assert [chat(url, f"tenant-{n}") for n in range(4) for url in replicas] == [200] * 8
            for url in replicas:  # alone: its peer's snapshots stopped
                eventually(
                    lambda url=url: metric(url, "kvroute_peer_routers") == 0, what="the peer forgotten"
                )

            server = start_redis(tmp_path / "redis", port=server.port)
            back = time.monotonic()
            heard_each_other(replicas)
            assert time.monotonic() - back < 10
            for url in replicas:
                assert not any("shared store" in w for w in get_json(url + "/health")["warnings"])
            assert [chat(url, "tenant-a") for url in replicas] == [200, 200]
    finally:
        server.child.stop()
    assert len(statuses) > 20 and set(statuses) == {200}, statuses


def respond(url: str, text: str, previous: str | None) -> tuple[dict[str, str], dict[str, Any]]:
    body: dict[str, object] = {"model": "tiny-llama", "input": text, "max_output_tokens": 8}
    if previous is not None:
        body["previous_response_id"] = previous
    status, headers, answer = post(url + "/v1/responses", json.dumps(body).encode())
    assert status == 200, answer
    return headers, json.loads(answer)


def test_a_follow_up_through_another_replica_is_routed_with_its_prefix_known(
    fleet: FleetPorts, two_replicas: list[str]
) -> None:
    """A Responses chain whose every turn goes through the other replica: each turn's prompt is known where it
    is routed (the conversation behind the previous response was read from the store), so its predicted
    cached blocks are the engine's hits."""
    heard_each_other(two_replicas)
    previous = None
    turns = []
    for turn in range(4):
        text = f"turn {turn}: read the failing test, then patch the parser and run it again. " * 6
        headers, answer = respond(two_replicas[turn % 2], text, previous)
        cached = answer["usage"]["input_tokens_details"]["cached_tokens"]
        turns.append((headers[INSTANCE_HEADER], int(headers[CACHED_BLOCKS_HEADER]), cached))
        previous = answer["id"]
    assert len({instance for instance, _, _ in turns}) == 1, turns
    for _, predicted, cached in turns[1:]:
        assert predicted == cached // BLOCK > 0, turns


def test_a_tenants_tokens_a_second_hold_across_three_replicas(
    fleet: FleetPorts, redis_server: StoreServer, tmp_path: Path
) -> None:
    """One tenant sends as fast as it is let, through three replicas in turn, for a few seconds: what the
    engines get of its prompts stays within one limit (a second's burst at each replica on top), not three."""
    rate, seconds = 2000.0, 4.0
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    config = replica_config(fleet, redis_server.url, namespace)
    config["flow_control"] = {"per_flow": {"tokens_per_s": rate}}
    with contextlib.ExitStack() as stack:
        replicas = [
            stack.enter_context(running_router_process(config, tmp_path, f"replica-{n}"))[0] for n in range(3)
        ]
        for url in replicas:
            eventually(lambda url=url: metric(url, "kvroute_peer_routers") == 2, what="both peers")
        admitted: list[int] = []
        deadline = time.monotonic() + seconds

        def send(first: int) -> None:
            turn = first
            while time.monotonic() < deadline:
                body = {"model": "tiny-llama", "prompt": "tenant a asks " * 40, "max_tokens": 1}
                headers = {FAIRNESS: "tenant-a"}
                url = replicas[turn % 3] + "/v1/completions"
                status, _, answer = post(url, json.dumps(body).encode(), headers)
                if status == 200:
                    admitted.append(json.loads(answer)["usage"]["prompt_tokens"])
                else:
                    assert status == 429, answer
                    time.sleep(0.05)
                turn += 1

        senders = [threading.Thread(target=send, args=(n,)) for n in range(6)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
    # Three replicas alone would let 3 x rate x seconds through; shared, rate x seconds and their bursts.
    assert 0 < sum(admitted) <= 1.05 * rate * seconds + 3 * rate, (sum(admitted), len(admitted))


def test_a_sessions_next_turn_through_another_replica_follows_its_last(
    fleet: FleetPorts, two_replicas: list[str]
) -> None:
    """The second replica heard where the first sent the session's turn: the turn it routes is the session's
    next (same instance), not the first of a session it never saw."""
    heard_each_other(two_replicas)
    first, second = two_replicas
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "plan the refactor " * 30}]}
    headers = {"x-session-id": f"agent-{uuid.uuid4().hex[:8]}"}
    status, answered, _ = post(
        first + "/v1/chat/completions", json.dumps({**body, "max_tokens": 4}).encode(), headers
    )
    assert status == 200
    instance = answered[INSTANCE_HEADER]
    placements = ("first", "same", "moved")
    before = {p: sample(second, "kvroute_session_turns_total", placement=p) or 0 for p in placements}
    programs_before = program_turns(second)
    time.sleep(0.3)  # a few snapshots
    status, answered, _ = post(
        second + "/v1/chat/completions", json.dumps({**body, "max_tokens": 4}).encode(), headers
    )
    assert status == 200 and answered[INSTANCE_HEADER] == instance
    after = {p: sample(second, "kvroute_session_turns_total", placement=p) or 0 for p in placements}
    assert {p: after[p] - before[p] for p in after} == {"first": 0, "same": 1, "moved": 0}
    # and its agent program's: a next turn, its KV found where the first replica's turn left it
    programs_after = program_turns(second)
    assert {kv: programs_after[kv] - programs_before[kv] for kv in programs_after} == {
        "first": 0,
        "kept": 1,
        "elsewhere": 0,
        "lost": 0,
    }


def program_turns(url: str) -> dict[str, float]:
    """The router's program turns by what they found of their KV, over every tool call's length."""
    found = ("first", "kept", "elsewhere", "lost")
    return {kv: sample(url, "kvroute_program_turns_total", kv=kv) or 0 for kv in found}


def test_a_request_with_a_large_context_is_told_to_peers_at_once(
    fleet: FleetPorts, redis_server: StoreServer, tmp_path: Path
) -> None:
    """Between snapshots 5 s apart, a long agent turn sent through one replica reaches the other's counts
    within a second (PeerSync.nudge): two long turns placed by two replicas at once see each other."""
    shared = {"url": redis_server.url, "namespace": f"test-{uuid.uuid4().hex[:8]}", "interval_s": 5.0}
    config = fleet.router_config(shared={**shared, "stale_after_s": 12.0})
    with (
        running_router_process(config, tmp_path, "replica-a") as (first, _),
        running_router_process(config, tmp_path, "replica-b") as (second, _),
    ):
        heard_each_other([first, second])

        def applied() -> float:
            return sample(second, "kvroute_peer_snapshots_total", result="applied") or 0

        before = applied()
        eventually(lambda: applied() > before, timeout_s=12, what="a periodic snapshot")
        periodic = applied()
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "word " * 9000}],
            "max_tokens": 1,
        }
        sent = time.monotonic()
        status, _, _ = post(first + "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200
        eventually(lambda: applied() > periodic, timeout_s=2, what="the nudged snapshot")
        assert time.monotonic() - sent < 4  # before the next periodic one
