"""The verdict on each kind of reply an attempt can get (router/dispatch/place/verdict.py): whose answer it is,
what it costs the instance, and whether the request goes on elsewhere or ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import aiohttp
import pytest

from router.dispatch.place.sending import Sent
from router.dispatch.place.verdict import Verdict, judge


@dataclass
class _Reply:
    """What the verdict reads of an instance's answer: its status and headers."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)


def _answered(status: int, **headers: str) -> Sent:
    return Sent("answered", cast(aiohttp.ClientResponse, _Reply(status, headers)))


def _judged(sent: Sent, may_retry: bool = True, stream: bool = True) -> tuple[Verdict, int]:
    """The verdict, and how often it asked whether another attempt is allowed."""
    asked = 0

    def ask() -> bool:
        nonlocal asked
        asked += 1
        return may_retry

    return judge(sent, "engine-a", stream, ask), asked


@pytest.mark.parametrize("status", [200, 400, 404, 429, 500, 502])
def test_an_answer_is_the_clients_whatever_its_status(status: int) -> None:
    verdict, asked = _judged(_answered(status))
    assert verdict.serves and verdict.ends is None
    assert asked == 0  # nothing to retry: the attempts left are not looked up


def test_no_connection_goes_elsewhere_at_once_and_marks_the_instance_down() -> None:
    verdict, asked = _judged(Sent("not_connected", None, error=OSError("refused")))
    assert not verdict.serves and verdict.ends is None
    assert (verdict.counted, verdict.unreachable, verdict.admitted, verdict.withdraw) == (
        "connect",
        True,
        False,
        True,
    )
    assert not verdict.back_off and not verdict.retried and asked == 0


def test_a_dropped_connection_goes_elsewhere_after_a_backoff_while_retries_are_left() -> None:
    dropped = Sent("dropped", None, error=aiohttp.ServerDisconnectedError())
    verdict, asked = _judged(dropped)
    assert asked == 1 and verdict.ends is None
    assert verdict.retried and verdict.back_off and verdict.lost_transfer and verdict.withdraw
    assert verdict.failed and not verdict.unreachable  # its breaker counts it; one drop does not mark it down
    assert verdict.failure is not None and verdict.failure[0] == "dropped"


def test_a_dropped_connection_ends_the_request_once_no_retry_is_left() -> None:
    verdict, _ = _judged(Sent("dropped", None, error=aiohttp.ServerDisconnectedError()), may_retry=False)
    assert verdict.ends is not None and (verdict.ends.status, verdict.ends.code) == (502, "upstream_failed")
    assert not verdict.retried and not verdict.back_off


@pytest.mark.parametrize(("stream", "limit"), [(True, "first_byte_timeout_s"), (False, "response_timeout_s")])
def test_a_timeout_ends_the_request_since_it_may_still_run_there(stream: bool, limit: str) -> None:
    verdict, asked = _judged(Sent("timed_out", None, error=TimeoutError()), stream=stream)
    assert verdict.ends is not None and verdict.ends.status == 504 and limit in verdict.ends.message
    assert (verdict.counted, verdict.admitted, verdict.withdraw, asked) == ("timeout", True, False, 0)


def test_a_bad_answer_ends_the_request() -> None:
    verdict, _ = _judged(Sent("bad_answer", None, error=ValueError("not HTTP")))
    assert (
        verdict.ends is not None and verdict.ends.code == "upstream_failed" and verdict.counted == "response"
    )


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_router_key_goes_elsewhere_and_is_the_error_if_none_answers(status: int) -> None:
    verdict, _ = _judged(_answered(status))
    assert (
        not verdict.serves and verdict.ends is None and verdict.failed and verdict.counted == "unauthorized"
    )
    assert verdict.failure is not None and verdict.failure[1].code == "upstream_unauthorized"


def test_a_redirect_is_not_followed_and_names_where_it_leads() -> None:
    verdict, _ = _judged(_answered(302, Location="https://elsewhere.example/v1"))
    assert not verdict.serves and verdict.counted == "redirect" and verdict.failure is not None
    assert verdict.failure[0] == "redirected" and "https://elsewhere.example/v1" in verdict.failure[1].message


def test_busy_goes_elsewhere_without_blame_while_another_may_take_it() -> None:
    verdict, asked = _judged(_answered(503))
    assert not verdict.serves and verdict.retried and not verdict.failed and not verdict.back_off
    assert verdict.failure is None and asked == 1


def test_the_last_busy_instance_answers_the_client() -> None:
    verdict, _ = _judged(_answered(503), may_retry=False)
    assert verdict.serves
