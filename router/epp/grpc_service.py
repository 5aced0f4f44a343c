"""The endpoint picker's gRPC server: Envoy's ext_proc and gRPC health on grpclib, on the picker's own
event loop.

grpcio's asyncio server hands every message between its core's threads and the event loop (a futex, a
poller thread, a socket pair that wakes the loop): a picker that decides nothing cost 1.07-1.15 ms of CPU a
request at one connection on it, 0.75 on grpclib, whose HTTP/2 runs on the loop that decides
(docs/benchmarks.md). The servicer keeps grpcio's shape (Process(requests, context), yielding answers), so
the picker and the benchmark's floor (kvroute/bench/overhead/null_picker.py) are served alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any, Protocol

import grpclib.const
import grpclib.server
from envoy.service.ext_proc.v3 import external_processor_pb2
from grpc_health.v1 import health_pb2
from grpclib.exceptions import GRPCError

from router.epp.lean_http2 import trim_library_costs

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_PROCESS = f"/{EXT_PROC_SERVICE}/Process"
_PREFIX = struct.Struct(">?I")  # a gRPC message's prefix: compressed, length
# An ext_proc message's fields beside the body it carries (headers, metadata). A body comes whole in one
# message (buffered) or in chunks: no message is longer than a body taken and these.
MESSAGE_OVERHEAD_BYTES = 64 << 10


class Servicer(Protocol):
    def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncGenerator[Any, None]: ...


class _Context:
    """What a servicer reads of its stream's context: the gRPC metadata, as (key, value) pairs."""

    __slots__ = ("_metadata",)

    def __init__(self, metadata: Any) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]]:
        return list(self._metadata.items()) if self._metadata else []


class ExtProcService:
    """servicer's Process as grpclib's handler. A message longer than max_message_bytes ends its stream
    (RESOURCE_EXHAUSTED) before it is read: grpclib itself reads whatever length a prefix declares. Once
    draining, new streams are refused (UNAVAILABLE) and those open may finish."""

    def __init__(self, servicer: Servicer, max_message_bytes: int) -> None:
        self._servicer, self._max_message_bytes = servicer, max_message_bytes
        self._open = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            _PROCESS: grpclib.const.Handler(
                self._process,
                grpclib.const.Cardinality.STREAM_STREAM,
                external_processor_pb2.ProcessingRequest,
                external_processor_pb2.ProcessingResponse,
            )
        }

    async def drain(self, grace_s: float) -> None:
        """Refuse new streams, and wait up to grace_s for those open to end."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            pass

    async def _process(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        if self._draining:
            raise GRPCError(grpclib.const.Status.UNAVAILABLE, "the picker is shutting down")
        self._open += 1
        self._idle.clear()
        try:
            answers = self._servicer.Process(self._requests(stream), _Context(stream.metadata))
            async with contextlib.aclosing(answers):  # its cleanup now, however the stream ends
                async for answer in answers:
                    await stream.send_message(answer)
        finally:
            self._open -= 1
            if not self._open:
                self._idle.set()

    async def _requests(self, stream: grpclib.server.Stream[Any, Any]) -> AsyncIterator[Any]:
        raw = stream._stream  # grpclib's HTTP/2 stream: its prefix is read here, to bound the message
        while True:
            prefix = await raw.recv_data(_PREFIX.size)
            if not prefix:
                return
            compressed, length = _PREFIX.unpack(prefix)
            if compressed:
                raise GRPCError(grpclib.const.Status.UNIMPLEMENTED, "compressed messages are not taken")
            if length > self._max_message_bytes:
                raise GRPCError(
                    grpclib.const.Status.RESOURCE_EXHAUSTED,
                    f"a message of {length} bytes, over the {self._max_message_bytes} taken",
                )
            request = external_processor_pb2.ProcessingRequest()
            request.ParseFromString(await raw.recv_data(length))
            yield request


_Status = health_pb2.HealthCheckResponse
_SERVING, _NOT_SERVING = int(_Status.SERVING), int(_Status.NOT_SERVING)
_UNKNOWN = int(_Status.SERVICE_UNKNOWN)


class Readiness:
    """gRPC health (grpc.health.v1.Health): the process ("" and "liveness") serving while it answers;
    "readiness" and the ext_proc service while some instance can take a request; every one not serving once
    it shuts down. Watchers are told each change."""

    _ALWAYS = ("", "liveness")
    _WHEN_READY = ("readiness", EXT_PROC_SERVICE)

    def __init__(self) -> None:
        self._ready, self._shut_down = True, False
        self._changed = asyncio.Event()

    def set(self, ready: bool) -> None:
        self._change(ready, self._shut_down)

    def shut_down(self) -> None:
        self._change(False, True)

    def status(self, service: str) -> int | None:
        """The service's status; None: no such service."""
        if service in self._ALWAYS:
            return _NOT_SERVING if self._shut_down else _SERVING
        if service in self._WHEN_READY:
            return _SERVING if self._ready else _NOT_SERVING
        return None

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        check, watch = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        return {
            "/grpc.health.v1.Health/Check": grpclib.const.Handler(
                self._check, grpclib.const.Cardinality.UNARY_UNARY, check, watch
            ),
            "/grpc.health.v1.Health/Watch": grpclib.const.Handler(
                self._watch, grpclib.const.Cardinality.UNARY_STREAM, check, watch
            ),
        }

    def _change(self, ready: bool, shut_down: bool) -> None:
        ready = ready and not shut_down
        if (ready, shut_down) != (self._ready, self._shut_down):
            self._ready, self._shut_down = ready, shut_down
            self._changed.set()
            self._changed = asyncio.Event()

    async def _check(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        status = self.status(request.service if request is not None else "")
        if status is None:
            raise GRPCError(grpclib.const.Status.NOT_FOUND, "no such service")
        await stream.send_message(_Status(status=status))

    async def _watch(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        service = request.service if request is not None else ""
        sent = None
        while True:
            changed = self._changed
            status = self.status(service)
            status = _UNKNOWN if status is None else status
            if status != sent:
                await stream.send_message(_Status(status=status))
                sent = status
            await changed.wait()


async def start_server(
    servicer: Servicer, readiness: Readiness | None, host: str, port: int, max_body_bytes: int
) -> tuple[grpclib.server.Server, ExtProcService]:
    """ext_proc (and health, with readiness) listening on host:port, taking messages that carry up to
    max_body_bytes of a body; raises OSError when it cannot bind."""
    ext_proc = ExtProcService(servicer, max_body_bytes + MESSAGE_OVERHEAD_BYTES)
    trim_library_costs()
    services: list[Any] = [ext_proc] if readiness is None else [ext_proc, readiness]
    server = grpclib.server.Server(services)
    await server.start(host, port)
    return server, ext_proc
