"""Publishes KV event batches exactly as vLLM's ZmqEventPublisher does: PUB frames and a replay ROUTER."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque

import zmq
import zmq.asyncio

from router.index.events import END_OF_REPLAY, EventEncoder, KVEvent, pack_seq

log = logging.getLogger(__name__)


class EventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        encoding: str = "map",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        drop_ratio: float = 0.0,
    ) -> None:
        """drop_ratio: the share of batches not sent live (still buffered for replay), as a PUB socket past
        its high-water mark drops them: for tests of the subscriber's gap handling."""
        self._rank = data_parallel_rank
        self._drop_ratio, self._drops = drop_ratio, random.Random(topic)
        self._encoder = EventEncoder(encoding)
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._replay_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._replay is not None:
            self._replay_task = asyncio.create_task(self._serve_replay(self._replay))

    def publish(self, events: list[KVEvent]) -> None:
        payload = self._encoder.encode(time.time(), events, self._rank)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._drop_ratio and self._drops.random() < self._drop_ratio:
            return
        # PUB never blocks: past the high-water mark the frame is dropped, a gap the subscriber must replay.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, pack_seq(seq), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart((client, b"", self._topic, pack_seq(seq), payload))
            await sock.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._context.destroy(linger=0)
