"""The real stack's configuration: vLLM instances, the Mooncake master and pool client, and the router.

Typed and strict like the router's: unknown keys are errors, and every error names its key path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.config import ConfigError, Role, read_yaml, validated
from router.dispatch.place.settings import KVConnector

PYTHON_ENV = "KVROUTE_STACK_PYTHON"
Port = Annotated[int, Field(ge=1, le=65535)]

# Flags the stack sets itself from the rest of the configuration; in `vllm.args` they would contradict it.
OWN_VLLM_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--block-size",
        "--kv-events-config",
        "--kv-transfer-config",
    }
)


StackConfigError = ConfigError  # a stack configuration that cannot be used

# What disaggregation.side_channel_port sets on each instance, by connector: where a MooncakeConnector's
# bootstrap server listens, or a NixlConnector's handshake listener.
SIDE_CHANNEL_ENV: dict[KVConnector, str] = {
    "mooncake": "VLLM_MOONCAKE_BOOTSTRAP_PORT",
    "nixl": "VLLM_NIXL_SIDE_CHANNEL_PORT",
}
# The prefill-to-decode connector of each kind, before the stack adds kv_role and engine_id.
DEFAULT_TRANSFER: dict[KVConnector, dict[str, Any]] = {
    "mooncake": {
        "kv_connector": "MooncakeConnector",
        "kv_connector_module_path": "kvconnectors.mooncake",  # runs on CPU, and inside a MultiConnector
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    },
    "nixl": {"kv_connector": "NixlConnector"},
}
KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    path: str = Field(default="builtin:tiny-llama", description="model directory, or builtin:tiny-llama")
    served_name: str = Field(default="tiny-llama", min_length=1, description="--served-model-name")


class MasterSection(_Strict):
    """mooncake_master: metadata, leases and eviction for the pool."""

    rpc_port: Port
    metrics_port: Port = Field(description="admin HTTP: /health, /metrics, /get_all_keys")
    args: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="more --flag value pairs, e.g. default_kv_lease_ttl: 10000"
    )
    startup_timeout_s: float = Field(default=30.0, gt=0)


class PoolClientSection(_Strict):
    """mooncake.json, which every vLLM worker reads through MOONCAKE_CONFIG_PATH."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    device_name: str = Field(default="", description="RDMA devices, e.g. mlx5_0,mlx5_1")
    global_segment_size: str = Field(default="1GB", description="memory each instance lends the pool")
    local_buffer_size: str = "256MB"


class PoolSection(_Strict):
    master: MasterSection
    client: PoolClientSection = Field(default_factory=PoolClientSection)
    connector: dict[str, Any] = Field(
        default_factory=lambda: {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",  # a failed pool load is recomputed, not a 500
        },
        description="vLLM's --kv-transfer-config; the stack adds a lookup_rpc_port per instance",
    )


class KVEventsSection(_Strict):
    bind_host: str = Field(
        default="[::ffff:127.0.0.1]",
        description="where the PUB socket binds; vLLM binds only when the endpoint has '*' or '::' "
        "(and connects otherwise), so loopback-only is the IPv4-mapped [::ffff:127.0.0.1]",
    )
    topic: str = Field(
        default="",
        description="the ZMQ topic of every event frame, {instance} and {model} filled in; empty is vLLM's "
        "default and the only one vllm-router's kv_aware reads; llm-d's indexer expects "
        "kv@{instance}@{model}",
    )

    @field_validator("bind_host")
    @classmethod
    def _binds(cls, host: str) -> str:
        if "*" not in host and "::" not in host:
            raise ValueError(f"{host!r} would make vLLM connect instead of bind; use '*' or '[::ffff:IP]'")
        return host


def _not_own_flags(args: list[str]) -> list[str]:
    for arg in args:
        if arg.split("=", 1)[0] in OWN_VLLM_FLAGS:
            raise ValueError(f"{arg} is set by the stack itself ({', '.join(sorted(OWN_VLLM_FLAGS))})")
    return args


