"""`kvroute fleet & kvroute serve --config configs/local-fleet.yaml` works with no other step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.processes import free_port_block, port_free, start, wait_healthy
from router.config import load_config
from tests.support.http import post

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-fleet.yaml"


def test_default_fleet_and_shipped_config_work_together(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    ports = [int(i.url.rsplit(":", 1)[1]) for i in config.instances]
    ports += [int(e.rsplit(":", 1)[1]) for i in config.instances for e in (i.events, i.replay) if e]
    if not all(port_free(port) for port in ports):
        pytest.skip("the default fleet ports are in use on this machine")
    fleet = start("fleet", ["fleet"], tmp_path)
    router_port = free_port_block(1)
    router = start("router", ["serve", "--config", str(CONFIG), "--port", str(router_port)], tmp_path)
    try:
        wait_healthy(fleet, [f"{i.url}/health" for i in config.instances])
        base = f"http://127.0.0.1:{router_port}"
        wait_healthy(router, [base + "/metrics"])
        body = json.dumps(
            {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        )
        seen = set()
        for _ in range(6):
            status, headers, payload = post(
                base + "/v1/chat/completions", body.encode(), {"x-kvroute-policy": "round-robin"}
            )
            assert status == 200, payload
            seen.add(headers["x-kvroute-instance"])
        assert seen == {"fleet-0", "fleet-1", "fleet-2"}
    finally:
        router.stop()
        fleet.stop()
