"""`kvroute serve --worker-urls`: no configuration file, what the instances say of themselves instead."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvroute.processes import FleetPorts, free_port_block, running_fleet, start, wait_healthy
from kvroute.worker_urls import WorkersUnreadable, config_from_workers
from tinymodel import builder

BLOCK = 32  # the fleet's default block size, which the router must find in its /metrics


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(2)
    args = ["--enable-prompt-tokens-details", "--decode-tps", "5000"]
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), args):
        yield ports


def _urls(fleet: FleetPorts) -> list[str]:
    return [f"http://127.0.0.1:{fleet.http + i}" for i in range(fleet.count)]


def test_the_instances_describe_the_configuration(fleet: FleetPorts) -> None:
    events = [f"tcp://127.0.0.1:{fleet.events + i}" for i in range(fleet.count)]
    config = config_from_workers(_urls(fleet), events)
    # The served model, its tokenizer the model's own directory (here), the engines' block size.
    assert config["models"] == [{"name": "tiny-llama", "tokenizer": str(builder.ensure_model())}]
    assert config["block_size"] == BLOCK
    assert [(i["url"], i["events"], i["models"]) for i in config["instances"]] == [
        (url, event, ["tiny-llama"]) for url, event in zip(_urls(fleet), events, strict=True)
    ]
    assert [i["name"] for i in config["instances"]] == [f"127.0.0.1-{fleet.http + i}" for i in range(2)]


def test_what_cannot_be_read_is_said(fleet: FleetPorts) -> None:
    with pytest.raises(WorkersUnreadable, match="one --kv-events"):
        config_from_workers(_urls(fleet), ["tcp://127.0.0.1:1"])
    with pytest.raises(WorkersUnreadable, match="no answer"):
        config_from_workers([f"http://127.0.0.1:{free_port_block(1)}"], wait_s=0.5)


def test_serve_from_the_instances_alone_predicts_the_engines_hits(fleet: FleetPorts, tmp_path: Path) -> None:
    port = free_port_block(1)
    events = [f"tcp://127.0.0.1:{fleet.events + i}" for i in range(fleet.count)]
    replays = [f"tcp://127.0.0.1:{fleet.replay + i}" for i in range(fleet.count)]
    args = ["serve", "--port", str(port), "--worker-urls", *_urls(fleet), "--kv-events", *events]
    router = start("router", [*args, "--kv-replay", *replays], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(router, [url + "/metrics"])
        printed = router.log_path.read_text()
        config = yaml.safe_load(printed[printed.index("models:") :].split("\n\n")[0])
        assert config["block_size"] == BLOCK  # the configuration made is printed, to keep
        body = {
            "model": "tiny-llama",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Review this patch to the parser. " * 30}],
        }
        answers = []
        for _ in range(2):
            request = urllib.request.Request(
                url + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                answers.append((dict(answer.headers), json.loads(answer.read())))
            time.sleep(0.3)  # the engine's KV events reach the index
        headers, second = answers[1]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and int(headers["x-kvroute-cached-blocks"]) * BLOCK == cached
    finally:
        router.stop()