class InstanceSection(_Strict):
    """What one instance adds to the shared vllm.args and vllm.env: its role, its devices."""

    role: Role = Field(default="both", description="prefill, decode or both (disaggregation: needed)")
    args: list[str] = Field(default_factory=list, description="after vllm.args")
    env: dict[str, str] = Field(default_factory=dict, description="over vllm.env, e.g. CUDA_VISIBLE_DEVICES")

    _not_own = field_validator("args")(_not_own_flags)


class VLLMSection(_Strict):
    instances: int = Field(default=2, ge=1)
    per_instance: list[InstanceSection] = Field(
        default_factory=list, description="empty, or one entry per instance, in order"
    )
    name_prefix: str = Field(default="vllm-", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,40}$")
    http_port: Port
    event_port: Port
    replay_port: Port
    start: Literal["parallel", "sequential"] = "parallel"
    startup_timeout_s: float = Field(default=600.0, gt=0)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    kv_events: KVEventsSection = Field(default_factory=KVEventsSection)

    _not_own = field_validator("args")(_not_own_flags)

    def instance(self, index: int) -> InstanceSection:
        return self.per_instance[index] if self.per_instance else InstanceSection()


class DisaggregationSection(_Strict):
    """Prefill and decode on different instances: the connector that moves KV from one to the other."""

    connector: KVConnector = Field(description="the router's disaggregation.connector: how it runs the legs")
    side_channel_port: Port = Field(
        description="instance i: + i, as VLLM_MOONCAKE_BOOTSTRAP_PORT (mooncake) or "
        "VLLM_NIXL_SIDE_CHANNEL_PORT (nixl)"
    )
    transfer: dict[str, Any] = Field(
        default_factory=dict,
        description="the connector's --kv-transfer-config, less kv_role and engine_id (the stack sets them: "
        "engine_id is the instance's name); empty: the defaults for the connector, MooncakeConnector "
        "through kvconnectors.mooncake or NixlConnector. With a pool, both go in a MultiConnector",
    )

    @field_validator("transfer")
    @classmethod
    def _not_per_instance(cls, transfer: dict[str, Any]) -> dict[str, Any]:
        if own := sorted({"kv_role", "engine_id"} & set(transfer)):
            raise ValueError(f"{', '.join(own)} is set by the stack itself, for each instance")
        if transfer and "kv_connector" not in transfer:
            raise ValueError("kv_connector is missing")
        return transfer

    def transfer_connector(self, role: Role, engine_id: str) -> dict[str, Any]:
        """The prefill-to-decode connector of one instance."""
        transfer = self.transfer or DEFAULT_TRANSFER[self.connector]
        return {**transfer, "kv_role": KV_ROLES[role], "engine_id": engine_id}


class RouterSection(_Strict):
    port: Port
    replicas: int = Field(
        default=1,
        ge=1,
        le=16,
        description="above 1: that many routers on the ports after port, sharing state through a "
        "redis-server on the port after theirs, behind nginx's round robin on port",
    )
    replica_port: Port | None = Field(
        default=None,
        description="with replicas: the first one's port, each next one's up (default: port + 1)",
    )
    startup_timeout_s: float = Field(default=60.0, gt=0)
    config: dict[str, Any] = Field(
        default_factory=dict, description="merged into the generated router.yaml (policies, pool, ...)"
    )


