"""The stack configuration and the commands, files and router configuration derived from it (nothing started)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.processes import StartupError
from kvroute.stack.config import StackConfigError, load_stack_config, parse_stack_config
from kvroute.stack.run import StackPlan
from router.config import parse_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def cpu_raw(name: str = "stack-cpu.yaml") -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load((CONFIGS / name).read_text())
    return raw


def pd_raw() -> dict[str, Any]:
    return cpu_raw("stack-pd-cpu.yaml")


SHIPPED = ["stack-cpu.yaml", "stack-gpu.yaml", "stack-pd-cpu.yaml", "stack-pd-gpu.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
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
        (lambda r: r["vllm"].update(per_instance=[{}]), "vllm.per_instance: 1 entries for 2 instances"),
        (
            lambda r: r["vllm"].update(per_instance=[{}, {"args": ["--port=1"]}]),
            "vllm.per_instance.1.args: --port=1 is set by the stack",
        ),
        (
            lambda r: r["vllm"].update(per_instance=[{"role": "prefill"}, {}]),
            "vllm.per_instance.0.role: prefill needs a disaggregation section",
        ),
        (lambda r: r["vllm"].update(per_instance=[{"role": "leader"}, {}]), "vllm.per_instance.0.role"),
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
    assert "MOONCAKE_CONFIG_PATH" not in plan.vllm_env(0)
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
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://[::ffff:127.0.0.1]:40006",
        "replay_endpoint": "tcp://127.0.0.1:40008",
        "topic": "",
    }
    assert json.loads(flag["--kv-transfer-config"]) == {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": 40004},
    }
    env = plan.vllm_env(1)
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
    raw["pool"]["connector"] = {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cache_prefix": "team-a"},
    }
    plan = StackPlan(parse_stack_config(raw), tmp_path / "run", base_dir=tmp_path)
    router = parse_config(plan.router_config())
    assert (router.models[0].pool_name, router.models[0].pool_cache_prefix) == ("tiny-llama", "team-a")


def test_a_missing_stack_python_is_named(tmp_path: Path) -> None:
    plan = StackPlan(load_stack_config(CONFIGS / "stack-cpu.yaml"), tmp_path, base_dir=tmp_path)
    with pytest.raises(StartupError, match="make stack-env"):
        plan.check_ready_to_start()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["disaggregation"].update(connector="p2p"), "disaggregation.connector"),
        (
            lambda r: r["disaggregation"]["transfer"].update(kv_role="kv_both"),
            "disaggregation.transfer: kv_role is set by the stack",
        ),
        (
            lambda r: r["disaggregation"]["transfer"].pop("kv_connector"),
            "disaggregation.transfer: kv_connector is missing",
        ),
        (
            lambda r: r["vllm"]["env"].update(VLLM_MOONCAKE_BOOTSTRAP_PORT="8998"),
            "vllm.env: VLLM_MOONCAKE_BOOTSTRAP_PORT is set by the stack",
        ),
        (
            lambda r: r["vllm"]["per_instance"][2].update(env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "1"}),
            "vllm.per_instance.2.env: VLLM_MOONCAKE_BOOTSTRAP_PORT",
        ),
        (
            lambda r: r["disaggregation"].update(side_channel_port=8412),
            "disaggregation.side_channel_port: port 8412 is also vllm.http_port + 1",
        ),
    ],
)
def test_invalid_disaggregation_names_the_key(change: Any, message: str) -> None:
    raw = pd_raw()
    change(raw)
    with pytest.raises(StackConfigError, match="stack config: invalid") as error:
        parse_stack_config(raw)
    assert message in str(error.value)


def flags(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


def test_a_disaggregated_plan_gives_each_instance_its_role_connector_and_bootstrap_port(
    tmp_path: Path, model_dir: Path
) -> None:
    config = load_stack_config(CONFIGS / "stack-pd-cpu.yaml").with_ports(40000)
    assert config.port_count() == 15 and sorted(config.ports().values()) == list(range(40000, 40015))
    plan = StackPlan(config, tmp_path / "run", base_dir=tmp_path)
    assert [(i.name, i.role) for i in plan.instances] == [
        ("vllm-0", "prefill"),
        ("vllm-1", "prefill"),
        ("vllm-2", "decode"),
    ]
    mooncake = {
        "kv_connector": "MooncakeConnector",
        "kv_connector_module_path": "kvconnectors.mooncake",
        "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 2},
    }
    pool = {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    for index, kv_role in enumerate(["kv_producer", "kv_producer", "kv_consumer"]):
        transfer = json.loads(flags(plan.vllm_argv(index))["--kv-transfer-config"])
        assert transfer == {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "engine_id": f"vllm-{index}",
            "kv_connector_extra_config": {
                "connectors": [
                    {**mooncake, "kv_role": kv_role},
                    {**pool, "kv_connector_extra_config": {"lookup_rpc_port": 40003 + index}},
                ]
            },
            # the scheduler reads it at the top only: a failed transfer is recomputed too, not a 500
            "kv_load_failure_policy": "recompute",
        }
        env = plan.vllm_env(index)
        assert env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == str(40012 + index)
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(plan.python_path_dir)

    plan.write_files()
    assert (plan.python_path_dir / "kvconnectors" / "mooncake.py").is_file()
    router = parse_config(yaml.safe_load(plan.router_yaml.read_text()))
    assert (
        router.disaggregation.connector == "mooncake"
        and router.disaggregation.local_prefill_max_tokens == 256
    )
    assert [(i.name, i.role, i.kv_engine_id, i.kv_bootstrap_url) for i in router.instances] == [
        ("vllm-0", "prefill", "vllm-0", "http://127.0.0.1:40012"),
        ("vllm-1", "prefill", "vllm-1", "http://127.0.0.1:40013"),
        ("vllm-2", "decode", "vllm-2", None),
    ]


def test_without_disaggregation_one_connector_and_no_roles(tmp_path: Path, model_dir: Path) -> None:
    raw = pd_raw()
    del raw["pool"]
    plan = StackPlan(parse_stack_config(raw), tmp_path / "run", base_dir=tmp_path)
    assert json.loads(flags(plan.vllm_argv(2))["--kv-transfer-config"]) == {
        "kv_connector": "MooncakeConnector",
        "kv_connector_module_path": "kvconnectors.mooncake",
        "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 2},
        "kv_role": "kv_consumer",
        "engine_id": "vllm-2",
    }
    router = parse_config(StackPlan(load_stack_config(CONFIGS / "stack-cpu.yaml"), tmp_path).router_config())
    assert {i.role for i in router.instances} == {"both"} and not router.disaggregated_models()


@pytest.mark.parametrize(
    ("name", "connector", "roles"),
    [
        ("stack-gpu.yaml", None, ["both", "both"]),
        ("stack-pd-gpu.yaml", "nixl", ["prefill", "prefill", "decode", "decode"]),
    ],
)
def test_gpu_configs_run_each_instance_on_its_own_device(
    tmp_path: Path, model_dir: Path, name: str, connector: str | None, roles: list[str]
) -> None:
    """Checked for shape only (no GPU, no such model here: the tiny one stands in for its tokenizer)."""
    config = load_stack_config(CONFIGS / name)
    config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(model_dir)})})
    plan = StackPlan(config, tmp_path / "run", base_dir=tmp_path)
    devices = [plan.vllm_env(i)["CUDA_VISIBLE_DEVICES"] for i in range(len(plan.instances))]
    assert len(set(devices)) == len(devices) == len(roles)
    ports = config.ports()
    assert len(set(ports.values())) == len(ports) == config.port_count()
    router = parse_config(plan.router_config())
    assert [i.role for i in router.instances] == [i.role for i in plan.instances] == roles
    for index, instance in enumerate(plan.instances):
        transfer = json.loads(flags(plan.vllm_argv(index))["--kv-transfer-config"])
        if connector is None:
            assert transfer["kv_connector"] == "MooncakeStoreConnector"
            continue
        assert (transfer["kv_connector"], transfer["engine_id"]) == ("MultiConnector", instance.name)
        p2p, pool = transfer["kv_connector_extra_config"]["connectors"]
        assert p2p == {
            "kv_connector": "NixlConnector",
            "kv_buffer_device": "cuda",
            "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}[instance.role],
        }
        assert pool["kv_connector"] == "MooncakeStoreConnector"
        assert plan.vllm_env(index)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(5600 + index)
    if connector is not None:
        assert router.disaggregation.connector == connector
        assert all(i.kv_engine_id == i.name and i.kv_bootstrap_url is None for i in router.instances)
