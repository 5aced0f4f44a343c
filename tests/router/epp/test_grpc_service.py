"""The picker's gRPC server (router/epp/grpc_service.py) on 127.0.0.1, called by grpcio's client as Envoy's
would call it: messages past the bound refused before they are read, a drain that lets open streams finish
and refuses new ones, and gRPC health's Check and Watch."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.processes import free_port_block
from router.epp.grpc_service import EXT_PROC_SERVICE, MESSAGE_OVERHEAD_BYTES, Readiness, start_server

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Echo:
    """Answers each message with its phase passed on; records the body lengths it read."""

    def __init__(self) -> None:
        self.read: list[int] = []

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncGenerator[Any, None]:
        async for request in requests:
            self.read.append(len(request.request_body.body))
            yield ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())


def body(size: int) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=b"x" * size))


def served(test: Callable[[Any, Any, Readiness, int], Awaitable[None]], max_body_bytes: int = 1024) -> None:
    """test(servicer, service, readiness, port) against a server started for it, closed after."""

    async def run() -> None:
        port = free_port_block(1)
        servicer, readiness = Echo(), Readiness()
        server, service = await start_server(servicer, readiness, "127.0.0.1", port, max_body_bytes)
        try:
            await test(servicer, service, readiness, port)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(run())


def test_a_message_past_the_bound_ends_its_stream_before_it_is_read() -> None:
    async def test(servicer: Echo, service: Any, readiness: Readiness, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
            answers = [answer async for answer in stub.Process(iter([body(100), body(900)]))]
            assert len(answers) == 2
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                _ = [
                    answer
                    async for answer in stub.Process(iter([body(100), body(1024 + MESSAGE_OVERHEAD_BYTES)]))
                ]
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert servicer.read == [100, 900, 100]  # the long one never reached it

    served(test)


def test_a_drain_lets_open_streams_finish_and_refuses_new_ones() -> None:
    async def test(servicer: Echo, service: Any, readiness: Readiness, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
            open_stream = stub.Process()
            await open_stream.write(body(1))
            await open_stream.read()
            drained = asyncio.create_task(service.drain(30.0))
            await asyncio.sleep(0.1)
            assert not drained.done()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Process().read()  # refused at its headers, before a message is sent
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            await open_stream.write(body(2))  # the open one is still served
            await open_stream.read()
            await open_stream.done_writing()
            await asyncio.wait_for(drained, 5.0)  # over once the last stream is, not at its grace
        assert servicer.read == [1, 2]

    served(test)


def test_a_stream_its_peer_resets_ends_without_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Envoy resets the picker's held answering stream at every request's end: grpclib would log each at
    INFO, a line a request."""
    caplog.set_level(logging.INFO)

    async def test(servicer: Echo, service: Any, readiness: Readiness, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
            for _ in range(3):
                held = stub.Process()
                await held.write(body(1))
                await held.read()
                held.cancel()  # RST_STREAM
            await asyncio.wait_for(service.drain(5.0), 5.0)  # returns once the server ended all three
        assert servicer.read == [1, 1, 1]

    served(test)
    assert [record.getMessage() for record in caplog.records if record.name.startswith("grpclib")] == []


def test_health_follows_readiness_and_shutdown() -> None:
    async def test(servicer: Echo, service: Any, readiness: Readiness, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(name: str) -> int:
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                return int(answer.status)

            watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            assert (await watch.read()).status == SERVING
            for name in ("", "liveness", "readiness", EXT_PROC_SERVICE):
                assert await status(name) == SERVING
            readiness.set(False)
            assert (await watch.read()).status == NOT_SERVING
            assert [await status(n) for n in ("", "readiness", EXT_PROC_SERVICE)] == [
                SERVING,
                NOT_SERVING,
                NOT_SERVING,
            ]
            readiness.set(True)
            assert (await watch.read()).status == SERVING
            readiness.shut_down()
            readiness.set(True)  # a last readiness check after the shutdown began changes nothing
            assert (await watch.read()).status == NOT_SERVING
            assert [await status(n) for n in ("", "liveness", "readiness")] == [NOT_SERVING] * 3
            watch.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await status("nope")
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND

    served(test)
