"""Pool credit confirmed against a real mooncake_master: kept while the pool holds the blocks, cut where it
does not, and switched off while the master does not answer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvroute.processes import free_port_block
from router.apis.openai_body import CompletionRequest
from router.config import ModelConfig
from router.dispatch.decide.decision import Decider, DeciderOptions
from router.index import matching
from router.index.block_index import BlockIndex
from router.index.figures import figures_of
from router.index.index_host import IndexHost
from router.index.pool import IndexOnlyMatches, MasterLookup, PoolConfirmer, key_start, pool_key
from router.index.remote_index import RemoteIndex
from router.metrics import RouterMetrics
from scorers.request import TierMatch
from tests.router.index.test_block_index import (
    BS,
    OTHER_TOKENS,
    TOKENS,
    pooled,
    prompt,
    removed,
    stored,
    vllm_hash,
)

ROOT = Path(__file__).resolve().parents[3]
STACK_PYTHON = Path(os.environ.get("KVROUTE_STACK_PYTHON", ROOT / ".venv-stack" / "bin" / "python"))
A, B = ("a", 0), ("b", 0)


@dataclass(frozen=True)
class Master:
    rpc: str
    admin_url: str


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    binary = STACK_PYTHON.parent / "mooncake_master"
    if not binary.exists():
        pytest.fail(f"{binary} is missing: `make stack-env` installs the stack")
    base = free_port_block(2)
    log = (tmp_path_factory.mktemp("master") / "master.log").open("wb")
    process = subprocess.Popen(
        [
            str(binary),
            "--rpc_address",
            "127.0.0.1",
            "--rpc_port",
            str(base),
            "--metrics_host",
            "127.0.0.1",
            "--metrics_port",
            str(base + 1),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        admin = f"http://127.0.0.1:{base + 1}"
        _wait_up(process, admin + "/health")
        yield Master(f"127.0.0.1:{base}", admin)
    finally:
        _stop(process)
        log.close()


def _wait_up(process: subprocess.Popen[bytes], url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "mooncake_master exited at start-up"
        with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(url, timeout=1):
            return
        time.sleep(0.1)
    raise AssertionError(f"mooncake_master not up at {url} after {timeout_s:.0f}s")


def metric_value(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def key_of(position: int, pool_name: str = "model") -> str:
    full = vllm_hash(position, as_bytes=True)
    assert isinstance(full, bytes)
    return pool_key(pool_name, full)


@contextlib.contextmanager
def pool_holding(master: Master, positions: range, pool_name: str = "model") -> Iterator[None]:
    """A pool client that put pool_name's blocks at positions and keeps them while the block runs."""
    keys = [key_of(p, pool_name) for p in positions]
    client = subprocess.Popen(
        [str(STACK_PYTHON), str(ROOT / "scripts" / "pool_put.py"), master.rpc, *keys],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline() == b"ready\n", "the pool client could not put its objects"
        yield
    finally:
        assert client.stdin is not None
        client.stdin.close()
        try:
            client.wait(10)
        except subprocess.TimeoutExpired:
            _stop(client)


POOL_NAMES = {"tiny-llama": "model", "llama-8b": "Llama-3.1-8B", "llama-70b": "Llama-3.1-70B"}


def confirm(
    index: BlockIndex,
    url: str,
    metrics: RouterMetrics,
    models: tuple[str, ...] = ("tiny-llama",),
    pool_names: Mapping[str, str] = POOL_NAMES,
) -> list[dict[str, TierMatch]]:
    """The confirmed matches of a request for each of models in turn."""

    async def run() -> list[dict[str, TierMatch]]:
        async with aiohttp.ClientSession() as session:
            confirmer = PoolConfirmer(index, MasterLookup(url, session, timeout_s=2.0), pool_names, metrics)
            chain = prompt()
            return [await confirmer.matches(model, chain) for model in models]

    return asyncio.run(run())


def indexed() -> BlockIndex:
    """A holds blocks 0-1 itself and wrote 0-5 to the pool; B wrote something else there (a member too)."""
    index = BlockIndex(BS)
    index.set_pool_name("a", "model")
    index.set_pool_name("b", "model")
    index.apply(A, [stored(0, 2, as_bytes=True), pooled(0, 6)])
    index.apply(B, [pooled(0, 1, salt=9, tokens=OTHER_TOKENS)])
    return index


def test_pool_credit_stops_where_the_master_no_longer_has_the_blocks(master: Master) -> None:
    index, metrics = indexed(), RouterMetrics()
    with pool_holding(master, range(4)):
        [matches] = confirm(index, master.admin_url, metrics)
    assert matches == {"a": TierMatch(gpu=2, pool=2), "b": TierMatch(pool=4)}
    assert index.pool_entries == 4 + 1  # blocks 4 and 5 left the index; B's own block was not asked about
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="gone") == 2
    assert metric_value(metrics, "kvroute_pool_master_up") == 1


