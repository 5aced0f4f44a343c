"""Request bodies read ahead of admission share one budget: memory follows it, not the connections."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

from kvroute.processes import running_router_process
from router.http.body_budget import BodyBudget
from tests.scenarios.test_misbehaving_engine import WHOLE, peak_rss_mib
from tests.support.fake_upstreams import answering, healthy, only_instance, serving
from tests.support.http import post

_MIB = 2**20


def test_shares_are_granted_in_order_and_given_back() -> None:
    async def run() -> None:
        budget = BodyBudget(lambda: 10)
        assert await budget.take(6) == 6
        second = asyncio.create_task(budget.take(6))
        third = asyncio.create_task(budget.take(1))  # would fit, but waits its turn
        await asyncio.sleep(0)
        assert not second.done() and not third.done()
        budget.give_back(6)
        assert await second == 6 and await third == 1 and budget.taken == 7

    asyncio.run(run())


def test_a_share_given_up_while_waiting_lets_the_next_one_in() -> None:
    async def run() -> None:
        budget = BodyBudget(lambda: 10)
        await budget.take(8)
        large = asyncio.create_task(budget.take(5))
        small = asyncio.create_task(budget.take(2))
        await asyncio.sleep(0)
        large.cancel()
        assert await small == 2 and budget.taken == 10

    asyncio.run(run())


def test_a_share_larger_than_the_budget_takes_all_of_it_alone() -> None:
    async def run() -> None:
        budget = BodyBudget(lambda: 10)
        assert await budget.take(50) == 10
        waiting = asyncio.create_task(budget.take(1))
        await asyncio.sleep(0)
        assert not waiting.done()
        budget.give_back(10)
        assert await waiting == 1

    asyncio.run(run())


def _send_all_but_one_byte(port: int, size: int, sockets: list[socket.socket]) -> None:
    """A client sending a body of size bytes less its last: the router cannot finish reading it."""
    client = socket.create_connection(("127.0.0.1", port))
    sockets.append(client)
    head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {size}"
    client.sendall(head.encode() + b"\r\n\r\n")
    client.settimeout(3)
    try:
        client.sendall(b" " * (size - 1))
    except TimeoutError:
        pass  # the router stopped reading this one: its body waits for a share


def test_bodies_past_the_budget_wait_unread_and_memory_follows_the_budget(tmp_path: Path) -> None:
    """Twelve clients each send an 8 MiB body less one byte to a router whose budget holds two: its memory
    grows by about two bodies, not twelve; once they leave, a request is answered."""
    clients, body = 12, 8 * _MIB
    with serving(healthy, answering) as port:
        config = only_instance("engine", port) | {
            "limits": {"max_body_bytes": body, "max_buffered_body_bytes": 2 * body, "body_timeout_s": 20}
        }
        with running_router_process(config, tmp_path) as (url, router):
            router_port = int(url.rsplit(":", 1)[1])
            before = peak_rss_mib(router.process.pid)
            sockets: list[socket.socket] = []
            senders = [
                threading.Thread(target=_send_all_but_one_byte, args=(router_port, body, sockets))
                for _ in range(clients)
            ]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join(10)
            time.sleep(0.5)  # what was sent is read by now, as far as the router reads it
            grown = peak_rss_mib(router.process.pid) - before
            for client in sockets:
                client.close()
            assert grown < 5 * body / _MIB, f"the router's memory grew {grown:.0f} MiB for {clients} bodies"
            status, _, payload = post(url + "/v1/completions", WHOLE)
            assert status == 200 and json.loads(payload)["choices"][0]["text"] == "ok"
