"""A disaggregated answer reports the cached tokens its prefill leg found, not what the decode leg fetched."""

from __future__ import annotations

import json

from router.dispatch.observe.cached_tokens import reported_cached_tokens, with_cached_tokens

WHOLE = json.dumps(
    {
        "id": "x",
        "usage": {
            "prompt_tokens": 1200,
            "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 1200},
        },
    }
).encode()


def test_the_prefill_answers_count_is_read() -> None:
    assert reported_cached_tokens(WHOLE) == 1200
    assert reported_cached_tokens(b'{"usage": {"prompt_tokens": 3, "prompt_tokens_details": null}}') is None
    assert reported_cached_tokens(b'{"usage": null}') is None
    assert reported_cached_tokens(b"not json") is None


def test_a_whole_answer_takes_the_prefill_legs_count() -> None:
    rewritten = json.loads(with_cached_tokens(WHOLE, 320))
    assert rewritten["usage"] == {
        "prompt_tokens": 1200,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 320},
    }
    assert rewritten["id"] == "x"


def test_a_streams_usage_chunk_takes_it_and_other_events_pass_as_they_came() -> None:
    token = b'data: {"choices": [{"delta": {"content": "prompt_tokens_details"}}]}\n\n'
    usage = b"data: " + WHOLE + b"\n\n"
    events = token + usage + b"data: [DONE]\n\n"
    out = with_cached_tokens(events, 0)
    parts = out.split(b"\n\n")
    assert parts[0] + b"\n\n" == token  # the text only looks like the key
    assert json.loads(parts[1][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert parts[2] == b"data: [DONE]"
    plain = b'data: {"choices": []}\n\n'
    assert with_cached_tokens(plain, 5) is plain


def test_answers_without_details_are_left_alone() -> None:
    body = b'{"usage": {"prompt_tokens": 3, "prompt_tokens_details": null}}'
    assert with_cached_tokens(body, 1) == body
