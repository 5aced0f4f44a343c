"""Bad input to the OpenAI endpoints: too large, not JSON, absurd values. A 4xx in OpenAI's shape, never a 500
or a hang."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from urllib.parse import urlsplit

import pytest

from tests.conftest import sample
from tests.support.http import post

MODEL = "tiny-llama"
LIMIT = 32 * 2**20  # limits.max_body_bytes's default, which the session router uses
CHAT = "/v1/chat/completions"


def chat(**fields: object) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return json.dumps(body, ensure_ascii=False).encode()


def assert_openai_error(status: int, body: bytes, expected: int | None = None) -> dict[str, object]:
    assert 400 <= status < 500 if expected is None else status == expected, (status, body[:300])
    error = json.loads(body)["error"]
    assert {"message", "type", "param", "code"} <= error.keys()
    assert isinstance(error["message"], str) and error["message"]
    return error  # type: ignore[no-any-return]


def exchange(
    url: str, head: dict[str, str], chunks: Iterable[bytes], method: str = "POST"
) -> tuple[int, bytes]:
    """A request with head's headers, sending chunks from a thread while the answer is read: a server that
    answers before the body ends may close the connection under a client still sending."""
    address = urlsplit(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=30)

    def send_body() -> None:
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except OSError:
            pass  # the server answered and closed: what the test checks

    with sock:
        lines = [f"{method} {address.path} HTTP/1.1", f"Host: {address.netloc}", "Connection: close"]
        sock.sendall(("\r\n".join(lines + [f"{k}: {v}" for k, v in head.items()]) + "\r\n\r\n").encode())
        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        received = b""
        while b"\r\n\r\n" not in received or len(received) < _expected_length(received):
            data = sock.recv(65536)
            if not data:
                break
            received += data
        sender.join(timeout=30)
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _expected_length(received: bytes) -> int:
    head, _, _ = received.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(received) + 1


def test_content_length_over_the_limit_is_413_before_the_body_is_read(router_url: str) -> None:
    head = {"Content-Type": "application/json", "Content-Length": str(2 * LIMIT)}
    status, body = exchange(router_url + CHAT, head, [])  # no body at all: waiting for it would hang
    assert_openai_error(status, body, 413)


def test_chunked_body_over_the_limit_is_413(router_url: str) -> None:
    mib = b"x" * 2**20
    chunk = f"{len(mib):x}\r\n".encode() + mib + b"\r\n"
    chunks = [b'{"model": "tiny-llama", "messages": "'] + [chunk] * (LIMIT // len(mib) + 2) + [b"0\r\n\r\n"]
    chunks[0] = f"{len(chunks[0]):x}\r\n".encode() + chunks[0] + b"\r\n"
    status, body = exchange(
        router_url + CHAT, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}, chunks
    )
    assert_openai_error(status, body, 413)


def test_a_gets_body_is_held_to_the_limit_too(router_url: str) -> None:
    """A stored response's retrieval goes to the engine without a body, but the router reads what came: a
    chunked body of 200 MiB was held whole."""
    retrieval = router_url + "/v1/responses/resp_0123"
    status, body = exchange(retrieval, {"Content-Length": str(2 * LIMIT)}, [], "GET")
    assert_openai_error(status, body, 413)
    mib = b"\xff" * 2**20  # not UTF-8 either, which is no concern of a body nothing reads
    chunk = f"{len(mib):x}\r\n".encode() + mib + b"\r\n"
    chunks = [chunk] * (LIMIT // len(mib) + 2) + [b"0\r\n\r\n"]
    status, body = exchange(retrieval, {"Transfer-Encoding": "chunked"}, chunks, "GET")
    assert_openai_error(status, body, 413)
    status, body = exchange(retrieval, {"Transfer-Encoding": "chunked"}, [chunk, b"0\r\n\r\n"], "GET")
    assert status != 413 and json.loads(body)["error"]["code"] != "invalid_encoding", body


def test_chunked_body_under_the_limit_is_routed(router_url: str) -> None:
    raw = chat()
    chunks = [
        f"{len(raw[i : i + 7]):x}\r\n".encode() + raw[i : i + 7] + b"\r\n" for i in range(0, len(raw), 7)
    ]
    head = {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    status, body = exchange(router_url + CHAT, head, [*chunks, b"0\r\n\r\n"])
    assert status == 200, body
    assert json.loads(body)["object"] == "chat.completion"


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "application/jsonx", ""]
)
def test_content_type_other_than_json_is_415(router_url: str, content_type: str) -> None:
    status, _, body = post(router_url + CHAT, chat(), {"content-type": content_type})
    assert_openai_error(status, body, 415)


def test_a_compressed_body_is_415_naming_its_encoding(router_url: str) -> None:
    raw = gzip.compress(chat())
    status, _, body = post(
        router_url + CHAT, raw, {"content-type": "application/json", "content-encoding": "gzip"}
    )
    assert_openai_error(status, body, 415)
    assert json.loads(body)["error"]["code"] == "unsupported_content_encoding"
    assert "'gzip'" in json.loads(body)["error"]["message"]
    identity = {"content-type": "application/json", "content-encoding": "identity"}
    assert post(router_url + CHAT, chat(), identity)[0] == 200


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_content_type_with_parameters_is_accepted(router_url: str, content_type: str) -> None:
    status, _, body = post(router_url + CHAT, chat(), {"content-type": content_type})
    assert status == 200, body


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xc3"}]}',  # cut mid-character
        b'{"model": "tiny-\xed\xa0\x80llama", "messages": []}',  # an encoded surrogate
    ],
)
def test_invalid_utf8_is_400(router_url: str, raw: bytes) -> None:
    status, _, body = post(router_url + CHAT, raw)
    assert assert_openai_error(status, body, 400)["code"] == "invalid_encoding"


def test_utf8_split_across_chunks_is_accepted(router_url: str) -> None:
    raw = chat(messages=[{"role": "user", "content": "naïve café ☕"}])
    cut = raw.index("☕".encode()) + 1
    chunks = [f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (raw[:cut], raw[cut:])]
    head = {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    status, body = exchange(router_url + CHAT, head, [*chunks, b"0\r\n\r\n"])
    assert status == 200, body


def _nested(depth: int) -> object:
    content: object = "deep"
    for _ in range(depth):
        content = [content]
    return content


def _deep_json(depth: int) -> bytes:
    return (
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": '
        + b"[" * depth
        + b"]" * depth
        + b"}]}"
    )


ABSURD = {
    "max_tokens 1e12": chat(max_tokens=10**12),
    "max_tokens -1": chat(max_tokens=-1),
    "max_tokens float": chat(max_tokens=1e300),
    "n huge": chat(n=10**9),
    "n negative": chat(n=-5),
    "content nested 10,000 deep": _deep_json(10_000),
    "content nested 200 deep": chat(messages=[{"role": "user", "content": _nested(200)}]),
    "messages not a list": chat(messages="hello"),
    "message not an object": chat(messages=[42]),
    "role missing": chat(messages=[{"content": "hi"}]),
    "model a number": chat(model=7),
    "model unknown": chat(model="no-such-model"),
    "stream a string": chat(stream="maybe"),
    "body a list": b"[1, 2, 3]",
    "body a string": b'"hello"',
    "body empty": b"",
    "body null": b"null",
    "truncated JSON": chat()[:-5],
}


@pytest.mark.parametrize("raw", ABSURD.values(), ids=ABSURD.keys())
def test_absurd_chat_bodies_are_client_errors(router_url: str, raw: bytes) -> None:
    status, _, body = post(router_url + CHAT, raw)
    assert_openai_error(status, body)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny-llama", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        b'{"model": "tiny-llama", "prompt": [[1, 2], ["a"], {"x": 1}]}',
        b'{"model": "tiny-llama", "prompt": [-1, 99999999999]}',
        b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 1000000000000}',
    ],
)
def test_absurd_completion_bodies_are_client_errors(router_url: str, raw: bytes) -> None:
    status, _, body = post(router_url + "/v1/completions", raw)
    assert_openai_error(status, body)


def test_a_10000_message_conversation_is_answered(router_url: str) -> None:
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(10_000)]
    status, _, body = post(router_url + CHAT, chat(messages=messages))
    if status != 200:  # the engine may find it longer than its context
        assert_openai_error(status, body)


def test_get_and_other_paths_are_untouched(router_url: str) -> None:
    status, _, _ = post(router_url + "/v1/no-such-endpoint", b"not json", {"content-type": "text/plain"})
    assert status == 415  # every POST /v1/* is JSON
    status, _, body = post(router_url + "/admin/reload", b"", {"content-type": "text/plain"})
    assert status != 415, body  # outside /v1/: not this middleware's business


@pytest.mark.parametrize(
    "head",
    [
        {"Content-Length": "twelve"},
        {"Content-Length": "4", "Transfer-Encoding": "chunked"},  # request smuggling's shape
        {"X-Control": "a\x01b"},
    ],
)
def test_malformed_http_is_an_openai_error_counted_by_code(router_url: str, head: dict[str, str]) -> None:
    """The HTTP parser refuses these before the app sees them; the answer is still OpenAI's JSON."""
    before = sample(router_url, "kvroute_client_errors_total", code="malformed_http") or 0.0
    status, body = exchange(router_url + CHAT, {"Content-Type": "application/json", **head}, [chat()])
    assert assert_openai_error(status, body, 400)["code"] == "malformed_http"
    assert sample(router_url, "kvroute_client_errors_total", code="malformed_http") == before + 1


