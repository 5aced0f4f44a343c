"""Prefill-to-decode KV transfer in the simulated fleet: each connector's protocol, and KV that is gone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleet.block_pool import BlockHasher, BlockPool
from fleet.engine import Engine, EngineTiming
from fleet.kv_transfer import ABORT_TIMEOUT_ENV, KEEP_S, KVTransfers, TransferSide
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
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_engine_id": side.engine_id,
        "remote_bootstrap_addr": side.bootstrap_url,
    }


def _fetch(transfers: KVTransfers, params: dict[str, Any], prompt: list[int] = PROMPT) -> bool:
    return asyncio.run(transfers.fetch(params, prompt))


def test_mooncake_prefill_answers_null_and_the_decode_leg_names_the_transfer() -> None:
    transfers = KVTransfers("mooncake", keep_s=0.01)
    transfers.serve(PREFILL)
    assert transfers.keep(PREFILL, {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT) is None
    wrong_bootstrap = {**_mooncake_decode_params("t1"), "remote_bootstrap_addr": "http://127.0.0.1:1"}
    assert not _fetch(transfers, wrong_bootstrap)
    assert not _fetch(transfers, _mooncake_decode_params("t2"))  # after keep_s
    assert not _fetch(transfers, _mooncake_decode_params("t1"), PROMPT[:-1])  # another prompt's KV
    transfers.keep(PREFILL, {"do_remote_decode": True, "transfer_id": "t3"}, PROMPT)
    assert _fetch(transfers, _mooncake_decode_params("t3"))
    assert not _fetch(transfers, _mooncake_decode_params("t3"))  # fetched once


def test_a_mooncake_decode_leg_waits_for_its_transfer_until_keep_s() -> None:
    """As vLLM's prefill side waits for a transfer it does not know yet: its prefill may still be running."""

    async def run() -> tuple[bool, bool, float]:
        transfers = KVTransfers("mooncake", keep_s=0.3)
        transfers.serve(PREFILL)
        early = asyncio.create_task(transfers.fetch(_mooncake_decode_params("late"), PROMPT))
        await asyncio.sleep(0.05)
        waiting = not early.done()
        transfers.keep(PREFILL, {"do_remote_decode": True, "transfer_id": "late"}, PROMPT)
        started = time.monotonic()
        fetched = await early and not await transfers.fetch(_mooncake_decode_params("never"), PROMPT)
        return waiting, fetched, time.monotonic() - started

    waiting, fetched, given_up_after = asyncio.run(run())
    assert waiting and fetched
    assert 0.3 <= given_up_after < 2


def test_keep_s_is_vllms_abort_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ABORT_TIMEOUT_ENV, raising=False)
    assert KVTransfers("mooncake").keep_s == KEEP_S == 480
    monkeypatch.setenv(ABORT_TIMEOUT_ENV, "7")
    assert KVTransfers("mooncake").keep_s == 7


def test_nixl_prefill_answer_carries_what_the_decode_leg_sends_back() -> None:
    transfers = KVTransfers("nixl")
    transfers.serve(PREFILL)
    params = transfers.keep(PREFILL, {"do_remote_decode": True}, PROMPT)
    assert params is not None
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == (
        "p0",
        "127.0.0.1",
        8101,
    )
    assert {"remote_block_ids", "remote_request_id", "tp_size"} <= params.keys()
    assert _fetch(transfers, params)
    assert not _fetch(transfers, params)


def test_kv_of_a_stopped_instance_or_kept_too_long_cannot_be_fetched() -> None:
    clock = ManualClock()
    transfers = KVTransfers("mooncake", clock, keep_s=0.01)
    transfers.serve(PREFILL)
    transfers.keep(PREFILL, {"transfer_id": "gone"}, PROMPT)
    transfers.stop("p0")
    transfers.serve(PREFILL)  # back, without what it kept
    assert not _fetch(transfers, _mooncake_decode_params("gone"))
    transfers.keep(PREFILL, {"transfer_id": "old"}, PROMPT)
    clock.now += transfers.keep_s + 1
    transfers.keep(PREFILL, {"transfer_id": "new"}, PROMPT)  # keeping prunes what expired
    assert not _fetch(transfers, _mooncake_decode_params("old"))
    assert _fetch(transfers, _mooncake_decode_params("new"))


def test_fleet_options_name_each_instances_transfer_side(tmp_path: Path) -> None:
    options = FleetOptions(tmp_path, instances=2, port=9100, bootstrap_port=9200, roles=("prefill", "decode"))
    assert options.transfer_side(1) == TransferSide(
        "fleet-1", "http://127.0.0.1:9201", "127.0.0.1", 9101, "decode"
    )


def test_a_decode_leg_whose_kv_is_gone_is_computed_not_hung(tokenizer: PromptTokenizer) -> None:
    """The prefill instance died after its leg: the decode instance computes the prompt itself (vLLM's
    kv_load_failure_policy recompute) and answers."""

    async def run() -> tuple[int, dict[str, Any], Engine]:
        transfers = KVTransfers("mooncake")
        engine = Engine(BlockPool(256, 32, True), EngineTiming(prefill_tokens_per_s=1e6), BlockHasher("0"))
        instance = SimInstance(
            "d0",
            "tiny-llama",
            [engine],
            tokenizer,
            printable_token_ids(tokenizer),
            4096,
            0,
            transfer=DECODE,
            transfers=transfers,
        )
        task = asyncio.create_task(engine.run())
        port = free_port_block(1)
        try:
            async with serve(instance, "127.0.0.1", port), aiohttp.ClientSession() as session:
                body = {
                    "model": "tiny-llama",
                    "prompt": "hello " * 200,
                    "max_tokens": 2,
                    "kv_transfer_params": _mooncake_decode_params("never-kept"),
                }
                async with asyncio.timeout(10):
                    response = await session.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                    return response.status, await response.json(), engine
        finally:
            task.cancel()

    status, answer, engine = asyncio.run(run())
    assert status == 200
    prompt = answer["usage"]["prompt_tokens"]
    assert engine.stats.prompt_tokens_by_source == {
        "local_compute": prompt,
        "local_cache_hit": 0,
        "external_kv_transfer": 0,
    }
    # As vLLM counts a load that fails (tests/fixtures/vllm/pd_capture.json): a hit when planned, and the
    # prompt, holding nothing valid, looked up again.
    stats = engine.stats
    assert stats.external_prefix_cache_hits == prompt
    assert stats.external_prefix_cache_queries == stats.prefix_cache_queries == 2 * prompt


@pytest.mark.parametrize("role", ["prefill", "both"])
def test_only_kv_producers_keep_for_a_remote_decode(role: str) -> None:
    side = TransferSide("x", "http://127.0.0.1:1", "127.0.0.1", 1, role)  # type: ignore[arg-type]
    assert side.produces and side.consumes == (role == "both")
