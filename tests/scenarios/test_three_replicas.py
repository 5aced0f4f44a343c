"""Three router replicas in front of one fleet, sharing a redis-server, as behind a Service: an agentic
workload whose every turn goes through another replica keeps each session on one instance, every replica
predicts the prefix the engine then reports cached, and a replica restarted on its port rebuilds its index
from the engines' replay buffers (no index loss) while the other two serve every request."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kvroute.processes import Child, FleetPorts, free_port_block, running_fleet, start, wait_all_healthy
from kvroute.store_servers import running_redis
from tests.conftest import sample
from tests.support.waiting import eventually

REPLICAS, INSTANCES, SESSIONS = 3, 4, 6
BLOCK_SIZE = 32
WORDS = "agent tool call result file patch test build error trace repo branch diff commit plan step".split()


@dataclass
class Session:
    name: str
    messages: list[dict[str, str]]
    instance: str | None = None  # where its first turn went
    turns: list[tuple[int, str, int, int]] = field(
        default_factory=list
    )  # replica, instance, predicted, cached


@dataclass
class Replica:
    name: str
    port: int
    config: Path
    log_dir: Path
    child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Child:
        self.child = start(
            self.name, ["serve", "--config", str(self.config), "--port", str(self.port)], self.log_dir
        )
        return self.child

    def stop(self) -> None:
        """SIGTERM to this replica's own process group (and SIGKILL past 10 s), nothing else."""
        if self.child is not None:
            self.child.stop()


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    """A fleet of its own: its replay buffers hold exactly this test's events. Prefill slow enough that a
    cached prefix is worth far more than the load scorers' tie-breaking."""
    ports = FleetPorts.allocate(INSTANCES)
    args = ["--prefill-tps", "20000", "--decode-tps", "2000", "--enable-prompt-tokens-details"]
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), args):
        yield ports


@pytest.fixture
def replicas(fleet: FleetPorts, tmp_path: Path) -> Iterator[list[Replica]]:
    http = free_port_block(REPLICAS)
    started = []
    with running_redis(tmp_path / "redis") as store:
        shared = {"url": store.url, "interval_s": 0.05, "stale_after_s": 0.5}
        for n in range(REPLICAS):
            config = fleet.router_config(BLOCK_SIZE, shared=shared, health={"interval_s": 0.2})
            path = tmp_path / f"replica-{n}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            started.append(Replica(f"replica-{n}", http + n, path, tmp_path))
        try:
            wait_all_healthy([(replica.start(), replica.url + "/metrics") for replica in started])
            yield started
        finally:
            for replica in started:
                replica.stop()


def test_sessions_stay_together_across_replicas_and_a_restart_loses_no_index(replicas: list[Replica]) -> None:
    for replica in replicas:
        ready(replica)
    rng = random.Random(7)
    sessions = [Session(f"s{n}", [{"role": "system", "content": prose(rng, 900)}]) for n in range(SESSIONS)]

    # Round robin over the replicas, each turn of a session through another one than its last.
    for turn in range(3):
        for n, session in enumerate(sessions):
            take_turn(replicas[(n + turn) % REPLICAS], session, rng)
        settled(replicas)
    for session in sessions:
        assert {instance for _, instance, _, _ in session.turns} == {session.instance}, session.turns
        for number, _, predicted, cached in session.turns[1:]:
            assert predicted == cached // BLOCK_SIZE > 0, f"replica-{number} predicted {predicted} blocks"
    snapshot = index_blocks(replicas[0])
    assert all(index_blocks(replica) == snapshot for replica in replicas[1:])

    # One replica restarts; the other two serve every request meanwhile, and it comes back knowing it all.
    restarted, others = replicas[1], [replicas[0], replicas[2]]
    failures: list[str] = []
    with kept_busy(others, sessions, rng, failures):
        restarted.stop()
        wait_all_healthy([(restarted.start(), restarted.url + "/metrics")])
        ready(restarted)
    assert failures == []
    for replica in others:  # they hear it again
        ready(replica)
    settled(replicas)
    assert index_blocks(restarted) == index_blocks(replicas[0]) == index_blocks(replicas[2])
    for n in range(INSTANCES):  # rebuilt from the engines' buffers, not only from the traffic since
        replayed = sample(restarted.url, "kvroute_kv_replays_total", vllm_instance=f"fleet-{n}", result="ok")
        assert replayed is not None and replayed >= 1
    # A continuing turn through the restarted replica: the session's instance, its whole prefix predicted.
    for session in sessions:
        _, instance, predicted, cached = take_turn(restarted, session, rng)
        assert instance == session.instance and predicted == cached // BLOCK_SIZE > 0


def ready(replica: Replica) -> None:
    """Every instance healthy, every engine's buffer replayed into its index, both peers heard."""
    url = replica.url

    def all_there() -> bool:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            healthy = json.loads(response.read())["healthy_instances"]
        warm = [sample(url, "kvroute_kv_warm", vllm_instance=f"fleet-{n}") for n in range(INSTANCES)]
        return (
            len(healthy) == INSTANCES
            and warm == [1.0] * INSTANCES
            and sample(url, "kvroute_peer_routers") == 2
        )

    eventually(all_there, timeout_s=20)


def take_turn(replica: Replica, session: Session, rng: random.Random) -> tuple[int, str, int, int]:
    """The session's next turn through replica: where it went, the blocks the replica predicted cached there,
    the tokens the engine reports cached."""
    session.messages.append({"role": "user", "content": prose(rng, 40)})
    body = {"model": "tiny-llama", "max_tokens": 16, "messages": session.messages}
    headers = {"content-type": "application/json", "x-session-id": session.name}
    request = urllib.request.Request(replica.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
        instance = response.headers["x-kvroute-instance"]
        predicted = int(response.headers["x-kvroute-cached-blocks"])
    session.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    session.instance = session.instance or instance
    turn = (
        int(replica.name.rpartition("-")[2]),
        instance,
        predicted,
        answer["usage"]["prompt_tokens_details"]["cached_tokens"],
    )
    session.turns.append(turn)
    return turn


def index_blocks(replica: Replica) -> dict[str, dict[str, int]]:
    """The blocks the replica's index holds per instance and tier (its KV events; no speculative entries)."""
    with urllib.request.urlopen(replica.url + "/dashboard/state", timeout=10) as response:
        return {i["name"]: i["blocks"] for i in json.loads(response.read())["instances"]}


def settled(replicas: list[Replica]) -> None:
    """Until every replica's index holds the same blocks: the engines' last events have reached them all."""
    eventually(lambda: all(index_blocks(r) == index_blocks(replicas[0]) for r in replicas[1:]), timeout_s=10)


@contextlib.contextmanager
def kept_busy(
    replicas: list[Replica], sessions: list[Session], rng: random.Random, failures: list[str]
) -> Iterator[None]:
    """Sessions' turns through replicas, in turn, in a thread, until the block ends; what failed in failures."""
    done = threading.Event()
    turns = 0

    def busy() -> None:
        nonlocal turns
        while not done.is_set():
            session, replica = sessions[turns % len(sessions)], replicas[turns % len(replicas)]
            try:
                _, instance, _, _ = take_turn(replica, session, rng)
                if instance != session.instance:
                    failures.append(f"{session.name} moved to {instance} through {replica.name}")
            except Exception as exc:
                failures.append(f"{replica.name}: {exc!r}")
            turns += 1

    thread = threading.Thread(target=busy, name="kept-busy", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(60)
    assert turns >= len(replicas), f"only {turns} turns while the replica restarted"


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(words))
