"""Prefill-to-decode KV transfer in the simulated fleet: each connector's protocol, and KV that is gone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleet.block_pool import BlockHasher, BlockPool
from fleet.engine import Engine, EngineTiming
from fleet.kv_transfer import KEEP_S, KVTransfers, TransferSide
from fleet.launcher import FleetOptions
from fleet.sampling import printable_token_ids
from fleet.server import SimInstance, serve
from kvroute.processes import free_port_block
from router.prompt.tokenization import PromptTokenizer
from tests.conftest import ManualClock

PROMPT = list(range(100, 400))
PREFILL = TransferSide("p0", "http://127.0.0.1:8998", "127.0.0.1", 8101, "prefill")
DECODE = TransferSide("d0", "http://127.0.0.1:8999", "127.0.0.1", 8102, "decode")


def _mooncake_decode_params(transfer_id: str, side: TransferSide = PREFILL) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
            "remote_engine_id": side.engine_id, "remote_bootstrap_addr": side.bootstrap_url}  # fmt: skip


def test_mooncake_prefill_answers_null_and_the_decode_leg_names_the_transfer() -> None:
    transfers = KVTransfers("mooncake")
    transfers.serve(PREFILL)
    assert transfers.keep(PREFILL, {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT) is None
    wrong_bootstrap = {**_mooncake_decode_params("t1"), "remote_bootstrap_addr": "http://127.0.0.1:1"}
    assert not transfers.fetch(wrong_bootstrap, PROMPT)
    assert not transfers.fetch(_mooncake_decode_params("t2"), PROMPT)
    assert not transfers.fetch(_mooncake_decode_params("t1"), PROMPT[:-1])  # another prompt's KV
    transfers.keep(PREFILL, {"do_remote_decode": True, "transfer_id": "t3"}, PROMPT)
    assert transfers.fetch(_mooncake_decode_params("t3"), PROMPT)
    assert not transfers.fetch(_mooncake_decode_params("t3"), PROMPT)  # fetched once


def test_nixl_prefill_answer_carries_what_the_decode_leg_sends_back() -> None:
    transfers = KVTransfers("nixl")
    transfers.serve(PREFILL)
    params = transfers.keep(PREFILL, {"do_remote_decode": True}, PROMPT)
    assert params is not None
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == ("p0", "127.0.0.1", 8101)
    assert {"remote_block_ids", "remote_request_id", "tp_size"} <= params.keys()
    assert transfers.fetch(params, PROMPT)
    assert not transfers.fetch(params, PROMPT)


def test_kv_of_a_stopped_instance_or_kept_too_long_cannot_be_fetched() -> None:
    clock = ManualClock()
    transfers = KVTransfers("mooncake", clock)
    transfers.serve(PREFILL)
    transfers.keep(PREFILL, {"transfer_id": "gone"}, PROMPT)
    transfers.stop("p0")
    transfers.serve(PREFILL)  # back, without what it kept
    assert not transfers.fetch(_mooncake_decode_params("gone"), PROMPT)
    transfers.keep(PREFILL, {"transfer_id": "old"}, PROMPT)
    clock.now += KEEP_S + 1
    transfers.keep(PREFILL, {"transfer_id": "new"}, PROMPT)  # keeping prunes what expired
    assert not transfers.fetch(_mooncake_decode_params("old"), PROMPT)
    assert transfers.fetch(_mooncake_decode_params("new"), PROMPT)


def test_fleet_options_name_each_instances_transfer_side(tmp_path: Path) -> None:
    options = FleetOptions(tmp_path, instances=2, port=9100, bootstrap_port=9200, roles=("prefill", "decode"))
    assert options.transfer_side(1) == TransferSide("fleet-1", "http://127.0.0.1:9201", "127.0.0.1", 9101, "decode")


def test_a_decode_leg_whose_kv_is_gone_is_computed_not_hung(tokenizer: PromptTokenizer) -> None:
    """The prefill instance died after its leg: the decode instance computes the prompt itself (vLLM's
    kv_load_failure_policy recompute) and answers."""

    async def run() -> tuple[int, dict[str, Any], Engine]:
        transfers = KVTransfers("mooncake")
        engine = Engine(BlockPool(256, 32, True), EngineTiming(prefill_tokens_per_s=1e6), BlockHasher("0"))
        instance = SimInstance("d0", "tiny-llama", [engine], tokenizer, printable_token_ids(tokenizer), 4096, 0,
                               transfer=DECODE, transfers=transfers)  # fmt: skip
        task = asyncio.create_task(engine.run())
        port = free_port_block(1)
        try:
            async with serve(instance, "127.0.0.1", port), aiohttp.ClientSession() as session:
                body = {"model": "tiny-llama", "prompt": "hello " * 200, "max_tokens": 2,
                        "kv_transfer_params": _mooncake_decode_params("never-kept")}  # fmt: skip
                async with asyncio.timeout(10):
                    response = await session.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                    return response.status, await response.json(), engine
        finally:
            task.cancel()

    status, answer, engine = asyncio.run(run())
    assert status == 200
    prompt = answer["usage"]["prompt_tokens"]
    assert engine.stats.prompt_tokens_by_source == {"local_compute": prompt, "local_cache_hit": 0, "external_kv_transfer": 0}


@pytest.mark.parametrize("role", ["prefill", "both"])
def test_only_kv_producers_keep_for_a_remote_decode(role: str) -> None:
    side = TransferSide("x", "http://127.0.0.1:1", "127.0.0.1", 1, role)  # type: ignore[arg-type]
    assert side.produces and side.consumes == (role == "both")
