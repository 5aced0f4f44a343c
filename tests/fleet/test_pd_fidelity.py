"""The simulated P/D fleet against real vLLM 0.32's prefill and decode legs with MooncakeConnector
(tests/fixtures/vllm/pd_capture.json, scripts/capture_vllm_pd.py).

One prefill and one decode instance, named and reached as the captured ones (vllm-0 and its bootstrap
server, vllm-1), are sent every captured leg's body as it was sent, in order. Output text differs (random
weights vs our sampler); the layout of every answer, its usage, and how each instance's prompt-token counters
moved must not. Real vLLM's prefiller gave up on a transfer nobody prefilled after its
VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, and the decoder then computed the prompt; the fleet, given the same
variable scaled down, must wait and answer alike.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.kv_transfer import ABORT_TIMEOUT_ENV
from kvroute.processes import FleetPorts, running_fleet
from tests.fleet.layout import key_paths, sse_chunks

CAPTURE = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "pd_capture.json").read_text()
)
RECORDS = {r["name"]: r for r in CAPTURE["requests"]}
ABORT_S = 2.0  # the fleet's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT: the capture's prefiller's, scaled down
SCALE = ABORT_S / CAPTURE["abort_timeout_s"]
# The counters the fleet keeps, summed over engines; the source or finished reason in braces. Not {abort}:
# vLLM 0.32 does not count a request whose client left (unknown_transfer.bounded); the fleet does.
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_by_source_total{local_compute}",
    "vllm:prompt_tokens_by_source_total{local_cache_hit}",
    "vllm:prompt_tokens_by_source_total{external_kv_transfer}",
    "vllm:request_success_total{length}",
)


@dataclass
class Replayed:
    status: int | None  # None: no answer within the (scaled) time the capture waited
    content_type: str
    text: str
    seconds: float
    increase: dict[str, dict[str, float]]  # by instance name


def fleet_args() -> list[str]:
    prefill = CAPTURE["instances"][0]
    assert (prefill["name"], prefill["role"]) == ("vllm-0", "prefill")
    return [
        "--name-prefix",
        "vllm-",
        "--roles",
        "prefill,decode",
        "--kv-connector",
        "mooncake",
        "--bootstrap-port",
        prefill["env"]["VLLM_MOONCAKE_BOOTSTRAP_PORT"],
        "--block-size",
        "32",
        "--max-model-len",
        "4096",
        "--prefill-tps",
        "1000000",
        "--decode-tps",
        "5000",
    ]


def post(url: str, body: Any, timeout_s: float) -> tuple[int | None, str, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.headers["content-type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["content-type"], error.read().decode()
    except TimeoutError:
        return None, "", ""


def counters(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        families = text_string_to_metric_families(response.read().decode())
    found: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            label = sample.labels.get("source") or sample.labels.get("finished_reason")
            key = f"{sample.name}{{{label}}}" if label else sample.name
            if key in COUNTERS:
                found[key] = found.get(key, 0.0) + sample.value
    return found


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Replayed]]:
    ports = FleetPorts.allocate(2)
    bases = {f"vllm-{i}": f"http://127.0.0.1:{ports.http + i}" for i in range(2)}
    answers: dict[str, Replayed] = {}
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(ABORT_TIMEOUT_ENV, str(ABORT_S))  # the fleet's process takes it as it starts
            stack.enter_context(running_fleet(ports, tmp_path_factory.mktemp("pd-fidelity"), fleet_args()))
        for name, record in RECORDS.items():
            before = {instance: counters(base) for instance, base in bases.items()}
            timeout_s = record["seconds"] * SCALE if record.get("timed_out") else 60.0
            started = time.monotonic()
            status, content_type, text = post(
                bases[record["instance"]] + record["path"], record["request"], timeout_s
            )
            seconds = time.monotonic() - started
            after = {instance: counters(base) for instance, base in bases.items()}
            increase = {i: {k: after[i][k] - before[i][k] for k in COUNTERS} for i in bases}
            answers[name] = Replayed(status, content_type, text, seconds, increase)
        yield answers


def test_the_capture_disaggregates_every_leg_as_kvroute_sends_it() -> None:
    legs = [
        (r["name"].rsplit(".", 1)[-1], r["request"].get("kv_transfer_params")) for r in CAPTURE["requests"]
    ]
    prefill_legs = [params for leg, params in legs if leg == "prefill"]
    assert len(prefill_legs) == 5
    assert all(set(p) == {"do_remote_decode", "do_remote_prefill", "transfer_id"} for p in prefill_legs)
    for record in CAPTURE["requests"]:
        params = record["request"]["kv_transfer_params"]
        assert record["request"]["max_tokens"] == (1 if record["leg"] == "prefill" else 8)
        if record["leg"] == "decode":
            assert params["remote_engine_id"] == "vllm-0" and params["remote_bootstrap_addr"].startswith(
                "http://"
            )


@pytest.mark.parametrize("name", RECORDS)
def test_every_leg_answers_with_vllms_status_and_content_type(
    replayed: dict[str, Replayed], name: str
) -> None:
    record, ours = RECORDS[name], replayed[name]
    assert ours.status == record["status"]
    assert ours.content_type.split(";")[0] == record.get("content_type", "").split(";")[0]


@pytest.mark.parametrize("name", [name for name, record in RECORDS.items() if "response" in record])
def test_whole_answers_have_vllms_layout_usage_and_transfer_params(
    replayed: dict[str, Replayed], name: str
) -> None:
    real, ours = RECORDS[name]["response"], json.loads(replayed[name].text)
    assert key_paths(ours) == key_paths(real)
    # Both legs count the whole prompt; the prefill leg's one token; no prompt_tokens_details (vLLM's
    # --enable-prompt-tokens-details is off); kv_transfer_params null, the MooncakeConnector prefill's too.
    assert ours["usage"] == real["usage"]
    assert ours["kv_transfer_params"] is real["kv_transfer_params"] is None
    if RECORDS[name]["leg"] == "prefill":
        assert ours["usage"]["completion_tokens"] == 1 and ours["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("name", [name for name, record in RECORDS.items() if "sse" in record])
def test_streamed_decode_legs_have_vllms_chunks(replayed: dict[str, Replayed], name: str) -> None:
    real, ours = sse_chunks(RECORDS[name]["sse"]), sse_chunks(replayed[name].text)
    assert [key_paths(chunk) for chunk in ours] == [key_paths(chunk) for chunk in real]
    assert ours[-1]["usage"] == real[-1]["usage"]
    assert replayed[name].text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("name", RECORDS)
def test_counters_move_as_real_vllms(replayed: dict[str, Replayed], name: str) -> None:
    """The decoder: external_kv_transfer += the prompt, local_compute += 0, external hits += the prompt; the
    prefiller: local_compute += the prompt, and its connector queried about it (no hits)."""
    real = RECORDS[name]["increase"]
    for instance, ours in replayed[name].increase.items():
        assert ours == {key: real[instance].get(key, 0.0) for key in COUNTERS}, instance


def test_a_decode_leg_naming_a_transfer_nobody_prefilled_waits_for_the_abort_timeout_then_computes(
    replayed: dict[str, Replayed],
) -> None:
    bounded, waited = RECORDS["unknown_transfer.bounded"], RECORDS["unknown_transfer.waited"]
    assert bounded["timed_out"] and bounded["seconds"] < CAPTURE["abort_timeout_s"]
    assert waited["status"] == 200 and abs(waited["seconds"] - CAPTURE["abort_timeout_s"]) < 5
    assert replayed["unknown_transfer.bounded"].status is None
    assert ABORT_S <= replayed["unknown_transfer.waited"].seconds < ABORT_S + 5
    decoder = replayed["unknown_transfer.waited"].increase["vllm-1"]
    assert (
        decoder["vllm:prompt_tokens_by_source_total{local_compute}"]
        == waited["response"]["usage"]["prompt_tokens"]
    )
