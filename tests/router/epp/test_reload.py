"""`kvroute epp` follows its configuration file as `kvroute serve` does (issue 40, 4): an edited file is read
again, SIGHUP reads it again rather than ending the picker, and what the picker learnt (its index) stays."""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvroute.processes import FleetPorts, running_fleet
from tests.conftest import sample
from tests.router.epp.conftest import FAST_FLEET, Picker, picker_config, running_picker
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def two(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(2)
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), FAST_FLEET):
        yield ports


def healthy(picker: Picker) -> set[str]:
    with urllib.request.urlopen(picker.metrics_url + "/health", timeout=5) as response:
        return set(json.loads(response.read())["healthy_instances"])


def reloads(picker: Picker) -> float:
    return sample(picker.metrics_url, "kvroute_config_reloads_total", result="ok") or 0


def blocks(picker: Picker, instance: str) -> float:
    return sample(picker.metrics_url, "kvroute_index_blocks", vllm_instance=instance, tier="gpu") or 0


def cache_a_prompt(fleet: FleetPorts, instance: int) -> None:
    """A request straight to one engine, which caches its prompt and tells the picker's index so."""
    body = {"model": "tiny-llama", "prompt": "A long shared system prompt. " * 40, "max_tokens": 1}
    url = f"http://127.0.0.1:{fleet.http + instance}/v1/completions"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def test_an_edited_file_is_followed_and_the_index_stays(two: FleetPorts, tmp_path: Path) -> None:
    config = picker_config([two])
    with running_picker(config, tmp_path) as picker:
        eventually(lambda: healthy(picker) == {"fleet-0", "fleet-1"}, what="both healthy")
        cache_a_prompt(two, 0)
        eventually(lambda: blocks(picker, "fleet-0") > 0, what="indexed")
        learnt = blocks(picker, "fleet-0")

        instances = config["instances"]
        assert isinstance(instances, list)
        picker.config_path.write_text(yaml.safe_dump({**config, "instances": instances[:1]}, sort_keys=False))
        eventually(lambda: healthy(picker) == {"fleet-0"}, what="reloaded without fleet-1")
        assert blocks(picker, "fleet-0") == learnt  # kept, as a reload keeps it in `kvroute serve`


def test_sighup_reads_the_file_again_and_ends_nothing(two: FleetPorts, tmp_path: Path) -> None:
    with running_picker(picker_config([two]), tmp_path) as picker:  # up: SIGHUP is the reloader's
        cache_a_prompt(two, 1)
        eventually(lambda: blocks(picker, "fleet-1") > 0, what="indexed")
        learnt = blocks(picker, "fleet-1")
        hang_up(picker)
        eventually(lambda: reloads(picker) == 1, what="reloaded")
        hang_up(picker)
        eventually(lambda: reloads(picker) == 2, what="reloaded again")
        assert picker.child.process.poll() is None
        assert blocks(picker, "fleet-1") == learnt


def hang_up(picker: Picker) -> None:
    picker.child.process.send_signal(signal.SIGHUP)  # the picker process this test started, by its PID
