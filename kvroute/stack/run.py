"""The real stack on one machine: mooncake_master, N vLLM instances with KV events and the Mooncake pool (and,
disaggregated, a prefill-to-decode connector and a role each), and kvroute in front of them.

```
with running_stack(load_stack_config(Path("configs/stack-cpu.yaml")), Path(".stack")) as stack:
    print(stack.router_url, [i.url for i in stack.instances])
```

Every process runs in its own process group with its log in the run directory; `<run-dir>/state.json` names
them (pid, start time, health URL) so that `kvroute stack down` from another shell stops exactly those groups
and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from kvroute.balancer import balancer_argv
from kvroute.processes import (
    Child,
    StartupError,
    group_alive,
    http_ok,
    port_free,
    spawn,
    stop_group,
    wait_all_healthy,
)
from kvroute.stack.config import SIDE_CHANNEL_ENV, StackConfig
from kvroute.store_servers import redis_argv, wait_listening
from router.config import ConfigError, Role, parse_config
from router.prompt.tokenization import environment_as_given, resolve_tokenizer_path

log = logging.getLogger(__name__)
STATE_FILE = "state.json"
VLLM_STOP_TIMEOUT_S = 30.0
# The project's code that runs inside vLLM (connectors named by kv_connector_module_path). Each stack takes a
# copy of this one package, so that the stack venv's python sees nothing else of the project's environment.
VLLM_SIDE_PACKAGE = Path(__file__).resolve().parents[2] / "kvconnectors"


@dataclass(frozen=True)
class InstanceInfo:
    name: str
    url: str
    events: str
    replay: str
    topic: str
    role: Role = "both"


@dataclass(frozen=True)
class ProcessInfo:
    name: str
    pid: int  # also its process group: every process leads its own
    start_time: int  # clock ticks after boot (/proc/PID/stat), so a reused pid is never mistaken for ours
    health: str
    log: str


class StackPlan:
    """Commands, environments and files of the stack, derived from its configuration; starts nothing."""

    def __init__(self, config: StackConfig, run_dir: Path, base_dir: Path | None = None) -> None:
        self.config = config
        self.run_dir = run_dir.resolve()
        self.python = config.python_path((base_dir or Path.cwd()).resolve())
        self.model_dir = resolve_tokenizer_path(config.model.path).resolve()
        host = config.host
        self.instances = [
            InstanceInfo(
                name=f"{config.vllm.name_prefix}{i}",
                url=f"http://{host}:{config.vllm.http_port + i}",
                events=f"tcp://{host}:{config.vllm.event_port + i}",
                replay=f"tcp://{host}:{config.vllm.replay_port + i}",
                topic=config.vllm.kv_events.topic.format(
                    instance=f"{config.vllm.name_prefix}{i}", model=config.model.served_name
                ),
                role=config.vllm.instance(i).role,
            )
            for i in range(config.vllm.instances)
        ]
        self.router_url = f"http://{host}:{config.router.port}"
        pool = config.pool
        self.master_url = None if pool is None else f"http://{host}:{pool.master.metrics_port}"

    @property
    def mooncake_json(self) -> Path:
        return self.run_dir / "mooncake.json"

    @property
    def router_yaml(self) -> Path:
        return self.run_dir / "router.yaml"

    @property
    def python_path_dir(self) -> Path:
        """On every instance's PYTHONPATH: a copy of the project's vLLM-side package, and nothing else."""
        return self.run_dir / "pythonpath"

    @property
    def pool_model_name(self) -> str:
        """The model part of the pool keys: the connector takes the last path component of --model."""
        return self.model_dir.name

    def master_argv(self) -> list[str]:
        assert self.config.pool is not None
        master = self.config.pool.master
        binary = self.python.parent / "mooncake_master"
        argv = [
            str(binary),
            f"--rpc_port={master.rpc_port}",
            f"--rpc_address={self.config.host}",
            f"--metrics_port={master.metrics_port}",
            f"--metrics_host={self.config.host}",
        ]
        for key, value in master.args.items():
            argv.append(f"--{key}={str(value).lower() if isinstance(value, bool) else value}")
        return argv

    def vllm_argv(self, index: int) -> list[str]:
        config, instance = self.config, self.instances[index]
        events = config.vllm.kv_events
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{events.bind_host}:{config.vllm.event_port + index}",
            "replay_endpoint": instance.replay,
            "topic": instance.topic,
        }
        argv = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            config.model.served_name,
            "--host",
            config.host,
            "--port",
            str(config.vllm.http_port + index),
            "--block-size",
            str(config.block_size),
            "--kv-events-config",
            json.dumps(kv_events),
        ]
        if (transfer := self.kv_transfer_config(index)) is not None:
            argv += ["--kv-transfer-config", json.dumps(transfer)]
        return argv + list(config.vllm.args) + list(config.vllm.instance(index).args)

    def kv_transfer_config(self, index: int) -> dict[str, Any] | None:
        """The pool's connector, the prefill-to-decode one, both in a MultiConnector, or None."""
        config, instance = self.config, self.instances[index]
        connectors: list[dict[str, Any]] = []
        if config.disaggregation is not None:
            connectors.append(
                config.disaggregation.transfer_connector(instance.role, engine_id=instance.name)
            )
        if config.pool is not None:
            pool = dict(config.pool.connector)
            # The connector's lookup socket is ipc://.../lookup_rpc_port_{port}_host_{hostname}: instances
            # on one host need a port each, or the second one takes over the first one's socket.
            extra = {
                "lookup_rpc_port": config.vllm.http_port + index,
                **pool.get("kv_connector_extra_config", {}),
            }
            connectors.append({**pool, "kv_connector_extra_config": extra})
        if len(connectors) < 2:
            return connectors[0] if connectors else None
        # engine_id at the top only: the children take it from there.
        children = [{k: v for k, v in c.items() if k != "engine_id"} for c in connectors]
        multi = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "engine_id": instance.name,
            "kv_connector_extra_config": {"connectors": children},
        }
        # vLLM's scheduler reads the policy of the top-level config only (a child's is ignored): a child's
        # recompute holds for the loads of every child, a P2P transfer's included.
        if any(c.get("kv_load_failure_policy") == "recompute" for c in children):
            multi["kv_load_failure_policy"] = "recompute"
        return multi

    def vllm_env(self, index: int) -> dict[str, str]:
        given = environment_as_given(os.environ)  # the engines' tokenizers as vLLM sets them up
        env = {**given, **self.config.vllm.env, **self.config.vllm.instance(index).env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.python_path_dir), env.get("PYTHONPATH")]))
        if self.config.pool is not None:
            env["MOONCAKE_CONFIG_PATH"] = str(self.mooncake_json)
        if (disaggregation := self.config.disaggregation) is not None:
            env[SIDE_CHANNEL_ENV[disaggregation.connector]] = str(disaggregation.side_channel_port + index)
        return env

    def mooncake_client_config(self) -> dict[str, str]:
        assert self.config.pool is not None
        return {
            "local_hostname": self.config.host,
            "master_server_address": f"{self.config.host}:{self.config.pool.master.rpc_port}",
            **self.config.pool.client.model_dump(),
        }

    def router_config(self) -> dict[str, Any]:
        model = {
            "name": self.config.model.served_name,
            "tokenizer": str(self.model_dir),
            "pool_name": self.pool_model_name,
        }
        if self.config.pool is not None:
            # vLLM writes str(cache_prefix) before the model's name in every pool key when it is set.
            cache_prefix = self.config.pool.connector.get("kv_connector_extra_config", {}).get("cache_prefix")
            if cache_prefix not in (None, ""):
                model["pool_cache_prefix"] = str(cache_prefix)
        config: dict[str, Any] = {
            "models": [model],
            "block_size": self.config.block_size,
            "instances": [self._router_instance(index) for index in range(len(self.instances))],
        }
        if self.master_url is not None:
            config["pool"] = {"master_url": self.master_url}
        if self.config.disaggregation is not None:
            config["disaggregation"] = {"connector": self.config.disaggregation.connector}
        if self.replica_ports:
            config["shared"] = {"url": f"redis://{self.config.host}:{self.store_port}/0"}
        for key, value in self.config.router.config.items():  # sections merged, one level down
            both_sections = isinstance(value, dict) and isinstance(config.get(key), dict)
            config[key] = {**config[key], **value} if both_sections else value
        return config

    def _router_instance(self, index: int) -> dict[str, Any]:
        i = self.instances[index]
        instance: dict[str, Any] = {"name": i.name, "url": i.url, "events": i.events, "replay": i.replay}
        if (disaggregation := self.config.disaggregation) is not None:
            instance.update(role=i.role, kv_engine_id=i.name)
            if disaggregation.connector == "mooncake" and i.role != "decode":
                port = disaggregation.side_channel_port + index
                instance["kv_bootstrap_url"] = f"http://{self.config.host}:{port}"
        return instance

    @property
    def replica_ports(self) -> list[int]:
        """The routers' ports behind the balancer (router.replicas above 1); none: one router on the port."""
        router = self.config.router
        first = router.replica_port or router.port + 1
        return [first + n for n in range(router.replicas)] if router.replicas > 1 else []

    @property
    def store_port(self) -> int:
        """The replicas' redis-server's: the port after theirs (with router.replicas above 1)."""
        return self.replica_ports[-1] + 1

    def router_argv(self, port: int | None = None) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvroute.cli",
            "serve",
            "--config",
            str(self.router_yaml),
            "--host",
            self.config.host,
            "--port",
            str(port or self.config.router.port),
        ]

    def write_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        router_config = self.router_config()
        try:
            parse_config(router_config, source="router config")
        except ConfigError as exc:
            raise StartupError(f"the generated router configuration is invalid:\n{exc}") from exc
        self.router_yaml.write_text(yaml.safe_dump(router_config, sort_keys=False))
        shutil.rmtree(self.python_path_dir, ignore_errors=True)
        shutil.copytree(
            VLLM_SIDE_PACKAGE,
            self.python_path_dir / VLLM_SIDE_PACKAGE.name,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        if self.config.pool is not None:
            self.mooncake_json.write_text(json.dumps(self.mooncake_client_config(), indent=1) + "\n")

    def check_ready_to_start(self) -> None:
        if not self.python.exists():
            raise StartupError(
                f"no stack python at {self.python}: run `make stack-env` (or set KVROUTE_STACK_PYTHON)"
            )
        if self.config.pool is not None and not Path(self.master_argv()[0]).exists():
            raise StartupError(f"no mooncake_master beside {self.python}: run `make stack-env`")
        busy = [
            f"{key} ({port})"
            for key, port in self.config.ports().items()
            if not port_free(port, self.config.host)
        ]
        if busy:
            raise StartupError(f"ports in use: {', '.join(busy)}")


class Stack:
    """The processes of one running stack; `up()` starts them, `stop()` stops exactly them."""

    def __init__(self, plan: StackPlan, with_router: bool = True) -> None:
        self.plan = plan
        self.with_router = with_router  # False: the engines alone, for a router started by hand
        self.children: dict[str, Child] = {}
        self.timings: dict[str, float] = {}
        self._health: dict[str, str] = {}

    @property
    def instances(self) -> list[InstanceInfo]:
        return self.plan.instances

    @property
    def router_url(self) -> str:
        return self.plan.router_url

    @property
    def master_url(self) -> str | None:
        return self.plan.master_url

    def up(self) -> None:
        plan, config = self.plan, self.plan.config
        plan.check_ready_to_start()
        plan.write_files()
        started = time.monotonic()
        try:
            if config.pool is not None:
                assert plan.master_url is not None
                master = self._spawn("mooncake-master", plan.master_argv(), plan.master_url + "/health")
                wait_all_healthy(
                    [(master, plan.master_url + "/health")], config.pool.master.startup_timeout_s
                )
                self.timings["master_s"] = time.monotonic() - started
            vllm_started = time.monotonic()
            if config.vllm.start == "parallel":
                children = [self._start_vllm(i) for i in range(len(plan.instances))]
                wait_all_healthy(
                    [(c, f"{i.url}/health") for c, i in zip(children, plan.instances, strict=True)],
                    config.vllm.startup_timeout_s,
                )
            else:
                for index, instance in enumerate(plan.instances):
                    child = self._start_vllm(index)
                    wait_all_healthy([(child, f"{instance.url}/health")], config.vllm.startup_timeout_s)
            self.timings["vllm_s"] = time.monotonic() - vllm_started
            if self.with_router:
                router_started = time.monotonic()
                self._start_routers()
                self.timings["router_s"] = time.monotonic() - router_started
            self.timings["total_s"] = time.monotonic() - started
            self.write_state()
        except BaseException:
            self.stop()
            raise

    def restart_vllm(self, index: int) -> None:
        """Kill instance index (its process group, by the pid this stack started) and start it again."""
        instance = self.plan.instances[index]
        self.children[instance.name].stop(VLLM_STOP_TIMEOUT_S)
        child = self._start_vllm(index)  # takes the old one's place: stop() keeps its order
        wait_all_healthy([(child, f"{instance.url}/health")], self.plan.config.vllm.startup_timeout_s)
        self.write_state()

    def stop(self) -> None:
        """Router first, then the instances, the master last: stop exactly what this stack started."""
        for name in reversed(list(self.children)):
            child = self.children.pop(name)
            try:
                child.stop(VLLM_STOP_TIMEOUT_S)
            except Exception:
                log.exception("could not stop %s (pid %d)", name, child.process.pid)
        state = self.plan.run_dir / STATE_FILE
        state.unlink(missing_ok=True)

    def write_state(self) -> None:
        processes = [
            ProcessInfo(
                name, c.process.pid, _start_time(c.process.pid) or 0, self._health[name], str(c.log_path)
            )
            for name, c in self.children.items()
        ]
        state = {
            "run_dir": str(self.plan.run_dir),
            "python": str(self.plan.python),
            "model_dir": str(self.plan.model_dir),
            "pool_model_name": self.plan.pool_model_name,
            "router_url": self.plan.router_url if self.with_router else None,
            "master_url": self.plan.master_url,
            "instances": [asdict(i) for i in self.plan.instances],
            "processes": [asdict(p) for p in processes],
            "timings": {k: round(v, 1) for k, v in self.timings.items()},
        }
        path = self.plan.run_dir / STATE_FILE
        path.write_text(json.dumps(state, indent=1) + "\n")

    def _spawn(self, name: str, argv: list[str], health: str, env: dict[str, str] | None = None) -> Child:
        child = spawn(name, argv, self.plan.run_dir / "logs", env=env, cwd=self.plan.run_dir)
        self.children[name] = child
        self._health[name] = health
        self.write_state()  # at once, so that `kvroute stack down` finds it even if `up` never finishes
        return child

    def _start_routers(self) -> None:
        """The router; or, with router.replicas, the replicas' redis-server, the replicas and their
        balancer."""
        plan, config = self.plan, self.plan.config
        timeout_s = config.router.startup_timeout_s
        if not plan.replica_ports:
            router = self._spawn("router", plan.router_argv(), plan.router_url + "/health")
            wait_all_healthy([(router, plan.router_url + "/health")], timeout_s)
            return
        store = self._spawn("shared-store", redis_argv(plan.store_port), "")
        wait_listening(store, plan.store_port)
        replicas = []
        for n, port in enumerate(plan.replica_ports):
            url = f"http://{config.host}:{port}/health"
            replicas.append((self._spawn(f"router-{n}", plan.router_argv(port), url), url))
        wait_all_healthy(replicas, timeout_s)
        argv = balancer_argv(plan.run_dir / "balancer", config.host, config.router.port, plan.replica_ports)
        balancer = self._spawn("balancer", argv, plan.router_url + "/health")
        wait_all_healthy([(balancer, plan.router_url + "/health")], timeout_s)

    def _start_vllm(self, index: int) -> Child:
        instance = self.plan.instances[index]
        return self._spawn(
            instance.name, self.plan.vllm_argv(index), f"{instance.url}/health", self.plan.vllm_env(index)
        )


@contextlib.contextmanager
def running_stack(config: StackConfig, run_dir: Path, base_dir: Path | None = None) -> Iterator[Stack]:
    stack = Stack(StackPlan(config, run_dir, base_dir))
    try:
        stack.up()
        yield stack
    finally:
        stack.stop()


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name before ")" may hold spaces


def _ours(process: dict[str, Any]) -> bool:
    """Whether process group pid is still the one state.json recorded: its leader is the same process, or
    the leader is gone and the group it left is (a pid that leads a live group is never handed out again)."""
    pid = int(process["pid"])
    start = _start_time(pid)
    if start is not None:
        return start == int(process["start_time"])
    return group_alive(pid)


def read_state(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / STATE_FILE
    if not path.exists():
        return None
    state: dict[str, Any] = json.loads(path.read_text())
    return state


def stack_down(run_dir: Path, timeout_s: float = VLLM_STOP_TIMEOUT_S) -> list[str]:
    """Stop the process groups state.json names (router first); returns the names stopped."""
    state = read_state(run_dir)
    if state is None:
        return []
    stopped = []
    for process in reversed(state["processes"]):
        if _ours(process):
            stop_group(int(process["pid"]), timeout_s)
            stopped.append(str(process["name"]))
    (run_dir / STATE_FILE).unlink()
    return stopped


def stack_status(run_dir: Path) -> list[tuple[str, bool, bool]]:
    """(name, alive, healthy) for each process state.json names."""
    state = read_state(run_dir)
    if state is None:
        return []
    return [
        (str(p["name"]), _ours(p), _ours(p) and (not p["health"] or http_ok(str(p["health"]), timeout_s=2.0)))
        for p in state["processes"]
    ]


def stack_up(
    config: StackConfig, run_dir: Path, base_dir: Path | None = None, with_router: bool = True
) -> Stack:
    """Start the stack and leave it running (the CLI's `up`); refuses when state.json names live processes."""
    if any(alive for _, alive, _ in stack_status(run_dir)):
        raise StartupError(f"a stack is already running from {run_dir}; `kvroute stack down` first")
    stack = Stack(StackPlan(config, run_dir, base_dir), with_router)
    stack.up()
    return stack