def test_pool_credit_is_confirmed_under_the_connectors_cache_prefix_and_store_namespace(
    master: Master,
) -> None:
    """With a cache_prefix and a store namespace the connector's keys start with more than the model's name:
    stated in the model's config, the router asks for those keys and keeps the credit the pool holds."""
    model = ModelConfig(
        name="tiny-llama",
        pool_name="model",
        pool_cache_prefix="team-a",
        pool_store_namespace="@store_pp:1@store_format:tp_shared_mqa",
    )
    start, metrics = key_start(model), RouterMetrics()
    index = BlockIndex(BS)
    index.set_pool_name("a", start)
    index.apply(A, [stored(0, 2, as_bytes=True), pooled(0, 6)])
    with pool_holding(master, range(6), start):
        assert confirm(index, master.admin_url, metrics, pool_names={"tiny-llama": start}) == [
            {"a": TierMatch(gpu=2, pool=4)}
        ]
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="present") == 4


@contextlib.asynccontextmanager
async def in_process_master(
    present: bool, meanwhile: Callable[[], object] = lambda: None
) -> AsyncIterator[str]:
    """A master on this event loop that says every key asked about is there (or that none is), once meanwhile
    (what happens while it is asked) has run; yields its URL."""

    async def batch_query_keys(request: web.Request) -> web.Response:
        meanwhile()
        keys = request.query["keys"].split(",")
        return web.json_response({"success": True, "data": {key: {"ok": present} for key in keys}})

    app = web.Application()
    app.router.add_get("/batch_query_keys", batch_query_keys)
    async with TestServer(app, host="127.0.0.1") as server:
        yield str(server.make_url("/"))


def test_a_block_announced_again_while_the_master_is_asked_stays() -> None:
    """B wrote block 4 to the pool again, and its event arrived while the master was being asked: the master's
    "missing", given before that write, leaves the new copy in the index; the other blocks it denied go."""
    index, metrics = indexed(), RouterMetrics()

    async def run() -> dict[str, TierMatch]:
        meanwhile = lambda: index.apply(B, [pooled(4, 1)])  # noqa: E731
        async with in_process_master(False, meanwhile) as url, aiohttp.ClientSession() as session:
            return await PoolConfirmer(
                index, MasterLookup(url, session, timeout_s=2.0), POOL_NAMES, metrics
            ).matches("tiny-llama", prompt())

    assert asyncio.run(run()) == {"a": TierMatch(gpu=2)}
    assert index.pooled(prompt(), 0, 10, "model") == [(4, vllm_hash(4, as_bytes=True))]
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="gone") == 6


class PromptTokens:
    """A local tokenizer that reads every completion prompt as TOKENS, the blocks of prompt()."""

    def completion_ids(self, prompt: object, add_special_tokens: bool) -> list[int]:
        return list(TOKENS)


def test_a_decision_with_pool_credit_probes_the_index_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The own prefixes the pool confirmation begins from come from the probe of the matches themselves: one
    look at each tier's holders per decision, and the same matches."""
    index, metrics = indexed(), RouterMetrics()
    probes: list[int] = []
    held = matching.holder_masks

    def counting(chain: Sequence[int], *maps: dict[int, int]) -> list[int] | None:
        probes.append(len(maps))
        return held(chain, *maps)

    monkeypatch.setattr(matching, "holder_masks", counting)

    async def run() -> dict[str, TierMatch]:
        async with in_process_master(True) as url, aiohttp.ClientSession() as session:
            pool = PoolConfirmer(index, MasterLookup(url, session, timeout_s=2.0), POOL_NAMES, metrics)
            router = Decider(
                index, {"tiny-llama": PromptTokens()}, BS, metrics, options=DeciderOptions(pool=pool)
            )  # type: ignore[dict-item]
            body = CompletionRequest(prompt="the prompt", model="tiny-llama")
            return (await router.prepare(body, None)).request.matches

    assert asyncio.run(run()) == {"a": TierMatch(gpu=2, pool=4), "b": TierMatch(pool=6)}
    assert len(probes) == 3  # GPU (with speculative entries), CPU, pool
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="present") == 6


def test_confirmed_blocks_are_trusted_for_a_while(master: Master) -> None:
    index, metrics = indexed(), RouterMetrics()

    async def twice() -> None:
        async with aiohttp.ClientSession() as session:
            confirmer = PoolConfirmer(
                index,
                MasterLookup(master.admin_url, session, timeout_s=2.0),
                {"tiny-llama": "model"},
                metrics,
                confirm_ttl_s=60,
            )
            chain = prompt()
            with pool_holding(master, range(6)):
                assert (await confirmer.matches("tiny-llama", chain))["b"] == TierMatch(pool=6)
            # The pool client is gone and its objects with it, but the answer of a moment ago stands.
            assert (await confirmer.matches("tiny-llama", chain))["b"] == TierMatch(pool=6)

    asyncio.run(twice())
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="present") == 6


