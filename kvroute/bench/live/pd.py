"""``kvroute bench live`` on a prefill/decode disaggregated fleet: its shape, the configuration kvroute gets,
vllm-router's P/D mode, and where each target's prompt tokens were computed.

A fleet is disaggregated when its configuration has ``prefill`` or ``decode`` instances (``--pd P:D`` starts
a simulated one). vllm-router then runs with ``--vllm-pd-disaggregation``: every request has a prefill leg on
one of ``--prefill`` and its decode leg on one of ``--decode``, each stage choosing with its own policy (a
target's ``vllm-router:POLICY`` gives both POLICY through ``--policy``, as vllm-router's defaults do;
``vllm-router:PREFILL/DECODE`` gives each its own).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rich.table import Table

from router.config import InstanceConfig, RouterConfig

Connector = Literal["nixl", "mooncake"]
PD_TARGETS = (
    "kvroute:round-robin",
    "kvroute",
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
    "vllm-router:power_of_two",
    "vllm-router:kv_aware",
)
# vllm-router 0.1.17 hashes the prefill instances' KV events (--pd-kv-events) in blocks of 16 tokens, vLLM's
# default block size, whatever the engines use; a P/D fleet the benchmark starts uses 16 too, so kv_aware
# can match what they announce. Twice the blocks keep the fleet's KV capacity in tokens.
PD_BLOCK_TOKENS = 16
PD_KV_BLOCKS = 4096
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_BY_SOURCE = "vllm:prompt_tokens_by_source_total"


class NoPDMode(Exception):
    """vllm-router's P/D mode cannot run against this fleet; the message says why."""


@dataclass(frozen=True)
class PDShape:
    prefill: int
    decode: int
    connector: Connector = "nixl"

    @property
    def instances(self) -> int:
        return self.prefill + self.decode

    @property
    def roles(self) -> list[str]:
        return ["prefill"] * self.prefill + ["decode"] * self.decode


def pd_fleet_args(shape: PDShape, bootstrap_port: int) -> list[str]:
    """``kvroute fleet`` options for the shape; instance i's MooncakeConnector bootstrap port is + i."""
    return [
        "--roles",
        ",".join(shape.roles),
        "--kv-connector",
        shape.connector,
        "--bootstrap-port",
        str(bootstrap_port),
        "--block-size",
        str(PD_BLOCK_TOKENS),
        "--kv-blocks",
        str(PD_KV_BLOCKS),
    ]


def pd_router_config(raw: dict[str, Any], shape: PDShape, bootstrap_port: int) -> dict[str, Any]:
    """The simulated fleet's configuration with its roles and connector; with MooncakeConnector, the prefill
    instances' engine ids (the fleet's instance names) and bootstrap servers."""
    instances = []
    for index, (instance, role) in enumerate(zip(raw["instances"], shape.roles, strict=True)):
        instance = {**instance, "role": role}
        if shape.connector == "mooncake" and role == "prefill":
            host = instance["url"].rpartition(":")[0]
            bootstrap = f"{host}:{bootstrap_port + index}"
            instance |= {"kv_engine_id": instance["name"], "kv_bootstrap_url": bootstrap}
        instances.append(instance)
    return {**raw, "instances": instances, "disaggregation": {"connector": shape.connector}}


def is_disaggregated(config: RouterConfig) -> bool:
    return bool(config.disaggregated_models())


def stage_policies(policy: str) -> tuple[str, str]:
    """``POLICY`` (both stages) or ``PREFILL/DECODE``."""
    prefill, _, decode = policy.partition("/")
    return prefill, decode or prefill


def vllm_router_pd_args(config: RouterConfig, policy: str) -> list[str]:
    """vllm-router 0.1.17's P/D mode over the fleet's prefill and decode instances (``both`` ones in each)."""
    prefill = [i for i in config.instances if i.role != "decode"]
    decode = [i for i in config.instances if i.role != "prefill"]
    connector = config.disaggregation.connector
    args = ["--vllm-pd-disaggregation", "--kv-connector", connector]
    for instance in prefill:
        args += ["--prefill", instance.url, _bootstrap_port(instance) if connector == "mooncake" else "none"]
    for instance in decode:
        args += ["--decode", instance.url]
    prefill_policy, decode_policy = stage_policies(policy)
    if prefill_policy == decode_policy:
        args += ["--policy", prefill_policy]
    else:
        args += ["--prefill-policy", prefill_policy, "--decode-policy", decode_policy]
    if prefill_policy == "kv_aware":
        args += _prefill_events(config, prefill)
    return args


