"""The stack configuration and the commands, files and router configuration derived from it (nothing started)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.processes import StartupError
from kvroute.stack import StackPlan
from kvroute.stack_config import StackConfigError, load_stack_config, parse_stack_config
from router.config import parse_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def cpu_raw() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load((CONFIGS / "stack-cpu.yaml").read_text())
    return raw


@pytest.mark.parametrize("name", ["stack-cpu.yaml", "stack-gpu.yaml"])
def test_shipped_configs_load(name: str) -> None:
    load_stack_config(CONFIGS / name)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(extra=1), "extra: Extra inputs are not permitted"),
        (lambda r: r["vllm"].update(instances=0), "vllm.instances"),
        (
            lambda r: r["vllm"].update(args=["--port", "1"]),
            "vllm.args: --port is set by the stack",
        ),
        (lambda r: r["vllm"].update(args=["--block-size=16"]), "--block-size=16 is set by the stack"),
        (lambda r: r["vllm"]["kv_events"].update(bind_host="127.0.0.1"), "would make vLLM connect"),
        (lambda r: r["vllm"].update(start="eventually"), "vllm.start"),
        (lambda r: r["router"].update(port=8312), "vllm.http_port + 1: port 8312 is also router.port"),
        (lambda r: r["pool"]["master"].update(rpc_port=70000), "pool.master.rpc_port"),
        (lambda r: r["pool"]["client"].update(protocol="udp"), "pool.client.protocol"),
        (lambda r: r["vllm"]["env"].pop("PYTHONHASHSEED"), "PYTHONHASHSEED must be fixed"),
    ],
)
def test_invalid_configs_name_the_key(change: Any, message: str) -> None:
    raw = cpu_raw()
    change(raw)
    with pytest.raises(StackConfigError, match="stack config: invalid") as error:
        parse_stack_config(raw)
    assert message in str(error.value)


def test_without_a_pool_no_connector_and_no_hash_seed_needed(tmp_path: Path) -> None:
    raw = cpu_raw()
    del raw["pool"]
    raw["vllm"]["env"].pop("PYTHONHASHSEED")
    plan = StackPlan(parse_stack_config(raw), tmp_path, base_dir=tmp_path)
    assert "--kv-transfer-config" not in plan.vllm_argv(0)
    assert "MOONCAKE_CONFIG_PATH" not in plan.vllm_env()
    assert plan.master_url is None


def test_plan_derives_commands_files_and_router_config(tmp_path: Path, model_dir: Path) -> None:
    config = load_stack_config(CONFIGS / "stack-cpu.yaml").with_ports(40000)
    plan = StackPlan(config, tmp_path / "run", base_dir=tmp_path)
    assert plan.python == tmp_path / ".venv-stack" / "bin" / "python"
    assert plan.model_dir == model_dir.resolve() and plan.pool_model_name == "tiny-llama"
    assert [(i.name, i.url, i.events, i.replay, i.topic) for i in plan.instances] == [
        (
            "vllm-0",
            "http://127.0.0.1:40003",
            "tcp://127.0.0.1:40005",
            "tcp://127.0.0.1:40007",
            "",
        ),
        (
            "vllm-1",
            "http://127.0.0.1:40004",
            "tcp://127.0.0.1:40006",
            "tcp://127.0.0.1:40008",
            "",
        ),
    ]
    argv = plan.vllm_argv(1)
    flag = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flag["--model"] == str(plan.model_dir) and flag["--served-model-name"] == "tiny-llama"
    assert (flag["--host"], flag["--port"], flag["--block-size"]) == ("127.0.0.1", "40004", "32")
    assert json.loads(flag["--kv-events-config"]) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://[::ffff:127.0.0.1]:40006",
        "replay_endpoint": "tcp://127.0.0.1:40008", "topic": "",
    }  # fmt: skip
    assert json.loads(flag["--kv-transfer-config"]) == {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": 40004},
    }  # fmt: skip
    env = plan.vllm_env()
    assert env["PYTHONHASHSEED"] == "0" and env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] == "0"
    assert env["MOONCAKE_CONFIG_PATH"] == str(plan.mooncake_json)
    assert "--rpc_port=40001" in plan.master_argv() and "--metrics_host=127.0.0.1" in plan.master_argv()

    plan.write_files()
    mooncake = json.loads(plan.mooncake_json.read_text())
    assert mooncake["master_server_address"] == "127.0.0.1:40001" and mooncake["protocol"] == "tcp"
    router = parse_config(yaml.safe_load(plan.router_yaml.read_text()))
    assert router.block_size == 32 and router.models[0].tokenizer == str(plan.model_dir)
    assert router.models[0].pool_name == "tiny-llama" and router.pool.master_url == "http://127.0.0.1:40002"
    assert [(i.name, i.url, i.events, i.replay) for i in router.instances] == [
        (i.name, i.url, i.events, i.replay) for i in plan.instances
    ]


def test_a_templated_event_topic_is_filled_per_instance(tmp_path: Path, model_dir: Path) -> None:
    raw = cpu_raw()
    raw["vllm"]["kv_events"]["topic"] = "kv@{instance}@{model}"  # llm-d's convention
    plan = StackPlan(parse_stack_config(raw), tmp_path / "run", base_dir=tmp_path)
    assert [i.topic for i in plan.instances] == ["kv@vllm-0@tiny-llama", "kv@vllm-1@tiny-llama"]
    argv = plan.vllm_argv(1)
    assert json.loads(argv[argv.index("--kv-events-config") + 1])["topic"] == "kv@vllm-1@tiny-llama"


def test_the_connectors_cache_prefix_reaches_the_router_config(tmp_path: Path, model_dir: Path) -> None:
    raw = cpu_raw()
    raw["pool"]["connector"] = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {"cache_prefix": "team-a"}}  # fmt: skip
    plan = StackPlan(parse_stack_config(raw), tmp_path / "run", base_dir=tmp_path)
    router = parse_config(plan.router_config())
    assert (router.models[0].pool_name, router.models[0].pool_cache_prefix) == ("tiny-llama", "team-a")


def test_a_missing_stack_python_is_named(tmp_path: Path) -> None:
    plan = StackPlan(load_stack_config(CONFIGS / "stack-cpu.yaml"), tmp_path, base_dir=tmp_path)
    with pytest.raises(StartupError, match="make stack-env"):
        plan.check_ready_to_start()
