"""The ext_proc streams of one request, without Envoy: when a routed request is over once the routing stream
ended with its decision (routing only), as told by the streams that follow it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from router.epp import messages, session
from router.epp.picking import Routed
from router.epp.server import ExtProc


class Outcome:
    """What the exchange tells the request's outcome, in order."""

    streamed = False
    attempts = 1
    ticket = object()  # its place in flow control, which leave() must be given back

    def __init__(self) -> None:
        self.told: list[str] = []

    def abandon(self, *args: object, **kwargs: object) -> None:
        self.told.append("abandon")


class Picker:
    def __init__(self) -> None:
        self.outcome = Outcome()
        self.left = 0
        self.tickets: list[object] = []

    async def route(self, method: str, path: str, headers: object, raw: bytes, subset: object) -> Routed:
        return Routed(["10.0.0.1:8000"], raw, self.outcome)  # type: ignore[arg-type]

    def leave(self, ticket: object) -> None:
        self.left += 1
        self.tickets.append(ticket)


class Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


ROUTING_ONLY = Context(((messages.STREAM_METADATA, messages.ROUTING_ONLY),))
FOLLOWER = Context(())


async def stream(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def get_request() -> Any:
    """A request without a body: routed at its headers."""
    headers = ext_proc.HttpHeaders(end_of_stream=True)
    headers.headers.headers.add(key=":method", raw_value=b"GET")
    return ext_proc.ProcessingRequest(request_headers=headers)


def naming(key: str, message: Any) -> Any:
    """message as a following stream sends it: with the request's key in the kvroute namespace."""
    value = struct_pb2.Struct()
    value.update({messages.EXCHANGE_KEY: key})
    message.metadata_context.filter_metadata[messages.EXCHANGE_NAMESPACE].CopyFrom(value)
    return message


def observed_request(key: str) -> Any:
    return naming(
        key, ext_proc.ProcessingRequest(observability_mode=True, request_headers=ext_proc.HttpHeaders())
    )


async def route(ext: ExtProc) -> str:
    """One request routed on a routing-only stream, which ends with the decision: the request's key."""
    answers = [answer async for answer in ext.Process(stream([get_request()]), ROUTING_ONLY)]
    (answer,) = answers
    return str(answer.dynamic_metadata[messages.EXCHANGE_NAMESPACE][messages.EXCHANGE_KEY])


@pytest.fixture
def picker(monkeypatch: pytest.MonkeyPatch) -> Picker:
    monkeypatch.setattr(session, "_FOLLOWED_WITHIN_S", 0.05)
    return Picker()


def test_a_routed_request_no_stream_follows_is_over_after_a_while(picker: Picker) -> None:
    async def scenario() -> None:
        await route(ExtProc(picker, 1 << 20))  # type: ignore[arg-type]
        assert (picker.left, picker.outcome.told) == (0, [])
        await asyncio.sleep(0.2)
        assert (picker.left, picker.outcome.told) == (1, ["abandon"])
        assert picker.tickets == [picker.outcome.ticket]  # its place in flow control given back

    asyncio.run(scenario())


def test_an_observer_that_ends_before_the_answer_ends_the_request(picker: Picker) -> None:
    async def scenario() -> None:
        ext = ExtProc(picker, 1 << 20)  # type: ignore[arg-type]
        key = await route(ext)
        observer = ext.Process(stream([observed_request(key)]), FOLLOWER)
        assert [answer async for answer in observer] == []  # nothing for a stream Envoy does not read
        assert (picker.left, picker.outcome.told) == (1, ["abandon"])
        await asyncio.sleep(0.2)
        assert picker.left == 1  # once

    asyncio.run(scenario())


def test_a_followed_request_waits_for_its_streams(picker: Picker) -> None:
    async def scenario() -> None:
        ext = ExtProc(picker, 1 << 20)  # type: ignore[arg-type]
        key = await route(ext)
        opened = asyncio.Event()

        async def observing() -> AsyncIterator[Any]:
            yield observed_request(key)
            opened.set()
            await asyncio.sleep(3600)  # still open: the answer has not begun
            yield None

        observer = asyncio.create_task(anext(ext.Process(observing(), FOLLOWER), None))
        await opened.wait()
        await asyncio.sleep(0.2)
        assert (picker.left, picker.outcome.told) == (0, [])
        observer.cancel()
        await asyncio.gather(observer, return_exceptions=True)

    asyncio.run(scenario())


def test_an_answering_stream_of_a_request_it_does_not_know_passes_the_headers(picker: Picker) -> None:
    async def scenario() -> None:
        ext = ExtProc(picker, 1 << 20)  # type: ignore[arg-type]
        headers = ext_proc.HttpHeaders()
        headers.headers.headers.add(key=":status", raw_value=b"200")
        unknown = naming(
            "routed-by-a-picker-since-restarted", ext_proc.ProcessingRequest(response_headers=headers)
        )
        (answer,) = [answer async for answer in ext.Process(stream([unknown]), FOLLOWER)]
        assert answer.HasField("response_headers")
        assert list(answer.response_headers.response.header_mutation.remove_headers) == [messages.SERVED_KEY]

    asyncio.run(scenario())
