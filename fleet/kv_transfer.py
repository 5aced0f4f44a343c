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

A MooncakeConnector decode leg naming a transfer its (live) prefill engine has not kept waits for it, as
vLLM's prefill side does: the prefill may still be running. A transfer that never comes (its prefill leg
aborted, or ended before its one token) is given up after VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s unless
the fleet's environment sets it, as vLLM reads it; the decode instance then computes the prompt itself
(tests/fixtures/vllm/pd_capture.json: a 200 after the prefiller's timeout).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Connector = Literal["nixl", "mooncake"]
Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
# How long a prefill keeps KV nobody fetched, and a decode leg waits for a transfer nobody kept: vLLM reads
# it from the environment, 480 s by default.
ABORT_TIMEOUT_ENV = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"
KEEP_S = 480.0


def abort_timeout_s() -> float:
    return float(os.environ.get(ABORT_TIMEOUT_ENV) or KEEP_S)


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
    def __init__(
        self, connector: Connector, clock: Callable[[], float] = time.monotonic, keep_s: float | None = None
    ) -> None:
        """keep_s: how long KV is kept for a decode leg and a decode leg waits for it; default: the
        environment's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, as vLLM's."""
        self.connector = connector
        self.keep_s = abort_timeout_s() if keep_s is None else keep_s
        self._clock = clock
        self._sides: dict[str, TransferSide] = {}  # by engine id, while its server runs
        self._kept: dict[tuple[str, str], _Kept] = {}  # by (engine id, transfer or request id)
        self._awaited: dict[tuple[str, str], asyncio.Future[_Kept]] = {}  # decode legs ahead of their KV

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
        kept = _Kept(tuple(token_ids), now + self.keep_s)
        if self.connector == "mooncake":
            transfer_id = params.get("transfer_id")
            if isinstance(transfer_id, str):
                awaited = self._awaited.pop((side.engine_id, transfer_id), None)
                if awaited is not None and not awaited.done():
                    awaited.set_result(kept)
                else:
                    self._kept[side.engine_id, transfer_id] = kept
            return None
        request_id = uuid.uuid4().hex
        self._kept[side.engine_id, request_id] = kept
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

    async def fetch(self, params: dict[str, Any], token_ids: list[int]) -> bool:
        """A decode leg fetches what its params name; False when it cannot (unknown or gone engine, another
        prompt's KV, a transfer that did not come in time): the engine then computes the prompt
        (kv_load_failure_policy recompute)."""
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
        if not reached or not isinstance(key, str):
            return False
        kept = self._kept.pop((side.engine_id, key), None)
        if kept is None and self.connector == "mooncake":
            kept = await self._arrival(side.engine_id, key)
        return kept is not None and kept.token_ids == tuple(token_ids)

    async def _arrival(self, engine_id: str, transfer_id: str) -> _Kept | None:
        """What a prefill leg keeps under transfer_id within keep_s, or None."""
        key = (engine_id, transfer_id)
        awaited = self._awaited.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(awaited), self.keep_s)
        except TimeoutError:
            return None
        finally:
            if self._awaited.get(key) is awaited:
                del self._awaited[key]
