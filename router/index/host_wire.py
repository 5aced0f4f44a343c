"""What the workers of `kvroute serve --workers N` and their index host (router/index/index_host.py) say to
each other: msgpack messages over a Unix socket in the pool's private directory, each framed by its length
(4 bytes, little-endian), each worker on a connection of its own. Block chains travel as their 64-bit hashes
in the host's byte order: both ends are one machine.

A Unix socket and asyncio's streams rather than ZMQ: pyzmq's asyncio sockets cost a worker 0.8 ms of CPU per
request in futures and option reads (a lookup and what was routed), a fifth of its time."""

from __future__ import annotations

import asyncio
import struct
from array import array
from collections.abc import Sequence

import msgspec

from router.index.figures import IndexFigures

# A chain of 1M tokens is 62,500 blocks (500 KB); a bigger message is no worker's and is refused unread.
MAX_MESSAGE_BYTES = 16 << 20


class Lookup(msgspec.Struct, tag=0, array_like=True, gc=False):
    """Each instance's match of chain (PrefixMatches.matches); answered with a Matched of the same id."""

    id: int
    model: str
    chain: bytes
    reusable: int | None
    confirm: bool  # the pool credit confirmed with the Mooncake master, where the host has one


class Routed(msgspec.Struct, tag=1, array_like=True, gc=False):
    """BlockIndex.routed; speculation: the worker's handle for what it entered, which Withdraw names."""

    instance: str
    chain: bytes
    held: int
    speculation: int


class Withdraw(msgspec.Struct, tag=2, array_like=True, gc=False):
    instance: str
    speculation: int


class CacheReset(msgspec.Struct, tag=3, array_like=True, gc=False):
    instance: str


class AskFigures(msgspec.Struct, tag=4, array_like=True, gc=False):
    id: int


ToHost = Lookup | Routed | Withdraw | CacheReset | AskFigures


class Matched(msgspec.Struct, tag=0, array_like=True, gc=False):
    id: int
    matches: dict[str, tuple[int, int, int]]  # by instance: (gpu, cpu, pool) blocks


class Figures(msgspec.Struct, tag=1, array_like=True, gc=False):
    id: int
    figures: IndexFigures


ToWorker = Matched | Figures

encode = msgspec.msgpack.Encoder().encode
decode_to_host = msgspec.msgpack.Decoder(ToHost).decode
decode_to_worker = msgspec.msgpack.Decoder(ToWorker).decode


_LENGTH = struct.Struct("<I")


class Unframed(ValueError):
    """A frame longer than MAX_MESSAGE_BYTES: the connection cannot be read further."""


def framed(message: ToHost | ToWorker) -> bytes:
    payload = encode(message)
    return _LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next message's payload; IncompleteReadError at the end of the connection, Unframed for a frame
    too long to take."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_MESSAGE_BYTES:
        raise Unframed(f"a frame of {length} bytes")
    return await reader.readexactly(length)


class Batching:
    """Writes a connection's frames of one event loop turn in one system call: under load, the lookups and
    routed requests of many requests at once."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._frames: list[bytes] = []

    def write(self, frame: bytes) -> None:
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._flush)
        self._frames.append(frame)

    def unsent_bytes(self) -> int:
        return self._writer.transport.get_write_buffer_size()

    def closing(self) -> bool:
        return self._writer.is_closing()

    def close(self) -> None:
        self._writer.close()

    def _flush(self) -> None:
        frames, self._frames = self._frames, []
        if not self.closing():
            self._writer.write(b"".join(frames))


def packed(chain: Sequence[int]) -> bytes:
    return array("Q", chain).tobytes()


def unpacked(chain: bytes) -> list[int]:
    """ValueError when chain is not whole hashes."""
    hashes = array("Q")
    hashes.frombytes(chain)
    return hashes.tolist()
