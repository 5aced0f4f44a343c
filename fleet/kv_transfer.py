"""Prefill-to-decode KV transfer between simulated instances, as vLLM 0.32's connectors speak it.

A prefill instance (a KV producer) asked for a remote decode (`kv_transfer_params.do_remote_decode`) keeps the
prompt's KV after answering its one token; a decode instance (a KV consumer) asked for a remote prefill
(`do_remote_prefill`) fetches it instead of computing it:
- NixlConnector: the prefill answer's `kv_transfer_params` name the engine, its side channel and the request
  whose blocks to read; the decode leg sends them back as they came.
- MooncakeConnector: the prefill answer's are null; both legs carry the caller's `transfer_id`, and the decode
  leg names the prefill engine's id and bootstrap server (`remote_bootstrap_addr`, http://HOST:PORT).
The instances of one fleet share a process, so the KV "moves" through this registry; the decode instance
spends the transfer's time per token (EngineTiming.transfer_tokens_per_s).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Connector = Literal["nixl", "mooncake"]
Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
# How long a prefill keeps KV nobody fetched: MooncakeConnector's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT default.
KEEP_S = 480.0


@dataclass(frozen=True)
class TransferSide:
    """One instance's end of the transfer: how decode legs name it."""

    engine_id: str
    bootstrap_url: str  # MooncakeConnector's bootstrap server
    host: str  # NixlConnector's side channel
    port: int
    role: Role = "both"

    @property
    def produces(self) -> bool:
        return self.role != "decode"

    @property
    def consumes(self) -> bool:
        return self.role != "prefill"


@dataclass(frozen=True)
class _Kept:
    token_ids: tuple[int, ...]
    until: float


class KVTransfers:
    def __init__(self, connector: Connector, clock: Callable[[], float] = time.monotonic) -> None:
        self.connector = connector
        self._clock = clock
        self._sides: dict[str, TransferSide] = {}  # by engine id, while its server runs
        self._kept: dict[tuple[str, str], _Kept] = {}  # by (engine id, transfer or request id)

    def serve(self, side: TransferSide) -> None:
        self._sides[side.engine_id] = side

    def stop(self, engine_id: str) -> None:
        """The instance went away: its kept KV went with it."""
        self._sides.pop(engine_id, None)
        for key in [key for key in self._kept if key[0] == engine_id]:
            del self._kept[key]

    def keep(self, side: TransferSide, params: dict[str, Any], token_ids: list[int]) -> dict[str, Any] | None:
        """A prefill leg is done: keep its prompt's KV; the answer's kv_transfer_params."""
        now = self._clock()
        for key in [key for key, kept in self._kept.items() if kept.until < now]:
            del self._kept[key]
        if self.connector == "mooncake":
            transfer_id = params.get("transfer_id")
            if isinstance(transfer_id, str):
                self._kept[side.engine_id, transfer_id] = _Kept(tuple(token_ids), now + KEEP_S)
            return None
        request_id = uuid.uuid4().hex
        self._kept[side.engine_id, request_id] = _Kept(tuple(token_ids), now + KEEP_S)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(len(token_ids) // 16 + 1)),
            "remote_engine_id": side.engine_id,
            "remote_request_id": request_id,
            "remote_host": side.host,
            "remote_port": side.port,
            "tp_size": 1,
            "remote_num_tokens": len(token_ids),
        }

    def fetch(self, params: dict[str, Any], token_ids: list[int]) -> bool:
        """A decode leg fetches what its params name; False when it cannot (unknown or gone engine or
        transfer, another prompt's KV): the engine then computes the prompt (kv_load_failure_policy
        recompute)."""
        engine_id = params.get("remote_engine_id")
        side = self._sides.get(engine_id) if isinstance(engine_id, str) else None
        if side is None:
            return False
        if self.connector == "mooncake":
            key = params.get("transfer_id")
            reached = params.get("remote_bootstrap_addr") == side.bootstrap_url
        else:
            key = params.get("remote_request_id")
            reached = (params.get("remote_host"), params.get("remote_port")) == (side.host, side.port)
        kept = self._kept.pop((side.engine_id, key), None) if reached and isinstance(key, str) else None
        return kept is not None and kept.token_ids == tuple(token_ids)
