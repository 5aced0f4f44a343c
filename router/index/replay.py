"""The replay of one instance's KV-event buffer (vLLM's replay endpoint, a ROUTER socket): its batches from a
number on, as they come, their events still encoded, and the answer cut at bounds an engine's never reaches.

vLLM answers a replay with its buffer from the number asked (at most buffer_steps batches, 10,000 by
default), then an end marker. An answer that does not end is cut: past ten times that many batches, past a
deadline, or (for a gap, whose batches are kept until all have come) past REPLAY_MAX_BYTES kept. A cut
replay fails as a silent one does; the subscriber goes on with live events.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TypeAlias

import zmq
import zmq.asyncio

from router.index.events import (
    END_OF_REPLAY,
    EncodedBatch,
    EventDecoder,
    MalformedBatch,
    pack_seq,
    unpack_seq,
)

log = logging.getLogger(__name__)

REPLAY_MAX_BATCHES = 100_000
REPLAY_MAX_BYTES = 256 * 2**20
REPLAY_DEADLINE_S = 60.0
_YIELD_EVERY = 256  # batches received between turns given to the event loop

Replayed: TypeAlias = tuple[int, EncodedBatch]  # held until applied: its events still encoded


class ReplayFailed(Exception):
    """The replay endpoint fell silent, or its answer went past a bound."""


class ReplayClient:
    def __init__(
        self,
        endpoint: str,
        connect: Callable[[int, str], zmq.asyncio.Socket],
        decoder: EventDecoder,
        malformed: Callable[[], None],
        timeout_s: float,
    ) -> None:
        """connect(kind, endpoint): a socket with the subscriber's options; malformed: told of each message
        that is not a batch; timeout_s: the longest the endpoint may fall silent."""
        self._endpoint, self._connect, self._decoder = endpoint, connect, decoder
        self._malformed, self._timeout_s = malformed, timeout_s
        self._told_cut = False  # a replay cut at a bound is logged once; the failed replays count them all

    async def kept(self, start: int, rank: int, end: int) -> list[Replayed] | None:
        """rank's buffered batches numbered start to end - 1 (those still buffered), kept until the answer
        ends; None when the replay fails. What is kept is bounded in bytes: the batches' payloads, and a few
        hundred bytes each besides."""
        kept: list[Replayed] = []
        held = 0
        try:
            async with contextlib.aclosing(self.batches(start)) as replayed:
                async for seq, batch in replayed:
                    if start <= seq < end and (batch.data_parallel_rank or 0) == rank:
                        held += batch.size
                        if held > REPLAY_MAX_BYTES:
                            raise self._cut(f"over {REPLAY_MAX_BYTES >> 20} MiB")
                        kept.append((seq, batch))
        except ReplayFailed:
            return None
        return kept

    async def batches(self, start: int) -> AsyncGenerator[Replayed, None]:
        """The buffered batches from start on, as they come. Raises ReplayFailed when the endpoint falls
        silent for timeout_s (an idle limit: a long buffer may take longer in all), or its answer runs past
        REPLAY_MAX_BATCHES or REPLAY_DEADLINE_S."""
        dealer = self._connect(zmq.DEALER, self._endpoint)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLAY_DEADLINE_S
        try:
            await dealer.send_multipart((b"", pack_seq(start)))
            for received in itertools.count(1):
                if received > REPLAY_MAX_BATCHES:
                    raise self._cut(f"past {REPLAY_MAX_BATCHES} batches")
                now = loop.time()
                if now >= deadline:  # checked here too: queued messages come at once, and never time out
                    raise self._cut(f"past {REPLAY_DEADLINE_S:.0f} s")
                silent_at = now + self._timeout_s
                try:
                    async with asyncio.timeout_at(min(silent_at, deadline)):
                        frames = (await dealer.recv_multipart())[1:]  # after the empty delimiter
                except TimeoutError:
                    if silent_at < deadline:
                        log.warning("replay from %s fell silent for %.1fs", self._endpoint, self._timeout_s)
                        raise ReplayFailed("silent") from None
                    raise self._cut(f"past {REPLAY_DEADLINE_S:.0f} s") from None
                if len(frames) >= 2 and frames[-2] == END_OF_REPLAY:
                    return
                if len(frames) == 2:  # older vLLM answers without the topic
                    frames.insert(0, b"")
                numbered = self._parse(frames)
                if numbered is not None:
                    yield numbered
                if received % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # queued messages complete at once: give the loop a turn
        finally:
            dealer.close(linger=0)

    def _cut(self, bound: str) -> ReplayFailed:
        """A replay went past a bound: said once, counted as a failed replay every time."""
        if not self._told_cut:
            self._told_cut = True
            log.warning(
                "replay from %s cut %s: an engine answers with at most its buffer, then ends; its KV events "
                'are followed live (kvroute_kv_replays_total{result="failed"} counts further cuts)',
                self._endpoint,
                bound,
            )
        return ReplayFailed(bound)

    def _parse(self, frames: list[bytes]) -> Replayed | None:
        """[topic, seq, payload] as (seq, batch), the events left encoded whatever their size (they may be
        held a while before applied); anything else is counted and yields None."""
        if len(frames) == 3 and len(frames[1]) == 8 and (seq := unpack_seq(frames[1])) >= 0:
            try:
                return seq, self._decoder.envelope(frames[2])
            except MalformedBatch:
                pass
        self._malformed()
        return None
