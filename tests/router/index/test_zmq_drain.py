"""The compiled drain receives what pyzmq would, from the socket pyzmq made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from router.index._zmq_drain import drain


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    receiver, sender = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    receiver.bind("inproc://drain")
    sender.connect("inproc://drain")
    try:
        yield receiver, sender
    finally:
        receiver.close(linger=0)
        sender.close(linger=0)
        context.term()


def _sent(sender: zmq.Socket[bytes], messages: list[list[bytes]]) -> list[list[bytes]]:
    for frames in messages:
        sender.send_multipart(frames)
    return messages


def test_nothing_queued_is_an_empty_list(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    receiver, _ = pair
    assert drain(receiver.underlying, 256, 1 << 20) == []


def test_messages_come_whole_and_in_order(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    receiver, sender = pair
    messages = _sent(
        sender,
        [
            [b"kv@engine", (n).to_bytes(8, "big"), bytes([n]) * n]
            for n in range(200)  # an empty payload first
        ]
        + [[b"one frame"], [b"", b"", b""], [b"large", b"\0" * (4 << 20)]],
    )
    assert drain(receiver.underlying, 1000, 1 << 30) == messages
    assert drain(receiver.underlying, 1000, 1 << 30) == []


def test_at_most_so_many_messages(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    receiver, sender = pair
    messages = _sent(sender, [[b"t", bytes([n])] for n in range(10)])
    assert drain(receiver.underlying, 4, 1 << 20) == messages[:4]
    assert drain(receiver.underlying, 4, 1 << 20) == messages[4:8]
    # what is left, as pyzmq receives it: the drain took nothing more from the queue
    assert [receiver.recv_multipart(zmq.NOBLOCK) for _ in range(2)] == messages[8:]
    with pytest.raises(zmq.Again):
        receiver.recv_multipart(zmq.NOBLOCK)


def test_no_more_once_they_hold_so_many_bytes(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    receiver, sender = pair
    messages = _sent(sender, [[b"t", b"x" * 999] for _ in range(5)])
    # the message that reaches the bound is taken whole, and none after it
    assert drain(receiver.underlying, 100, 2001) == messages[:3]
    assert drain(receiver.underlying, 100, 1) == messages[3:4]
    assert drain(receiver.underlying, 100, 1 << 20) == messages[4:]


def test_a_socket_that_cannot_receive_raises_what_pyzmq_would() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sender = context.socket(zmq.PUSH)
    try:
        with pytest.raises(zmq.ZMQError) as raised:
            drain(sender.underlying, 1, 1 << 20)
        with pytest.raises(zmq.ZMQError) as expected:
            sender.recv_multipart(zmq.NOBLOCK)
        assert (type(raised.value), raised.value.errno) == (type(expected.value), expected.value.errno)
    finally:
        sender.close(linger=0)
        context.term()
