"""The agents' APIs as routing reads them: the route table, stored responses' ids and history, usage."""

from __future__ import annotations

import json

import pytest

from router.apis.responses.history import ResponseHistory
from router.apis.responses.ids import ResponseIds
from router.apis.responses.owners import UNSCOPED, owner_tag
from router.apis.responses.stored import StoredResponses, with_request_id
from router.apis.routes import (
    CANCEL_RESPONSE,
    CHAT,
    MESSAGES,
    RESPONSES,
    RETRIEVE_RESPONSE,
    presented_key,
    routed_api,
)
from router.config import RouterConfig
from router.dispatch.observe.usage import answer_usage
from router.errors import OpenAIError
from router.upstreams.instances import Upstreams


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/v1/chat/completions", (CHAT, None)),
        ("POST", "/v1/responses", (RESPONSES, None)),
        ("POST", "/v1/messages", (MESSAGES, None)),
        ("GET", "/v1/responses/resp_abc", (RETRIEVE_RESPONSE, "resp_abc")),
        ("POST", "/v1/responses/resp_abc/cancel", (CANCEL_RESPONSE, "resp_abc")),
        ("GET", "/v1/responses", None),
        ("POST", "/v1/responses/resp_abc", None),
        ("GET", "/v1/responses/resp_abc/cancel", None),
        ("POST", "/v1/responses/a/b", None),
        ("GET", "/v1/chat/completions", None),
        ("POST", "/v1/nothing", None),
    ],
)
def test_routes_are_found_by_method_and_path(
    method: str, path: str, expected: tuple[object, str | None] | None
) -> None:
    assert routed_api(method, path) == expected


def _fleet(*urls: str) -> Upstreams:
    instances = [{"name": f"i{n}", "url": url} for n, url in enumerate(urls)]
    return Upstreams(RouterConfig.model_validate({"models": [{"name": "m"}], "instances": instances}))


def test_an_id_names_its_instance_for_any_router_that_knows_the_fleet() -> None:
    urls = [f"http://10.0.0.{n}:8000" for n in range(50)]
    made = ResponseIds(_fleet(*urls))
    for instance in made._upstreams.instances:
        response_id = made.made(instance, UNSCOPED, ResponseIds.nonce())
        reader = ResponseIds(_fleet(*reversed(urls)))  # another replica, instances in another order
        holder = reader.holder(response_id)
        assert holder is not None and holder.url == instance.url
        assert response_id.startswith("resp_")


def test_ids_of_instances_gone_or_unknown_name_none() -> None:
    ids = ResponseIds(_fleet("http://a:1", "http://b:1"))
    gone = ids.made(_fleet("http://c:1").instances[0], UNSCOPED, "x")
    assert ids.holder(gone) is None
    assert ids.holder("resp_0123456789abcdef") is None
    assert ids.holder("not-even-a-response") is None


def test_an_id_a_client_chose_is_remembered_with_its_instance() -> None:
    fleet = _fleet("http://a:1", "http://b:1")
    ids = ResponseIds(fleet)
    ids.chosen("my-own-id", fleet.instances[1], UNSCOPED)
    holder = ids.holder("my-own-id")
    assert holder is fleet.instances[1]


@pytest.mark.parametrize("body", [b'{"model":"m","input":"x"}', b'  {"input":"x"}', b"{}", b"{ }"])
def test_the_request_id_is_set_first_and_the_rest_is_kept(body: bytes) -> None:
    stamped = with_request_id(body, "resp_1")
    assert json.loads(stamped) == {"request_id": "resp_1", **json.loads(body)}


def test_history_keeps_a_conversation_once_its_answer_came_and_forgets_the_oldest() -> None:
    history = ResponseHistory(max_entries=2)
    messages = [{"role": "user", "content": "hi"}]
    history.started("a", messages, 10)
    assert history.conversation("a") is None  # no output yet: vLLM has not stored it either
    stream = (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"o"}\n\n'
        b'event: response.completed\ndata: {"type":"response.completed","response":'
        b'{"status":"incomplete","output":[{"type":"message","content":[{"type":"output_text","text":"o"}]}]}}\n\n'
    )
    history.completed("a", stream)
    known = history.conversation("a")
    assert known is not None and known.messages == messages and known.output[0]["type"] == "message"
    history.started("b", messages, 10)
    history.completed("b", b'{"id":"b","status":"completed","output":[]}')
    history.started("c", messages, 10)
    assert history.conversation("a") is None  # the oldest went
    assert history.conversation("b") is not None