def _bootstrap_port(instance: InstanceConfig) -> str:
    """vllm-router asks ``http://<prefill host>:PORT/query`` for the engine ids at startup, and fails to
    start after 30 tries; ask first, so a fleet without a bootstrap server is named at once."""
    url = instance.kv_bootstrap_url
    if url is None:
        raise NoPDMode(f"{instance.name}: no kv_bootstrap_url for vllm-router's MooncakeConnector mode")
    try:
        urllib.request.urlopen(url + "/query", timeout=2).close()
    except (urllib.error.URLError, OSError) as exc:
        raise NoPDMode(
            f"vllm-router's MooncakeConnector mode asks every prefill instance's bootstrap server for its "
            f"engine ids at startup; {url}/query does not answer ({exc}); the simulated fleet has no "
            "bootstrap server: use --kv-connector nixl"
        ) from exc
    return url.rpartition(":")[2].rstrip("/")


def _prefill_events(config: RouterConfig, prefill: Sequence[InstanceConfig]) -> list[str]:
    if config.block_size != PD_BLOCK_TOKENS:
        raise NoPDMode(
            f"vllm-router's kv_aware prefill policy hashes {PD_BLOCK_TOKENS}-token blocks; the fleet's are "
            f"{config.block_size}"
        )
    missing = [i.name for i in prefill if not i.events]
    if missing:
        raise NoPDMode(f"kv_aware needs every prefill instance's events; missing: {', '.join(missing)}")
    args = []
    for instance in prefill:
        args += ["--pd-kv-events", f"{instance.url}={instance.events}"]
    return [*args, "--kv-event-model", config.models[0].name]


def tokens_by_source(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> dict[str, float]:
    """One instance's ``vllm:prompt_tokens_by_source_total``, summed over its engines."""
    sums: dict[str, float] = {}
    for name, labels, value in samples:
        if name == _BY_SOURCE and labels.get("source") in SOURCES:
            sums[labels["source"]] = sums.get(labels["source"], 0.0) + value
    return sums


def tokens_by_role(
    config: RouterConfig, before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, int]]:
    """Prompt tokens each role's instances computed, found cached and fetched from another, over the run."""
    roles: dict[str, dict[str, int]] = {}
    for instance in config.instances:
        ended, started = after.get(instance.name, {}), before.get(instance.name, {})
        counts = roles.setdefault(instance.role, dict.fromkeys(SOURCES, 0))
        for source in SOURCES:
            counts[source] += round(ended.get(source, 0.0) - started.get(source, 0.0))
    return roles


def pd_paths(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> dict[str, float]:
    """Requests by path, from a router's own counters: kvroute's ``kvroute_pd_requests_total{path}``;
    vllm-router sends every request through a prefill leg (``vllm_router_pd_prefill_requests_total``)."""
    paths: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "kvroute_pd_requests_total":
            paths[labels["path"]] = paths.get(labels["path"], 0.0) + value
        elif name == "vllm_router_pd_prefill_requests_total":
            paths["disaggregated"] = paths.get("disaggregated", 0.0) + value
    return paths


class PDResult(Protocol):
    target: str
    skipped: str
    prompt_tokens_by_role: dict[str, dict[str, int]]
    pd_paths: dict[str, int]


def render_pd_table(results: Sequence[PDResult]) -> Table:
    """Where each target's prompt tokens were computed, found cached or fetched, by the instances' role."""
    table = Table(
        title="prompt tokens by instance role (vllm:prompt_tokens_by_source)",
        caption="computed: local_compute; cached: local_cache_hit; fetched: external_kv_transfer from a "
        "prefill instance; paths: the router's own counts (kvroute_pd_requests_total, "
        "vllm_router_pd_prefill_requests_total)",
    )
    columns = (
        "target",
        "computed on prefill",
        "computed on decode",
        "fetched",
        "cached on prefill",
        "cached on decode",
        "paths",
    )
    for column in columns:
        table.add_column(column, no_wrap=column == "target")
    for r in results:
        if r.skipped:
            table.add_row(r.target, *["-"] * 5, "skipped")
            continue
        prefill = r.prompt_tokens_by_role.get("prefill", {})
        decode = r.prompt_tokens_by_role.get("decode", {})
        counts = (
            prefill.get("local_compute", 0),
            decode.get("local_compute", 0),
            decode.get("external_kv_transfer", 0),
            prefill.get("local_cache_hit", 0),
            decode.get("local_cache_hit", 0),
        )
        paths = ", ".join(f"{path} {count}" for path, count in sorted(r.pd_paths.items()))
        table.add_row(r.target, *(f"{count:,}" for count in counts), paths or "-")
    return table
