"""The router's configuration: typed, strict (unknown keys are errors), every error naming its key path."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from router import strict_yaml
from router.discovery.settings import DiscoveryConfig
from router.dispatch.intake.settings import AdmissionConfig, TrafficConfig
from router.dispatch.place.settings import DisaggregationConfig
from router.dispatch.wait.settings import FlowControlConfig
from router.http.settings import AdminConfig, ClientAuthConfig, CorsConfig, LimitsConfig
from router.index.settings import IndexConfig, PoolConfig
from router.programs.settings import ProgramsConfig
from router.prompt.settings import TokenizationConfig
from router.settings_base import Strict, checked_http_url, checked_zmq_endpoint
from router.shared.settings import SharedConfig
from router.tracing.config import TracingConfig
from router.upstreams.settings import CircuitBreakerConfig, HealthConfig, LoadConfig, UpstreamConfig
from scorers.config_keys import suggested
from scorers.policy_config import PolicyConfig, builtin_policies
from scorers.ttft_model import TTFTPriors

Role = Literal["prefill", "decode", "both"]
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
REMOTE_TOKENIZER = "remote"


class ModelConfig(Strict):
    name: str = Field(
        min_length=1, description="the model's name as clients send it and the engines serve it"
    )
    tokenizer: str | None = Field(
        default=None,
        min_length=1,
        description="the tokenizer: a directory, a Hugging Face id in the local cache (the router does not "
        "download), builtin:tiny-llama (the test model's), or remote (ask an instance's /tokenize). Default: "
        "the one vLLM loads, as its --tokenizer defaults to --model: the model's name (an adapter's: its "
        "base's) as a directory or cached id here, else the model's root as its instances report it in "
        "/v1/models, found here alike, else remote, with a warning. Chosen once, at start",
    )
    pool_name: str | None = Field(
        default=None,
        min_length=1,
        description="the model's name in Mooncake pool keys: the last path component of vLLM's --model "
        "(default: name; for an adapter, its base's)",
    )
    pool_cache_prefix: str | None = Field(
        default=None,
        min_length=1,
        description="the MooncakeStoreConnector's cache_prefix (vLLM's kv_connector_extra_config), which "
        "starts its pool keys (default: none; for an adapter, its base's)",
    )
    pool_store_namespace: str | None = Field(
        default=None,
        pattern=r"^@\S+$",
        description="the store namespace vLLM puts after the model's name in pool keys when the connector "
        "sets store_tp_size or enable_store_tp_lcm, such as @store_tp:4@store_pp:1@store_format:hnc (copy "
        "it from a key on the master; default: none; for an adapter, its base's)",
    )
    exclude_tools_when_tool_choice_none: bool = Field(
        default=False,
        description="the engines run with vLLM's --exclude-tools-when-tool-choice-none: a chat whose "
        'tool_choice is "none" is rendered without its tools (for an adapter, its base\'s)',
    )
    dtype: Literal["float32", "float", "float16", "half", "bfloat16"] | None = Field(
        default=None,
        description="the engines' --dtype as they resolved it (their log's dtype=): a completion's "
        "prompt_embeds are cast to it and hashed as vLLM keys their blocks (default: unknown, such "
        "completions are routed by load; for an adapter, its base's)",
    )
    lora_of: str | None = Field(
        default=None,
        min_length=1,
        description="a LoRA adapter (vLLM --lora-modules NAME=PATH) running on this base model: its cache "
        "is its own, and its tokenizer and pool keys default to the base's",
    )


# An adapter runs on its base's engines: their settings are its own unless it states them.
_INHERITED_BY_ADAPTERS = (
    "pool_cache_prefix",
    "pool_store_namespace",
    "exclude_tools_when_tool_choice_none",
    "dtype",
)


class InstanceConfig(Strict):
    name: Annotated[str, Field(pattern=_NAME, description="the instance's name in headers, metrics and logs")]
    url: str = Field(description="its OpenAI server, http://HOST:PORT")
    events: str | None = Field(
        default=None,
        description="its KV events publisher (vLLM --kv-events-config endpoint), tcp://HOST:PORT; null: the "
        "index knows nothing of its cache",
    )
    replay: str | None = Field(
        default=None,
        description="its KV events replay endpoint (vLLM's replay_endpoint), for gaps and warm starts",
    )
    models: list[str] | None = Field(default=None, description="the models it serves; null: every model")
    api_key_env: str | None = Field(
        default=None, min_length=1, description="this instance's key variable instead of upstream.api_key_env"
    )
    pool: bool | None = Field(
        default=None,
        description="loads from the shared pool (a MooncakeStoreConnector); default: when pool.master_url is "
        "set. An instance that writes to the pool counts as connected anyway",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="an engine with internal data parallelism (vllm serve --data-parallel-size N behind one "
        "API server): each rank has a cache of its own, so each becomes a routing target NAME-dpR, its "
        "requests sent with X-data-parallel-rank and its events read at the events (and replay) port + R",
    )
    data_parallel_rank: int | None = Field(
        default=None, ge=0, description="send X-data-parallel-rank: this, and read this rank's load only"
    )
    role: Role = Field(
        default="both",
        description="prefill: takes prefill legs only (a kv_producer); decode: decode legs, and whole "
        "requests when no prefill leg is worth it (a kv_consumer); both: either leg or a whole request "
        "(kv_both). A model with any prefill or decode instance is served disaggregated (disaggregation:)",
    )
    kv_engine_id: str | None = Field(
        default=None,
        min_length=1,
        description="the engine_id of its --kv-transfer-config; MooncakeConnector's decode leg names it",
    )
    kv_bootstrap_url: str | None = Field(
        default=None,
        description="MooncakeConnector's bootstrap server, http://HOST:VLLM_MOONCAKE_BOOTSTRAP_PORT, where "
        "decode instances ask for the prefill's KV",
    )

    @model_validator(mode="after")
    def _one_way_to_name_ranks(self) -> InstanceConfig:
        if self.data_parallel_size > 1 and self.data_parallel_rank is not None:
            raise ValueError("data_parallel_rank names one rank; data_parallel_size all of them: not both")
        last = self.data_parallel_size - 1
        for key, endpoint in (("events", self.events), ("replay", self.replay)):
            if endpoint is None or last == 0:
                continue
            if not endpoint.startswith("tcp://"):  # vLLM refuses to start its ranks' publishers on one
                raise ValueError(f"{key}: data-parallel ranks publish on TCP ports only, not {endpoint!r}")
            if int(endpoint.rpartition(":")[2]) + last > 65535:
                raise ValueError(f"{key}: rank {last} would publish past port 65535 ({endpoint!r} + {last})")
        return self

    @field_validator("url", "kv_bootstrap_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        return None if url is None else checked_http_url(url)

    @field_validator("events", "replay")
    @classmethod
    def _zmq_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        return checked_zmq_endpoint(endpoint)


class RouterConfig(Strict):
    models: list[ModelConfig] = Field(min_length=1, description="the models routed")
    block_size: int = Field(
        default=16, ge=1, description="the engines' KV block size in tokens (vLLM's --block-size)"
    )
    # One per data-parallel rank once validated; none only with discovery (_consistent).
    instances: list[InstanceConfig] = Field(description="the vLLM instances (may be empty with discovery)")
    discovery: DiscoveryConfig | None = Field(default=None, description="instances found in Kubernetes")
    policies: dict[str, PolicyConfig] = Field(
        default_factory=builtin_policies,
        description="routing policies by name (a mapping here replaces the built-in ones)",
    )
    default_policy: str = Field(
        default="kvroute", description="every request's policy when traffic.split is empty"
    )
    traffic: TrafficConfig = Field(default_factory=TrafficConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    flow_control: FlowControlConfig = Field(default_factory=FlowControlConfig)
    programs: ProgramsConfig = Field(default_factory=ProgramsConfig)
    auth: ClientAuthConfig = Field(default_factory=ClientAuthConfig)
    cors: CorsConfig = Field(default_factory=CorsConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    ttft: TTFTPriors = Field(default_factory=TTFTPriors)
    tokenization: TokenizationConfig = Field(default_factory=TokenizationConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    shared: SharedConfig = Field(default_factory=SharedConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    shutdown_grace_s: float = Field(
        default=30.0, gt=0, description="on SIGTERM: new connections are refused, streams get this long"
    )

    @field_validator("instances")
    @classmethod
    def _one_target_per_rank(cls, instances: list[InstanceConfig]) -> list[InstanceConfig]:
        return [target for instance in instances for target in data_parallel_ranks(instance)]

    @model_validator(mode="before")
    @classmethod
    def _discovery_may_find_all(cls, raw: Any) -> Any:
        """With discovery:, instances: may be left out (a list of none); without, it is required."""
        if isinstance(raw, dict) and raw.get("discovery") is not None and "instances" not in raw:
            return {**raw, "instances": []}
        return raw

    @model_validator(mode="before")
    @classmethod
    def _adapters_take_their_base(cls, raw: Any) -> Any:
        """An adapter without a tokenizer or engine settings of its own takes its listed base's: vLLM
        (0.32) tokenizes an adapter's requests with the base's tokenizer, and its pool keys are the engine's
        (its --model and connector settings) whatever the adapter."""
        if not isinstance(raw, dict) or not isinstance(raw.get("models"), list):
            return raw
        named = [m for m in raw["models"] if isinstance(m, dict) and isinstance(m.get("name"), str)]
        bases = {m["name"]: m for m in named}
        models = []
        for model in raw["models"]:
            lora_of = model.get("lora_of") if isinstance(model, dict) else None
            base = bases.get(lora_of) if isinstance(lora_of, str) else None
            if base is not None:
                pool_name = base.get("pool_name") or lora_of
                inherited = {"tokenizer": base.get("tokenizer"), "pool_name": pool_name}
                inherited |= {key: base.get(key) for key in _INHERITED_BY_ADAPTERS}
                # An explicit null is no value of its own: the base's stands.
                own = {k: v for k, v in model.items() if k not in inherited or v is not None}
                model = {k: v for k, v in inherited.items() if v is not None} | own
            models.append(model)
        return {**raw, "models": models}

    @model_validator(mode="after")
    def _consistent(self) -> RouterConfig:
        model_names = [m.name for m in self.models]
        _unique((f"models.{i}.name", name) for i, name in enumerate(model_names))
        if not self.instances and self.discovery is None:
            raise ValueError("instances: at least one instance, unless discovery: finds them")
        self._check_discovery(model_names)
        for index, adapter in enumerate(self.models):
            base = next((m for m in self.models if m.name == adapter.lora_of), None)
            if base is adapter:
                raise ValueError(f"models.{index}.lora_of: {base.name!r} cannot be an adapter of itself")
            if base is not None and base.lora_of is not None:
                raise ValueError(f"models.{index}.lora_of: {base.name!r} is an adapter, not a base model")
        _unique((f"instances.{i}.name", instance.name) for i, instance in enumerate(self.instances))
        # Two entries for one engine would count its load and cache twice, and one ZMQ endpoint cannot be
        # two instances' events.
        _unique(
            ((f"instances.{n}.url", i.url) for n, i in enumerate(self.instances)),
            _url_key,
            ranks=[i.data_parallel_rank for i in self.instances],
        )
        _unique(
            (f"instances.{i}.{key}", endpoint)
            for i, instance in enumerate(self.instances)
            for key, endpoint in (("events", instance.events), ("replay", instance.replay))
            if endpoint is not None
        )
        for index, instance in enumerate(self.instances):
            for model in instance.models or []:
                if model not in model_names:
                    raise ValueError(
                        f"instances.{index}.models: {model!r} is not one of models ({model_names})"
                    )
        if self.disaggregation.connector == "mooncake":
            for index, instance in enumerate(self.instances):
                missing = [k for k in ("kv_engine_id", "kv_bootstrap_url") if getattr(instance, k) is None]
                if missing and self.takes_prefill_legs(instance):
                    raise ValueError(
                        f"instances.{index}: {' and '.join(missing)} must be set: a MooncakeConnector "
                        "decode leg names the prefill instance's engine and bootstrap server"
                    )
        for name in self.policies:
            if not re.match(_NAME, name):
                raise ValueError(f"policies: {name!r} is not a valid policy name")
        if self.default_policy not in self.policies:
            raise ValueError(
                f"default_policy: {self.default_policy!r} is not a policy; "
                f"defined: {', '.join(self.policies)}"
            )
        for name in self.traffic.split or {}:
            if name not in self.policies:
                raise ValueError(
                    f"traffic.split: {name!r} is not a policy; defined: {', '.join(self.policies)}"
                )
        return self

    def _check_discovery(self, model_names: list[str]) -> None:
        if self.discovery is None:
            return
        if (problem := self.discovery.source_problem()) is not None:
            raise ValueError(f"discovery.{problem}")
        for model in self.discovery.models or []:
            if model not in model_names:
                raise ValueError(f"discovery.models: {model!r} is not one of models ({model_names})")

    def traffic_weights(self) -> dict[str, float]:
        return dict(self.traffic.split) if self.traffic.split else {self.default_policy: 1.0}

    def disaggregated_models(self) -> frozenset[str]:
        """Models with a prefill or decode instance: served in two legs."""
        return frozenset(m for i in self.instances if i.role != "both" for m in self.models_of(i))

    def takes_prefill_legs(self, instance: InstanceConfig) -> bool:
        if instance.role == "both":
            return not self.disaggregated_models().isdisjoint(self.models_of(instance))
        return instance.role == "prefill"

    def pool_members(self) -> list[str]:
        default = self.pool.master_url is not None
        return [i.name for i in self.instances if (default if i.pool is None else i.pool)]

    def models_of(self, instance: InstanceConfig) -> list[str]:
        return instance.models or [m.name for m in self.models]

    def api_key_env_of(self, instance: InstanceConfig) -> str | None:
        return instance.api_key_env or self.upstream.api_key_env

    def tokenizer_warnings(self) -> list[str]:
        """Models with no tokenizer set whose own is not found on this machine by their name: at start the
        router looks where their instances say the model is, and failing that asks their /tokenize for every
        prompt (router/upstreams/model_tokenizers.py)."""
        from router.prompt.tokenization import local_tokenizer_dir

        warnings = []
        for number, model in enumerate(self.models):
            own = model.lora_of or model.name  # an adapter's is its base's
            if model.tokenizer is None and local_tokenizer_dir(own) is None:
                warnings.append(
                    f"models.{number} ({model.name}) has no tokenizer set, and {own!r} is neither a "
                    "tokenizer directory here nor a model in the local Hugging Face cache: at start the "
                    "router looks where its instances say the model is (/v1/models root), else asks their "
                    "/tokenize for every prompt; set its tokenizer directory, or `remote`"
                )
        return warnings

    def require_tokenizers(self, source: str) -> None:
        """What serve would fail on at start, said by check-config too (router/prompt/tokenization.py)."""
        from router.prompt.tokenization import check_tokenizer_spec

        for number, model in enumerate(self.models):
            if model.tokenizer is None or model.tokenizer == REMOTE_TOKENIZER:
                continue
            try:
                check_tokenizer_spec(model.tokenizer)
            except ValueError as exc:
                raise ConfigError(f"{source}: models.{number}.tokenizer: {exc}") from None

    def require_api_keys(self, source: str) -> None:
        """Refuse key variables named for instances but not set (the instances would refuse every request),
        or holding what no HTTP header can carry, and a clients' key variable with no key in it."""
        named = {self.api_key_env_of(i) for i in self.instances}
        if missing := sorted(name for name in named if name and not api_key(name)):
            raise ConfigError(f"{source}: the instances' key variables are not set: ${', $'.join(missing)}")
        if unusable := sorted(name for name in named if name and not api_key(name).isprintable()):
            raise ConfigError(f"{source}: ${', $'.join(unusable)}: a key must be printable, on one line")
        clients = self.auth.api_keys_env
        if clients and not client_api_keys(clients):
            raise ConfigError(
                f"{source}: auth.api_keys_env names ${clients}, which holds no key: the router would serve "
                "every client without one (set it, or set auth.api_keys_env to null)"
            )


