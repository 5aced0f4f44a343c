"""The index host and its workers' RemoteIndex, over a real Unix socket: lookups answer as the index itself
does, a worker's routed requests are every worker's speculative entries until withdrawn, the host's figures
reach the workers, and a host that is absent, silent or sent garbage costs prefix knowledge only."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from router.index.block_index import BlockIndex
from router.index.figures import IndexFigures, figures_of
from router.index.host_wire import MAX_MESSAGE_BYTES, Lookup, framed, packed
from router.index.index_host import IndexHost
from router.index.pool import IndexOnlyMatches
from router.index.remote_index import RemoteIndex
from router.metrics import RouterMetrics
from scorers.request import TierMatch
from tests.router.index.test_block_index import BS, prompt, stored


def _count(metrics: RouterMetrics, outcome: str) -> float:
    return metrics.index_host_lookups(outcome)._value.get()


@asynccontextmanager
async def _hosted(endpoint: str, index: BlockIndex, metrics: RouterMetrics) -> AsyncIterator[IndexHost]:
    indexed = IndexOnlyMatches(index)
    host = IndexHost(index, indexed, indexed, lambda: figures_of(index, ["a warning"]), metrics, index_clock)
    serving = asyncio.create_task(host.serve(endpoint))
    try:
        await _until(lambda: _exists(endpoint))
        yield host
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


@asynccontextmanager
async def _worker(
    endpoint: str, metrics: RouterMetrics, timeout_s: float = 2.0
) -> AsyncIterator[RemoteIndex]:
    remote = RemoteIndex(endpoint, metrics, timeout_s)
    running = asyncio.create_task(remote.run())
    try:
        yield remote
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


def index_clock() -> float:
    return asyncio.get_running_loop().time()


async def _exists(path: str) -> bool:
    return await asyncio.to_thread(os.path.exists, path)


async def _until(condition: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await condition():  # noqa: ASYNC110 (what it waits for is the other side's doing)
            await asyncio.sleep(0.01)


def test_lookups_answer_as_the_index_does_and_routed_requests_count_for_every_worker(tmp_path: Path) -> None:
    endpoint = str(tmp_path / "index")
    chain = prompt()

    async def main() -> None:
        index, metrics = BlockIndex(BS, clock=index_clock), RouterMetrics()
        index.apply(("a", 0), [stored(0, 6)])
        async with (
            _hosted(endpoint, index, metrics),
            _worker(endpoint, metrics) as one,
            _worker(endpoint, metrics) as other,
        ):
            await _until(lambda: _answers(one, chain))
            assert await one.matches("m", chain, None, False) == index.match(chain) == {"a": TierMatch(gpu=6)}
            # one routes the prompt to b, which holds none of it: other finds all of it there once the host
            # has read one's message, with no event from b
            handle = one.routed("b", chain, 0)
            assert handle is not None
            await _until(lambda: _holds(other, chain, "b", TierMatch(gpu=len(chain))))
            one.withdraw("b", handle)
            await _until(lambda: _lacks(other, chain, "b"))
            assert one.routed("a", chain[:6], 6) is None  # what a holds needs no entry
            one.cache_reset("a")
            await _until(lambda: _lacks(other, chain, "a"))
        assert _count(metrics, "late") == 0 < _count(metrics, "answered")

    asyncio.run(main())


async def _answers(remote: RemoteIndex, chain: list[int]) -> bool:
    return bool(await remote.matches("m", chain, None, False))


async def _holds(remote: RemoteIndex, chain: list[int], instance: str, match: TierMatch) -> bool:
    return (await remote.matches("m", chain, None, False)).get(instance) == match


async def _lacks(remote: RemoteIndex, chain: list[int], instance: str) -> bool:
    return instance not in await remote.matches("m", chain, None, False)


def test_workers_report_the_hosts_figures_and_none_once_it_is_gone(tmp_path: Path) -> None:
    endpoint = str(tmp_path / "index")

    async def main() -> None:
        index, metrics = BlockIndex(BS, clock=index_clock), RouterMetrics()
        index.apply(("a", 0), [stored(0, 6)])
        async with _worker(endpoint, metrics) as remote:
            async with _hosted(endpoint, index, metrics):
                await _until(lambda: _figured(remote, lambda f: f.entries == 6), timeout_s=5)
                assert remote.figures == figures_of(index, ["a warning"])
            await _until(lambda: _figured(remote, lambda f: f == IndexFigures()), timeout_s=5)

    asyncio.run(main())


async def _figured(remote: RemoteIndex, check: Callable[[IndexFigures], bool]) -> bool:
    return check(remote.figures)


def test_without_a_host_lookups_come_back_empty_at_once_and_are_counted(tmp_path: Path) -> None:
    endpoint = str(tmp_path / "index")

    async def main() -> None:
        metrics = RouterMetrics()
        async with _worker(endpoint, metrics, timeout_s=30) as remote:
            await asyncio.sleep(0.05)
            async with asyncio.timeout(1):  # not the lookup's 30 s: nothing can be sent
                assert await remote.matches("m", prompt(), None, False) == {}
            assert remote.routed("a", prompt(), 0) is not None  # told to no one, and no harm done
        assert _count(metrics, "unreachable") == 1

    asyncio.run(main())


def test_a_silent_host_costs_a_lookup_its_timeout_only(tmp_path: Path) -> None:
    endpoint = str(tmp_path / "index")

    async def main() -> None:
        metrics = RouterMetrics()

        async def takes_and_answers_nothing(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            while await reader.read(1 << 16):
                pass
            writer.close()

        silent = await asyncio.start_unix_server(takes_and_answers_nothing, endpoint)
        async with silent, _worker(endpoint, metrics, timeout_s=0.2) as remote:
            await asyncio.sleep(0.3)  # connected
            started = asyncio.get_running_loop().time()
            assert await remote.matches("m", prompt(), None, False) == {}
            assert 0.2 <= asyncio.get_running_loop().time() - started < 1.0
        assert _count(metrics, "late") == 1

    asyncio.run(main())


def test_messages_the_host_cannot_read_are_counted_and_passed_over(tmp_path: Path) -> None:
    endpoint = str(tmp_path / "index")
    chain = prompt()

    async def main() -> None:
        index, metrics = BlockIndex(BS, clock=index_clock), RouterMetrics()
        index.apply(("a", 0), [stored(0, 6)])
        async with _hosted(endpoint, index, metrics), _worker(endpoint, metrics) as remote:
            reader, rogue = await asyncio.open_unix_connection(endpoint)
            not_msgpack = b"\xc1 not msgpack"
            rogue.write(len(not_msgpack).to_bytes(4, "little") + not_msgpack)
            rogue.write(framed(Lookup(1, "m", b"\x00" * 7, None, False)))  # no whole hash
            rogue.write(framed(Lookup(2, "m", packed(chain), None, False)))  # and one it reads
            async with asyncio.timeout(5):
                answer = await reader.read(1 << 16)
            assert b"a" in answer
            rogue.write((MAX_MESSAGE_BYTES + 1).to_bytes(4, "little"))  # a frame it cannot take: cut off
            async with asyncio.timeout(5):
                assert await reader.read() == b""
            rogue.close()
            assert await remote.matches("m", chain, None, False) == {"a": TierMatch(gpu=6)}  # others go on
        assert metrics.index_host_malformed._value.get() == 3

    asyncio.run(main())


def test_a_lookup_whose_connection_ends_routes_without_the_index_at_once(tmp_path: Path) -> None:
    endpoint = str(tmp_path / "index")

    async def main() -> None:
        metrics = RouterMetrics()

        async def reads_one_frame_and_hangs_up(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            await reader.read(1)
            writer.close()

        hanging_up = await asyncio.start_unix_server(reads_one_frame_and_hangs_up, endpoint)
        async with hanging_up, _worker(endpoint, metrics, timeout_s=30) as remote:
            await asyncio.sleep(0.3)  # connected
            async with asyncio.timeout(5):  # not the lookup's 30 s
                assert await remote.matches("m", prompt(), None, False) == {}
        assert _count(metrics, "unreachable") == 1

    asyncio.run(main())
