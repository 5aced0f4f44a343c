"""The router's own errors on odd input: in the route's shape (Anthropic's on /v1/messages, OpenAI's on the
rest), saying what is wrong, and no redirect where a route is missing."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from kvroute.processes import running_router
from tests.support.fake_upstreams import answering, healthy, only_instance, serving
from tests.support.http import post


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(healthy, answering) as port:
        with running_router(only_instance("a", port), tmp_path_factory.mktemp("router")) as router_url:
            yield router_url


def _anthropic_error(payload: bytes) -> dict[str, str]:
    answer = json.loads(payload)
    assert answer["type"] == "error" and set(answer) == {"type", "error"}, answer
    error: dict[str, str] = answer["error"]
    return error


def test_a_body_that_is_no_utf8_is_refused_in_each_routes_shape(url: str) -> None:
    body = b'{"model": "tiny-llama", "max_tokens": 1, "messages": [{"role": "user", "content": "\xff"}]}'
    status, _, payload = post(url + "/v1/messages", body)
    assert status == 400
    assert _anthropic_error(payload)["type"] == "invalid_request_error"
    status, _, payload = post(url + "/v1/chat/completions", body)
    assert status == 400 and json.loads(payload)["error"]["code"] == "invalid_encoding"


def test_a_lone_surrogate_is_named_as_such(url: str) -> None:
    body = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800x"}]}'
    status, _, payload = post(url + "/v1/chat/completions", body)
    assert status == 400
    assert "lone utf-16 surrogate \\ud800" in json.loads(payload)["error"]["message"]


def test_a_text_block_without_text_is_refused_as_anthropics_api_refuses_it(url: str) -> None:
    body = {
        "model": "tiny-llama",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text"}]}],
    }
    status, _, payload = post(url + "/v1/messages", json.dumps(body).encode())
    assert status == 400
    assert _anthropic_error(payload)["message"] == "messages.0.content.1.text: Field required"


def test_a_stored_response_without_an_id_is_an_unknown_route_not_a_redirect(url: str) -> None:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    try:
        connection.request("GET", "/v1/responses/")
        answer = connection.getresponse()
        assert (answer.status, json.loads(answer.read())) == (404, {"detail": "Not Found"})
    finally:
        connection.close()