class StackConfig(_Strict):
    python: str = Field(
        default=".venv-stack/bin/python", description=f"the stack venv; {PYTHON_ENV} overrides"
    )
    host: str = Field(default="127.0.0.1", description="where every server listens and is reached")
    block_size: int = Field(default=32, ge=1, description="--block-size of every instance and the router's")
    model: ModelSection = Field(default_factory=ModelSection)
    pool: PoolSection | None = None
    disaggregation: DisaggregationSection | None = None
    vllm: VLLMSection
    router: RouterSection

    @model_validator(mode="after")
    def _consistent(self) -> StackConfig:
        if self.pool is not None and "PYTHONHASHSEED" not in self.vllm.env:
            raise ValueError(
                "vllm.env: PYTHONHASHSEED must be fixed, or instances compute different pool keys"
            )
        self._roles_consistent()
        ports = self.ports()
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                raise ValueError(f"{name}: port {port} is also {seen[port]}")
            seen[port] = name
        return self

    def _roles_consistent(self) -> None:
        entries, instances = len(self.vllm.per_instance), self.vllm.instances
        if entries and entries != instances:
            raise ValueError(f"vllm.per_instance: {entries} entries for {instances} instances")
        for i, instance in enumerate(self.vllm.per_instance):
            if instance.role != "both" and self.disaggregation is None:
                raise ValueError(
                    f"vllm.per_instance.{i}.role: {instance.role} needs a disaggregation section"
                )
        if self.disaggregation is None:
            return
        side_channel = SIDE_CHANNEL_ENV[self.disaggregation.connector]
        envs = {"vllm.env": self.vllm.env}
        envs.update((f"vllm.per_instance.{i}.env", p.env) for i, p in enumerate(self.vllm.per_instance))
        for key, env in envs.items():
            if side_channel in env:
                raise ValueError(
                    f"{key}: {side_channel} is set by the stack from disaggregation.side_channel_port"
                )

    def ports(self) -> dict[str, int]:
        """Every port the stack listens on, by the key path that sets it (instances after the first: +i)."""
        ports = {"router.port": self.router.port}
        if self.pool is not None:
            ports["pool.master.rpc_port"] = self.pool.master.rpc_port
            ports["pool.master.metrics_port"] = self.pool.master.metrics_port
        per_instance = {
            f"vllm.{key}": getattr(self.vllm, key) for key in ("http_port", "event_port", "replay_port")
        }
        if self.disaggregation is not None:
            per_instance["disaggregation.side_channel_port"] = self.disaggregation.side_channel_port
        for key, base in per_instance.items():
            for i in range(self.vllm.instances):
                ports[key + (f" + {i}" if i else "")] = base + i
        return ports

    def python_path(self, base_dir: Path) -> Path:
        path = Path(os.environ.get(PYTHON_ENV) or self.python)
        return path if path.is_absolute() else base_dir / path

    def with_ports(self, base: int) -> StackConfig:
        """The same stack on consecutive ports from base (tests: a block that free_port_block found free)."""
        n = self.vllm.instances
        update: dict[str, Any] = {
            "router": self.router.model_copy(update={"port": base, "replica_port": base + self._own_ports()}),
            "vllm": self.vllm.model_copy(
                update={"http_port": base + 3, "event_port": base + 3 + n, "replay_port": base + 3 + 2 * n}
            ),
        }
        if self.pool is not None:
            master = self.pool.master.model_copy(update={"rpc_port": base + 1, "metrics_port": base + 2})
            update["pool"] = self.pool.model_copy(update={"master": master})
        if self.disaggregation is not None:
            update["disaggregation"] = self.disaggregation.model_copy(
                update={"side_channel_port": base + 3 + 3 * n}
            )
        return self.model_copy(update=update)

    def port_count(self) -> int:
        replicas = self.router.replicas
        return self._own_ports() + (replicas + 1 if replicas > 1 else 0)

    def _own_ports(self) -> int:
        """The ports of everything but the router's replicas and their store."""
        per_instance = 3 if self.disaggregation is None else 4
        return 3 + per_instance * self.vllm.instances


def parse_stack_config(raw: Any, source: str = "stack config") -> StackConfig:
    return validated(StackConfig, raw, source, "stack configuration")


def load_stack_config(path: Path) -> StackConfig:
    return parse_stack_config(read_yaml(path), source=str(path))