def client_api_keys(env: str) -> list[str]:
    """The clients' keys in environment variable env, comma-separated."""
    return [key.strip() for key in os.environ.get(env, "").split(",") if key.strip()]


def api_key(env: str) -> str:
    """The key in environment variable env; a secret mounted from a file often ends in a newline."""
    return os.environ.get(env, "").strip()


def _unique(
    values: Iterable[tuple[str, str]], same: Callable[[str], str] = str, ranks: Iterable[int | None] = ()
) -> None:
    """Each value once (values alike under same are one; with ranks, once per rank); a repeat is named by
    its key path."""
    seen: set[tuple[str, int | None]] = set()
    for (path, value), rank in itertools.zip_longest(values, ranks):
        key = same(value), rank
        if key in seen:
            raise ValueError(f"{path}: {value!r} is used twice")
        seen.add(key)


def _url_key(url: str) -> str:
    """url as an engine's address: host case and a default port do not make another engine."""
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}[parts.scheme]
    return f"{parts.scheme}://{parts.hostname}:{port}"


def data_parallel_ranks(instance: InstanceConfig) -> list[InstanceConfig]:
    """An engine's routing targets: itself, or one per data-parallel rank, reading that rank's events where
    vLLM publishes them (each rank's publisher offsets the configured ports by its rank)."""
    if instance.data_parallel_size == 1:
        return [instance]
    return [
        instance.model_copy(
            update={
                "name": f"{instance.name}-dp{rank}",
                "data_parallel_size": 1,
                "data_parallel_rank": rank,
                "events": rank_endpoint(instance.events, rank),
                "replay": rank_endpoint(instance.replay, rank),
            }
        )
        for rank in range(instance.data_parallel_size)
    ]


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Where vLLM's publisher of a data-parallel rank binds, given the configured TCP endpoint: its port +
    rank (vLLM 0.32's ZmqEventPublisher.offset_endpoint_port)."""
    if endpoint is None or rank == 0:
        return endpoint
    address, _, port = endpoint.rpartition(":")
    return f"{address}:{int(port) + rank}"


class ConfigError(Exception):
    """A configuration that cannot be used; the message names the file, the key path and the problem."""


def load_config(path: Path) -> RouterConfig:
    return parse_config(read_yaml(path), source=str(path))


def parse_config(raw: Any, source: str = "config") -> RouterConfig:
    return validated(RouterConfig, raw, source, "configuration")


def read_yaml(path: Path) -> Any:
    try:
        return strict_yaml.load(path.read_bytes().decode())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


Model = TypeVar("Model", bound=BaseModel)


def validated(model: type[Model], raw: Any, source: str, what: str) -> Model:
    """raw as model, or a ConfigError naming source, each bad key path and its problem."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid {what}\n" + format_errors(exc, model)) from exc


def format_errors(exc: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for error in exc.errors(include_url=False):
        path = ".".join(str(part) for part in error["loc"])
        message = suggested(error["msg"].removeprefix("Value error, "), model, error)
        lines.append(f"  {path}: {message}" if path else f"  {message}")
    return "\n".join(lines)