def test_client_errors_are_counted_by_code(router_url: str) -> None:
    def count(code: str) -> float:
        return sample(router_url, "kvroute_client_errors_total", code=code) or 0.0

    codes = ("body_too_large", "unsupported_media_type", "model_not_found")
    before = {code: count(code) for code in codes}
    exchange(router_url + CHAT, {"Content-Type": "application/json", "Content-Length": str(2 * LIMIT)}, [])
    post(router_url + CHAT, chat(), {"content-type": "text/plain"})
    post(router_url + CHAT, chat(model="no-such-model"), {"content-type": "application/json"})
    assert {code: count(code) - before[code] for code in codes} == dict.fromkeys(codes, 1)


def test_head_probes_and_wrong_methods_are_answered_properly(router_url: str) -> None:
    for path in ("/health", "/v1/models"):
        with urllib.request.urlopen(
            urllib.request.Request(router_url + path, method="HEAD"), timeout=10
        ) as answer:
            assert answer.status == 200, path
            assert answer.read() == b""
    request = urllib.request.Request(router_url + "/v1/models", data=b"{}", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=10)
    assert raised.value.code == 405
    assert "GET" in raised.value.headers["allow"]
    assert json.loads(raised.value.read()) == {"detail": "Method Not Allowed"}  # as vLLM answers it
