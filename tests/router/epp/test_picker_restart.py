"""A picker that dies behind Envoy (SIGKILL, as the OOM killer or a node does) and comes back on its port: the
answers already streaming go on to their end, and the requests sent meanwhile wait for it (issue 40, 11)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kvroute.bench.overhead.envoy import routing_filter
from kvroute.processes import FleetPorts, running_fleet
from tests.router.epp.conftest import (
    FAST_FLEET,
    Picker,
    envoy_config,
    fleet_endpoints,
    picker_config,
    picker_on,
    running_envoy,
    running_picker,
)
from tests.router.epp.test_through_envoy import INSTANCE, MODEL, client, wait_none_in_flight

STREAMS = 8
# Decode paced at 60 tokens a second: an answer of 300 tokens streams for 5 s, whatever the machine's speed,
# so each is still streaming when the picker dies just after the last one began.
SLOW_FLEET = ["--prefill-tps", "200000", "--decode-tps", "60"]
STREAM_TOKENS = 300


@pytest.fixture(scope="module")
def slow_fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(2)
    with running_fleet(ports, tmp_path_factory.mktemp("slow-fleet"), SLOW_FLEET):
        yield ports


def kill(picker: Picker) -> None:
    """SIGKILL the picker's process group (the one this test started): no shutdown, its streams break."""
    os.killpg(picker.child.process.pid, signal.SIGKILL)
    picker.child.process.wait(10)


def read_to_end(stream: Iterator[object]) -> str:
    """How a stream ended: its finish reason, or `cut` when it broke first."""
    finish = "cut"
    try:
        for chunk in stream:
            choices = getattr(chunk, "choices", None)
            if choices and choices[0].finish_reason:
                finish = str(choices[0].finish_reason)
    except (openai.APIError, OSError):
        return "cut"
    return finish


def test_answers_streaming_when_the_picker_dies_go_on_to_their_end(
    slow_fleet: FleetPorts, tmp_path: Path
) -> None:
    with running_picker(picker_config([slow_fleet]), tmp_path) as picker:
        envoy, listen, admin = envoy_config(fleet_endpoints([slow_fleet]), picker.port)
        with running_envoy(envoy, listen, admin, tmp_path) as gateway:
            streams = []
            for number in range(STREAMS):
                stream = iter(
                    client(gateway).chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"Tell story number {number}."}],
                        max_tokens=STREAM_TOKENS,
                        stream=True,
                    )
                )
                next(stream)  # streaming: routed, answered, its first chunk here
                streams.append(stream)
            kill(picker)
            ends = [read_to_end(stream) for stream in streams]
    assert ends == ["length"] * STREAMS


def test_requests_sent_while_the_picker_restarts_wait_for_it(fleet_only: FleetPorts, tmp_path: Path) -> None:
    with running_picker(picker_config([fleet_only]), tmp_path) as picker:
        envoy, listen, admin = envoy_config(fleet_endpoints([fleet_only]), picker.port)
        # The shipped retries wait about 10 s for the picker, longer than it takes to start here (3-5 s);
        # more of them cover a slower machine's start.
        retries = routing_filter(envoy)["grpc_service"].get("retry_policy")
        if retries is not None:
            retries["num_retries"] = 120
        with running_envoy(envoy, listen, admin, tmp_path) as gateway:
            kill(picker)
            stop = threading.Event()
            back_at: list[float] = []
            with ThreadPoolExecutor(2) as pool:
                senders = [pool.submit(keep_asking, client(gateway), n, stop, back_at) for n in range(2)]
                try:
                    restart = tmp_path / "restart"
                    with picker_on(picker.port, picker.config_path, restart, name="epp-again") as again:
                        back_at.append(time.monotonic())
                        outcomes = [sender.result(timeout=120) for sender in senders]
                        served = client(gateway).chat.completions.with_raw_response.create(
                            model=MODEL, messages=[{"role": "user", "content": "And now?"}], max_tokens=2
                        )
                        wait_none_in_flight(again)
                finally:
                    stop.set()
    asked = [outcome for sender in outcomes for outcome in sender]
    failed = [outcome for outcome in asked if outcome[1] != "ok"]
    assert not failed, failed
    assert any(started < back_at[0] for started, _ in asked)  # some were sent while no picker ran
    assert served.headers[INSTANCE].startswith("fleet-")  # the new picker routes and answers the headers


def keep_asking(
    gateway_client: openai.OpenAI, number: int, stop: threading.Event, back_at: list[float]
) -> list[tuple[float, str]]:
    """Ask again and again until two answers came after the picker was back (or stop): (when each request
    was sent, ok or the error)."""
    outcomes: list[tuple[float, str]] = []
    after = 0
    while after < 2 and not stop.is_set():
        started = time.monotonic()
        try:
            gateway_client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Hi {number}."}], max_tokens=2
            )
            outcomes.append((started, "ok"))
        except openai.APIError as error:
            outcomes.append((started, repr(error)))
        after += bool(back_at) and started > back_at[0]
        time.sleep(0.05)
    return outcomes


@pytest.fixture(scope="module")
def fleet_only(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(2)
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), FAST_FLEET):
        yield ports
