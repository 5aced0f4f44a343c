"""vLLM's MooncakeConnector as the stacks run it: on hosts without an accelerator and in a MultiConnector.

`{"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kvconnectors.mooncake", ...}` in
--kv-transfer-config. It differs from vLLM 0.32's own in two ways and no other:

- Its worker asks torch for the current accelerator's index, which raises where there is none (the CPU build
  of torch); there it is told 0, which `CpuPlatform.set_device` ignores.
- It has Prometheus metrics that record nothing: MultiConnector asserts that every child reporting transfer
  stats has some, and the first transfer would otherwise kill the API server.

The class keeps vLLM's name: MultiConnector files stats and metrics under the class name, and turns stats
back into objects through the connector registered under that name (vLLM's own, which is the same for stats).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig


class MooncakeConnector(mooncake_connector.MooncakeConnector):  # type: ignore[misc]
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        with _device_index_zero_without_accelerator():
            super().__init__(vllm_config, role, kv_cache_config)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return NoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class NoPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        pass


@contextlib.contextmanager
def _device_index_zero_without_accelerator() -> Iterator[None]:
    if torch.accelerator.is_available():
        yield
        return
    current_device_index = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = lambda: 0
    try:
        yield
    finally:
        torch.accelerator.current_device_index = current_device_index
