"""Flow control through `kvroute serve` and a simulated instance: a request waits in the router while the
instance is prefilling, higher priority leaves first, limits answer 429 in the route's shape, and a client
that leaves is dequeued without leaking its place."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

from kvroute.processes import FleetPorts, running_fleet, running_router
from tests.conftest import metric, sample
from tests.support.http import post
from tests.support.waiting import eventually

OBJECTIVE = "x-gateway-inference-objective"


def completion(prompt: list[int], stream: bool = False) -> bytes:
    return json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "stream": stream}).encode()


def test_requests_wait_while_the_instance_prefills_and_leave_by_priority(tmp_path: Path) -> None:
    """engine_queue_s 0: the instance is saturated while any prompt it was sent is still prefilling. A
    2,000-token stream prefills for about 4 s; meanwhile a batch and an interactive request wait, a second
    batch one is refused (its objective queues one), and a client gives up. Once the stream's first byte
    comes, the interactive request leaves first."""
    ports = FleetPorts.allocate(1)
    with running_fleet(ports, tmp_path, ["--prefill-tps", "500"]):
        flow_control = {
            "engine_queue_s": 0.0,
            "objectives": {
                "interactive": {"priority": 10},
                "batch": {"priority": -10, "max_queued": 1, "max_queue_s": 30},
            },
        }
        with running_router(ports.router_config(flow_control=flow_control), tmp_path) as url:
            endpoint = url + "/v1/completions"
            answers: dict[str, tuple[int, dict[str, str], bytes, float]] = {}

            def send(name: str, body: bytes, headers: dict[str, str]) -> None:
                status, got, answer = post(endpoint, body, headers)
                answers[name] = (status, got, answer, time.monotonic())

            def queued(objective: str) -> float | None:
                return sample(url, "kvroute_flow_control_queued", objective=objective)

            long = threading.Thread(target=send, args=("long", completion([5] * 2000, stream=True), {}))
            long.start()  # about 4 s of prefill
            eventually(
                lambda: sample(url, "kvroute_instance_in_flight") == 1, what="the long prompt was sent"
            )
            batch = threading.Thread(target=send, args=("batch", completion([6] * 100), {OBJECTIVE: "batch"}))
            batch.start()
            eventually(lambda: queued("batch") == 1, what="the batch request queued")
            interactive = threading.Thread(
                target=send, args=("interactive", completion([7] * 100), {OBJECTIVE: "interactive"})
            )
            interactive.start()
            refused = post(endpoint, completion([8] * 100), {OBJECTIVE: "batch"})
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as leaver:
                body = completion([9] * 100)
                leaver.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                eventually(lambda: queued("default") == 1, what="the leaver queued")
            eventually(lambda: queued("default") == 0, what="the leaver left the queue")
            assert long.is_alive() and batch.is_alive() and interactive.is_alive()  # still prefilling
            for thread in (long, batch, interactive):
                thread.join(30)

            status, headers, body = refused
            assert status == 429 and headers["retry-after"] == "30", headers
            assert headers["x-kvroute-dropped-reason"] == "queue_full"
            assert json.loads(body)["error"]["code"] == "queue_full"
            assert answers["long"][1]["x-kvroute-queued-ms"] == "0.0"  # nobody waited: it went at once
            assert answers["interactive"][0] == answers["batch"][0] == 200
            assert answers["interactive"][3] < answers["batch"][3]  # the higher band left first
            queued_ms = {name: float(answer[1]["x-kvroute-queued-ms"]) for name, answer in answers.items()}
            assert queued_ms["interactive"] > 500 and queued_ms["batch"] > queued_ms["interactive"]
            assert (
                metric(url, "kvroute_flow_control_refused_total", objective="batch", reason="queue_full") == 1
            )
            assert metric(url, "kvroute_flow_control_enqueued_total") == 3
            assert metric(url, "kvroute_flow_control_dispatched_total", how="queued") == 2
            # Nothing leaked: with the fleet idle, the next request goes at once.
            status, headers, _ = post(endpoint, completion([10] * 50))
            assert status == 200 and headers["x-kvroute-queued-ms"] == "0.0"


def test_a_request_past_its_queue_time_is_refused_in_the_route_shape(tmp_path: Path) -> None:
    """Anthropic's Messages route gets its own error shape for flow control's 429."""
    ports = FleetPorts.allocate(1)
    with running_fleet(ports, tmp_path, ["--prefill-tps", "1000"]):
        flow_control = {"engine_queue_s": 0.0, "objectives": {"default": {"max_queue_s": 0.5}}}
        with running_router(ports.router_config(flow_control=flow_control), tmp_path) as url:
            body = completion([5] * 3000, stream=True)
            long = threading.Thread(target=post, args=(url + "/v1/completions", body))
            long.start()  # about 3 s of prefill
            eventually(
                lambda: sample(url, "kvroute_instance_in_flight") == 1, what="the long prompt was sent"
            )
            messages = {
                "model": "tiny-llama",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "hi"}],
            }
            status, headers, body = post(url + "/v1/messages", json.dumps(messages).encode())
            long.join(30)
            assert status == 429 and headers["x-kvroute-dropped-reason"] == "queue_timeout"
            assert json.loads(body) == {
                "type": "error",
                "error": {
                    "type": "rate_limit_error",
                    "message": "No instance had room within `default`'s queue time; retry later.",
                },
            }
            assert metric(url, "kvroute_flow_control_queue_seconds_count", objective="default") == 1
