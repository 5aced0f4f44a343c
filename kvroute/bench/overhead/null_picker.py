"""The floor under the endpoint picker, for ``kvroute bench overhead`` (target ``envoy-epp:floor``): an
ext_proc server that decides nothing, every request to the first instance, with which Envoy, on the same
configuration (configs/envoy-epp.yaml, or its one-filter layout), holds the same streams a request as with
``kvroute epp``, each message answered as ``kvroute epp`` answers it. Its CPU a request is what gRPC and
Python cost a picker before any decision: the least a picker on kvroute's gRPC server
(router/epp/grpc_service.py) can spend.

    python -m kvroute.bench.overhead.null_picker --port P --endpoint HOST:PORT   (gRPC on P, /health on P + 1)
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import uvloop
from aiohttp import web

from router.epp import messages
from router.epp.grpc_service import start_server
from router.http.settings import LimitsConfig
from router.upstreams.http_session import freeze_startup_objects


class NullExtProc:
    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._keys = itertools.count(1)

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncGenerator[Any, None]:
        first = await anext(requests, None)
        if first is None:
            return
        if first.observability_mode:  # read to the answer's last chunk, as kvroute epp reads a whole answer
            message = first
            while not (message.HasField("response_body") and message.response_body.end_of_stream):
                if (message := await anext(requests, None)) is None:
                    return
            return
        if first.HasField("response_headers"):  # the answering stream: held open to the request's end
            yield messages.response_headers({}, [])
            async for message in requests:
                yield messages.passed(message.WhichOneof("request"))
            return
        routing_only = messages.routing_only(context.invocation_metadata())
        async for answer in self._route(first, requests, routing_only):
            yield answer

    async def _route(
        self, first: Any, requests: AsyncIterator[Any], routing_only: bool
    ) -> AsyncIterator[Any]:
        """The routing stream: the headers, then the body (full duplex), given back with the route at its
        end. A routing-only stream ends there; one from a gateway's only filter is held to the request's end,
        every later message passed on unchanged."""
        body, message = bytearray(), first
        key = f"floor-{next(self._keys)}"
        routed = False
        while message is not None:
            phase = message.WhichOneof("request")
            end = (phase == "request_headers" and message.request_headers.end_of_stream) or (
                phase == "request_body" and message.request_body.end_of_stream
            )
            if phase == "request_body":
                body += message.request_body.body
            if end and not routed:
                routed = True
                with_body = bytes(body) if phase == "request_body" else None
                for answer in messages.routed([self._endpoint], with_body, True, key):
                    yield answer
                if routing_only:
                    return
            elif routed or phase not in ("request_headers", "request_body"):
                yield messages.passed(phase)
            message = await anext(requests, None)


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _serve(port: int, endpoint: str) -> None:
    server, _ = await start_server(
        NullExtProc(endpoint), None, "127.0.0.1", port, LimitsConfig().max_body_bytes
    )
    app = web.Application()
    app.router.add_get("/health", _health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port + 1).start()
    freeze_startup_objects(fewer_young_collections=False)  # as the picker does
    await server.wait_closed()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoint", required=True, help="HOST:PORT every request is sent to")
    options = parser.parse_args(argv)
    uvloop.run(_serve(options.port, options.endpoint))  # the picker's loop (router/epp/server.py)


if __name__ == "__main__":
    main()