def test_history_is_bounded_in_bytes() -> None:
    history = ResponseHistory(max_bytes=1000)
    for n in range(20):
        history.started(str(n), [], 100)
    assert len(history) == 10


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            b'{"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}',
            (40, 2, 32),
        ),
        (
            b'{"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":3}}',
            (40, 3, 32),
        ),
        (
            b'{"type":"response.completed","response":{"usage":{"input_tokens":40,'
            b'"input_tokens_details":{"cached_tokens":0},"output_tokens":3}}}',
            (40, 3, 0),
        ),
        (
            b'{"usage":{"input_tokens":8,"output_tokens":2,"cache_read_input_tokens":32,"cache_creation_input_tokens":0}}',
            (40, 2, 32),
        ),
        (b'{"usage":{"input_tokens":40,"output_tokens":2}}', (40, 2, None)),
    ],
)
def test_usage_is_read_in_each_apis_terms(answer: bytes, expected: tuple[int, int, int | None]) -> None:
    usage = answer_usage(answer)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == expected


@pytest.mark.parametrize("chosen", [None, "resp_chosen_by_the_client"])
def test_a_follow_up_of_a_response_routed_here_knows_its_conversation(chosen: str | None) -> None:
    """The router's own id or the client's: the follow-up is pinned to the instance and rendered on the
    conversation kept here, so its prompt is known (tokenized)."""
    fleet = _fleet("http://a:1", "http://b:1")
    responses = StoredResponses(ResponseIds(fleet), ResponseHistory())
    body = {"model": "m", "input": "first", **({"request_id": chosen} if chosen else {})}
    first = responses.read(json.dumps(body).encode(), None, None)
    assert first.body_for is not None and first.watch is not None
    sent = json.loads(first.body_for(fleet.instances[1]))
    response_id = sent["request_id"]
    assert chosen is None or response_id == chosen
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]
    first.watch(json.dumps({"id": response_id, "status": "completed", "output": output}).encode())
    follow_up = {"model": "m", "input": "second", "previous_response_id": response_id}
    read = responses.read(json.dumps(follow_up).encode(), None, None)
    assert read.pinned is fleet.instances[1] and read.tokenize
    assert [m["content"] for m in read.body.messages] == ["first", "ok", "second"]


@pytest.mark.parametrize("chosen", [None, "resp_chosen_by_the_client"])
def test_a_stored_response_is_its_creating_keys_alone(chosen: str | None) -> None:
    """With client keys, another key's follow-up, retrieval and cancellation are told what an unknown id
    is told; the creating key's, and any key's where none are configured, reach the instance."""
    fleet = _fleet("http://a:1", "http://b:1")
    responses = StoredResponses(ResponseIds(fleet), ResponseHistory())
    alice, bob = owner_tag("key-a"), owner_tag("key-b")
    body = {"model": "m", "input": "first", **({"request_id": chosen} if chosen else {})}
    first = responses.read(json.dumps(body).encode(), None, alice)
    assert first.body_for is not None
    response_id = json.loads(first.body_for(fleet.instances[1]))["request_id"]
    follow_up = json.dumps({"model": "m", "input": "second", "previous_response_id": response_id}).encode()
    for read in (
        lambda owner: responses.read(follow_up, None, owner),
        lambda owner: responses.read_stored(response_id, "", None, owner),
    ):
        with pytest.raises(OpenAIError) as refused:
            read(bob)
        assert refused.value.status == 404
        assert refused.value.message == f"Response with id '{response_id}' not found."
        assert read(alice).pinned is fleet.instances[1]
    unscoped = StoredResponses(ResponseIds(fleet), ResponseHistory())
    made = json.loads(unscoped.read(json.dumps(body).encode(), None, None).body_for(fleet.instances[0]))
    assert unscoped.read_stored(made["request_id"], "", None, None).pinned is fleet.instances[0]


def test_the_key_is_read_as_either_api_sends_it() -> None:
    assert presented_key({"authorization": "Bearer sk-1"}) == "sk-1"
    assert presented_key({"authorization": "bearer sk-1", "x-api-key": "other"}) == "sk-1"
    assert presented_key({"x-api-key": "sk-ant"}) == "sk-ant"
    assert presented_key({"authorization": "Basic abc", "x-api-key": "sk-ant"}) == "sk-ant"
    assert presented_key({}) == ""
    assert owner_tag("sk-1") != owner_tag("sk-2") and len(owner_tag("sk-1")) == len(UNSCOPED)