def test_an_unreachable_master_means_routing_without_pool_credit() -> None:
    index, metrics = indexed(), RouterMetrics()
    closed = f"http://127.0.0.1:{free_port_block(1)}"
    assert confirm(index, closed, metrics) == [{"a": TierMatch(gpu=2)}]
    assert index.pool_entries == 7  # nothing is forgotten on no answer
    assert metric_value(metrics, "kvroute_pool_master_up") == 0
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="error") == 6


def test_a_denial_for_one_model_leaves_the_pool_blocks_of_another_with_the_same_tokenizer(
    master: Master,
) -> None:
    """An 8B and a 70B of one family share a tokenizer, a system prompt and the pool: A (8B) wrote blocks 0-5,
    B (70B) blocks 0-3, which the pool has since evicted. The master's no for the 70B's keys cuts B's credit
    only, and A's blocks still count for A's model."""
    index, metrics = BlockIndex(BS), RouterMetrics()
    index.set_pool_name("a", "Llama-3.1-8B")
    index.set_pool_name("b", "Llama-3.1-70B")
    index.apply(A, [stored(0, 2, as_bytes=True), pooled(0, 6)])
    index.apply(B, [pooled(0, 4)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=2, pool=4), "b": TierMatch(pool=4)}
    with pool_holding(master, range(6), "Llama-3.1-8B"):
        for_70b, for_8b = confirm(index, master.admin_url, metrics, ("llama-70b", "llama-8b"))
    assert for_70b == {"a": TierMatch(gpu=2, pool=4)}  # a does not serve the 70B: its credit is not asked
    assert for_8b == {"a": TierMatch(gpu=2, pool=4)}
    assert index.pool_entries == 6
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="gone") == 4  # B's 0-3
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="present") == 4  # A's credit, 2-5


def test_pool_credit_between_blocks_an_instance_holds_is_confirmed_too(master: Master) -> None:
    """A held blocks 0-2 on its GPU and wrote them to the pool, offloaded block 2 to its CPU, then evicted
    blocks 2 and 1 from its GPU: block 1 is credited to the pool between a GPU block and a CPU block. The
    master has none of them."""
    index, metrics = BlockIndex(BS), RouterMetrics()
    index.set_pool_name("a", "model")
    index.apply(A, [stored(0, 3, as_bytes=True), pooled(0, 3), stored(2, 1, medium="CPU", as_bytes=True)])
    index.apply(A, [removed(2, 1)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=1, cpu=1, pool=1)}
    assert confirm(index, master.admin_url, metrics) == [{"a": TierMatch(gpu=1)}]
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="gone") == 2  # blocks 1 and 2


def test_a_worker_of_several_gets_the_pool_credit_its_index_host_confirmed(
    master: Master, tmp_path: Path
) -> None:
    """Under serve --workers the index host asks the master: a worker's lookup that wants pool credit
    confirmed gets it as a lone router would, one that does not gets the index's entries as they stand."""
    index, metrics = indexed(), RouterMetrics()
    path, chain = str(tmp_path / "index"), prompt()

    async def run() -> tuple[Mapping[str, TierMatch], Mapping[str, TierMatch], Mapping[str, TierMatch]]:
        async with aiohttp.ClientSession() as session:
            lookup = MasterLookup(master.admin_url, session, timeout_s=2.0)
            confirmer = PoolConfirmer(index, lookup, POOL_NAMES, metrics)
            as_indexed = IndexOnlyMatches(index)
            host = IndexHost(
                index, confirmer, as_indexed, lambda: figures_of(index, []), metrics, time.monotonic
            )
            remote = RemoteIndex(path, metrics, timeout_s=5.0)
            tasks = [asyncio.create_task(host.serve(path)), asyncio.create_task(remote.run())]
            try:
                async with asyncio.timeout(10):
                    # until the worker is connected (the other side's doing)
                    while not (before := await remote.matches("tiny-llama", chain, None, False)):  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                confirmed = await remote.matches("tiny-llama", chain, None, True)
                after = await remote.matches("tiny-llama", chain, None, False)
                return before, confirmed, after
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    with pool_holding(master, range(4)):
        before, confirmed, after = asyncio.run(run())
    assert before == {"a": TierMatch(gpu=2, pool=4), "b": TierMatch(pool=6)}
    assert confirmed == after == {"a": TierMatch(gpu=2, pool=2), "b": TierMatch(pool=4)}
    assert metric_value(metrics, "kvroute_pool_lookups_total", result="gone") == 2
