"""A fleet of thousands: `kvroute serve` configured with 2,000 instances follows every one's KV events. Each
subscription takes a few ZMQ sockets, past libzmq's default of 1,023 a context, which once left half of a
1,000-instance fleet unsubscribed (`Too many open files`), retried forever."""

from __future__ import annotations

import resource
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvroute.processes import free_port_block, running_router
from router.index.events import BlockStored, EventEncoder, pack_seq
from router.index.subscriptions import open_files_limit

INSTANCES = 2_000
BLOCK_SIZE = 32


@pytest.fixture
def publishers() -> Iterator[int]:
    """INSTANCES PUB sockets on consecutive ports from the one yielded, each sending a block of its own every
    half second (a subscriber that joins late takes the next)."""
    base = free_port_block(INSTANCES)
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, INSTANCES + 64)
    sockets = []
    for n in range(INSTANCES):
        sock = context.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{base + n}")
        sockets.append(sock)
    stop = threading.Event()

    def publish() -> None:
        encoder, seq = EventEncoder("map"), 0
        while not stop.is_set():
            for n, sock in enumerate(sockets):
                block = BlockStored(
                    [n * 1_000_000 + seq], None, list(range(BLOCK_SIZE)), BLOCK_SIZE, None, None, None
                )
                sock.send_multipart([b"", pack_seq(seq), encoder.encode(time.time(), [block])])
            seq += 1
            stop.wait(0.5)

    sender = threading.Thread(target=publish)
    sender.start()
    try:
        yield base
    finally:
        stop.set()
        sender.join(10)
        for sock in sockets:
            sock.close()
        context.term()


def test_every_one_of_two_thousand_instances_is_followed(publishers: int, tmp_path: Path) -> None:
    nowhere = free_port_block(INSTANCES)  # their HTTP side is down: this is about their events
    config = {
        "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],
        "block_size": BLOCK_SIZE,
        "instances": [
            {
                "name": f"i{n}",
                "url": f"http://127.0.0.1:{nowhere + n}",
                "events": f"tcp://127.0.0.1:{publishers + n}",
            }
            for n in range(INSTANCES)
        ],
        "health": {"interval_s": 60},
    }
    with running_router(config, tmp_path) as url:
        deadline = time.monotonic() + 30
        followed: set[str] = set()
        while len(followed) < INSTANCES and time.monotonic() < deadline:
            time.sleep(1)
            followed = _instances_heard(url)
        log = (tmp_path / "router.log").read_text()
    assert len(followed) == INSTANCES, (len(followed), log[-2000:])
    assert "Too many open files" not in log


def _instances_heard(url: str) -> set[str]:
    """The instances whose events the router has applied."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        families = text_string_to_metric_families(answer.read().decode())
    return {
        found.labels["vllm_instance"]
        for family in families
        for found in family.samples
        if found.name == "kvroute_kv_events_total" and found.value > 0
    }


def test_the_open_files_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    try:
        assert open_files_limit() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
