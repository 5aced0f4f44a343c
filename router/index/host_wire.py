"""What the workers of `kvroute serve --workers N` and their index host (router/index/index_host.py) say to
each other: msgpack messages over a ZMQ ipc:// socket in the pool's private directory, a worker's DEALER to
the host's ROUTER. Block chains travel as their 64-bit hashes in the host's byte order: both ends are one
machine."""

from __future__ import annotations

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


def packed(chain: Sequence[int]) -> bytes:
    return array("Q", chain).tobytes()


def unpacked(chain: bytes) -> list[int]:
    """ValueError when chain is not whole hashes."""
    hashes = array("Q")
    hashes.frombytes(chain)
    return hashes.tolist()
