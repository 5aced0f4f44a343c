"""Engines with internal data parallelism (vllm serve --data-parallel-size N behind one API server): each rank
has a KV cache of its own, so each is a routing target, read at its own event ports and addressed with the
X-data-parallel-rank header; against a simulated fleet whose instances run two ranks each."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvroute.processes import FleetPorts, running_fleet, running_router
from kvroute.workload import AgentWorkload
from router.apis.openai_body import DATA_PARALLEL_RANK_HEADER
from router.config import ConfigError, parse_config
from router.upstreams.instances import Upstreams
from router.upstreams.load_scraper import LoadScraper, parse_engine_load, parse_kv_capacity
from router.upstreams.settings import LoadConfig
from scorers.candidate import EngineLoad
from tests.conftest import instance_url, metric
from tests.router.upstreams.test_load_scraper import FakeEngine, exposition
from tests.support.http import post

BLOCK = 32
RANKS = 2
WORKLOAD = AgentWorkload(system_prompt_words=600, min_turn_words=80, max_turn_words=160, max_tokens=16)


def _config(**instance: object) -> dict[str, Any]:
    first = {
        "name": "big",
        "url": "http://127.0.0.1:8000",
        "events": "tcp://127.0.0.1:5557",
        "replay": "tcp://127.0.0.1:5600",
        **instance,
    }
    return {
        "models": [{"name": "m"}],
        "instances": [first, {"name": "small", "url": "http://127.0.0.1:8001"}],
    }


def test_each_rank_is_a_target_at_its_offset_ports_with_its_rank_header() -> None:
    config = parse_config(_config(data_parallel_size=3))
    assert [(i.name, i.events, i.replay, i.data_parallel_rank) for i in config.instances] == [
        ("big-dp0", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600", 0),
        ("big-dp1", "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5601", 1),
        ("big-dp2", "tcp://127.0.0.1:5559", "tcp://127.0.0.1:5602", 2),
        ("small", None, None, None),
    ]
    instances = Upstreams(config).instances
    assert {i.url for i in instances[:3]} == {"http://127.0.0.1:8000"}
    assert [i.headers.get(DATA_PARALLEL_RANK_HEADER) for i in instances] == ["0", "1", "2", None]
    assert parse_config(config.model_dump()) == config  # validating again changes nothing


@pytest.mark.parametrize(
    ("instance", "error"),
    [
        ({"data_parallel_size": 2, "data_parallel_rank": 1}, "not both"),
        ({"data_parallel_size": 2, "events": "ipc:///tmp/kv"}, "TCP ports only"),
        ({"data_parallel_size": 2, "replay": "tcp://127.0.0.1:65535"}, "past port 65535"),
        ({"data_parallel_size": 0}, "greater than or equal to 1"),
        ({"url": "http://127.0.0.1:8001"}, "used twice"),  # one engine listed twice, without ranks
        ({"name": "small-dp0", "data_parallel_size": 1}, None),
    ],
)
def test_rank_settings_that_cannot_work_are_refused(instance: dict[str, object], error: str | None) -> None:
    if error is None:
        parse_config(_config(**instance))
        return
    with pytest.raises(ConfigError, match=error):
        parse_config(_config(**instance))


def test_ranks_of_one_engine_listed_one_by_one_share_its_url() -> None:
    raw = _config()
    raw["instances"][1] = {"name": "big-1", "url": "http://127.0.0.1:8000", "data_parallel_rank": 1}
    raw["instances"][0]["data_parallel_rank"] = 0
    assert [i.data_parallel_rank for i in parse_config(raw).instances] == [0, 1]
    raw["instances"][1]["data_parallel_rank"] = 0
    with pytest.raises(ConfigError, match="used twice"):
        parse_config(raw)


def test_a_ranks_load_and_capacity_are_its_own_samples() -> None:
    body = exposition(("1", "2"), ("3", "4"), ("0.2", "0.6"))
    assert parse_engine_load(body, 0) == EngineLoad(1.0, 3.0, 0.2)
    assert parse_engine_load(body, 1) == EngineLoad(2.0, 4.0, 0.6)
    assert parse_engine_load(body, 2) is None  # a rank the server does not have: no load to route on
    assert parse_engine_load(body) == EngineLoad(3.0, 7.0, 0.4)
    labelled = body.replace(b'{engine="1",', b'{model_name="tiny-llama",engine="1",')  # label order is free
    assert parse_engine_load(labelled, 1) == EngineLoad(2.0, 4.0, 0.6)
    configs = b"".join(
        b'\nvllm:cache_config_info{block_size="16",engine="%d",num_gpu_blocks="%d"} 1.0' % (rank, blocks)
        for rank, blocks in ((0, 100), (1, 300), (11, 700))
    )
    assert [parse_kv_capacity(configs, rank) for rank in (0, 1, 11, None)] == [1600, 4800, 11200, 17600]


def test_the_ranks_of_one_engine_share_one_scrape_of_its_metrics_and_each_takes_its_own_load() -> None:
    async def main() -> tuple[list[EngineLoad | None], int]:
        engine = FakeEngine()
        engine.body = exposition(("1", "2"), ("3", "4"), ("0.2", "0.6"))
        async with engine.serving() as url, aiohttp.ClientSession() as session:
            raw = {
                "models": [{"name": "m"}],
                "instances": [{"name": "big", "url": url, "data_parallel_size": 2}],
            }
            fleet = Upstreams(parse_config(raw))
            await LoadScraper(fleet, session, LoadConfig(timeout_s=1.0)).scrape_all()
            return [i.load for i in fleet.instances], len(engine.headers)

    assert asyncio.run(main()) == ([EngineLoad(1.0, 3.0, 0.2), EngineLoad(2.0, 4.0, 0.6)], 1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetPorts, str]]:
    ports = FleetPorts.allocate(RANKS)  # room for two ranks' event and replay ports
    tmp = tmp_path_factory.mktemp("data-parallel")
    config = ports.router_config()
    config["instances"] = [{**config["instances"][0], "data_parallel_size": RANKS}]  # type: ignore[index]
    args = [
        "--instances",
        "1",
        "--data-parallel-size",
        str(RANKS),
        "--prefill-tps",
        "20000",
        "--decode-tps",
        "2000",
    ]
    one_instance = FleetPorts(ports.http, ports.events, ports.replay, 1)
    with (
        running_fleet(one_instance, tmp / "fleet", args),
        running_router(config, tmp / "router") as url,
    ):
        yield one_instance, url


def _rank_hits(ports: FleetPorts, rank: int) -> float:
    return metric(instance_url(ports, 0), "vllm:prefix_cache_hits_total", engine=str(rank))


def test_a_conversation_stays_on_the_rank_that_holds_it_and_the_prediction_is_what_that_rank_reused(
    stack: tuple[FleetPorts, str],
) -> None:
    ports, url = stack
    used = set()
    for session in range(4):
        messages = [{"role": "system", "content": f"Session {random.random()}: " + WORKLOAD.system_prompt()}]
        chosen = []
        for turn in range(3):
            messages.append({"role": "user", "content": WORKLOAD.user_message(session * 10 + turn, turn)})
            before = [_rank_hits(ports, rank) for rank in range(RANKS)]
            body = json.dumps(
                {
                    "model": "tiny-llama",
                    "messages": messages,
                    "max_tokens": WORKLOAD.max_tokens,
                    "temperature": 0,
                }
            ).encode()
            # The first turn is placed by round robin (an idle fleet's ranks tie), the rest by the default policy.
            placed = {"x-kvroute-policy": "round-robin"} if turn == 0 else {}
            status, headers, payload = post(url + "/v1/chat/completions", body, placed)
            assert status == 200, payload
            instance = headers["x-kvroute-instance"]
            rank = int(instance.removeprefix("fleet-0-dp"))
            reused = (_rank_hits(ports, rank) - before[rank]) / BLOCK
            assert int(headers["x-kvroute-cached-blocks"]) == reused, (session, turn, instance)
            if turn:
                assert reused > 0
            chosen.append(instance)
            messages.append(
                {"role": "assistant", "content": json.loads(payload)["choices"][0]["message"]["content"]}
            )
        assert chosen == [chosen[0]] * len(chosen)
        used.add(chosen[0])
    assert used == {"fleet-0-dp0", "fleet-0-dp1"}
    for rank in range(RANKS):
        assert metric(url, "kvroute_index_blocks", vllm_instance=f"fleet-0-dp{rank}", tier="gpu") > 0
