"""The endpoint picker waits as `kvroute serve` does: a request no instance has KV memory for is held in the
picker (the conductor's waiting stage), not sent to an engine that would queue it, and goes once memory frees."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

from kvroute.processes import FleetPorts, running_fleet
from tests.conftest import metric, sample
from tests.router.epp.conftest import (
    envoy_config,
    fleet_endpoints,
    picker_config,
    running_envoy,
    running_picker,
)

HOLD = "kvroute_memory_hold_seconds"


def _post(url: str, body: dict[str, object]) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return bytes(answer.read())


def test_the_picker_holds_a_prompt_until_the_one_filling_memory_ends(tmp_path: Path) -> None:
    """One instance of 16 blocks of 32 tokens (512): while a 300-token stream is in flight, a second
    300-token prompt sharing none of its blocks waits in the picker until the stream ends."""
    ports = FleetPorts.allocate(1)
    with running_fleet(ports, tmp_path / "fleet", ["--kv-blocks", "16", "--decode-tps", "20"]):
        config = picker_config([ports], admission={"memory_hold_s": 30})
        with running_picker(config, tmp_path / "epp") as picker:
            envoy, listen, admin = envoy_config(fleet_endpoints([ports]), picker.port)
            with running_envoy(envoy, listen, admin, tmp_path / "envoy") as gateway:
                url = gateway.url + "/completions"
                stream = {"model": "tiny-llama", "prompt": [5] * 300, "max_tokens": 30, "stream": True}
                second = {**stream, "prompt": [6] * 300, "stream": False, "max_tokens": 1}
                # The picker learns the instance's KV capacity from its first scrapes of /metrics: until
                # then nothing is held (the engine queues the second request itself). Try again, boundedly.
                deadline = time.monotonic() + 30
                while True:
                    request = urllib.request.Request(
                        url, json.dumps(stream).encode(), {"content-type": "application/json"}
                    )
                    with urllib.request.urlopen(request, timeout=60) as streaming:
                        streaming.readline()  # the stream has started: its context is in flight
                        sent = threading.Thread(target=_post, args=(url, second))
                        sent.start()
                        time.sleep(0.5)
                        waiting = sent.is_alive()
                        streaming.read()
                    sent.join(timeout=30)
                    assert not sent.is_alive()
                    if sample(picker.metrics_url, f"{HOLD}_count", model="tiny-llama"):
                        break  # held in the picker, until the stream ended
                    assert time.monotonic() < deadline, "the picker never held a request"
                    time.sleep(0.5)
                assert waiting
                assert metric(picker.metrics_url, f"{HOLD}_sum", model="tiny-llama") > 0.3
