"""`kvroute stack up` with router.replicas: a redis-server, the replicas sharing state through it, and nginx's
round robin in front of them on the router's port, all in state.json for `kvroute stack down` (the engines
here are the simulated fleet on the plan's ports, so that no vLLM need start)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kvroute.processes import FleetPorts, free_port_block, running_fleet
from kvroute.stack.config import parse_stack_config
from kvroute.stack.run import Stack, StackPlan, stack_status
from router.dispatch.observe.routing_headers import INSTANCE_HEADER
from tests.conftest import metric
from tests.kvroute.stack.test_config import cpu_raw
from tests.support.http import post
from tests.support.waiting import eventually

REPLICAS = 3


def test_stack_replicas_share_a_store_behind_one_balancer_and_stop_with_the_stack(
    tmp_path: Path, model_dir: Path
) -> None:
    raw = cpu_raw()
    del raw["pool"]
    raw["router"]["replicas"] = REPLICAS
    config = parse_stack_config(raw)
    config = config.with_ports(free_port_block(config.port_count()))
    plan = StackPlan(config, tmp_path / "run", base_dir=tmp_path)
    http, count = config.vllm.http_port, config.vllm.instances
    fleet = FleetPorts(http, config.vllm.event_port, config.vllm.replay_port, count)
    with running_fleet(fleet, tmp_path):
        plan.write_files()
        shared = yaml.safe_load(plan.router_yaml.read_text())["shared"]
        assert shared == {"url": f"redis://127.0.0.1:{plan.store_port}/0"}
        stack = Stack(plan)
        try:
            stack._start_routers()
            replicas = [f"http://127.0.0.1:{port}" for port in plan.replica_ports]
            for url in replicas:
                eventually(lambda url=url: metric(url, "kvroute_peer_routers") == REPLICAS - 1, what="peers")
            body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for _ in range(REPLICAS):
                status, headers, _ = post(plan.router_url + "/v1/chat/completions", json.dumps(body).encode())
                assert status == 200 and headers[INSTANCE_HEADER].startswith("vllm-")
            served = sum(metric(url, "kvroute_requests_total") for url in replicas)
            assert served == REPLICAS and all(metric(url, "kvroute_requests_total") for url in replicas)
            stack.write_state()
            names = [name for name, alive, healthy in stack_status(plan.run_dir) if alive and healthy]
            assert names == ["shared-store", *(f"router-{n}" for n in range(REPLICAS)), "balancer"]
        finally:
            stack.stop()  # what `kvroute stack down` stops, by state.json, from another process
        assert stack_status(plan.run_dir) == []
