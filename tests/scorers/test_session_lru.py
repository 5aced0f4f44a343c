"""The sessions' map shared by session affinity and the router's placements: bounded, least recently put first
out, read without being refreshed."""

from __future__ import annotations

from scorers.session_lru import SessionLRU


def test_put_answers_the_sessions_value_before() -> None:
    sessions = SessionLRU[str](max_sessions=4)
    assert sessions.put("s", "a") is None
    assert sessions.put("s", "b") == "a"
    assert sessions.get("s") == "b" and len(sessions) == 1


def test_the_least_recently_put_is_forgotten_first_and_get_does_not_refresh() -> None:
    sessions = SessionLRU[str](max_sessions=2)
    sessions.put("old", "a")
    sessions.put("kept", "a")
    assert sessions.get("old") == "a"  # read: still the least recently put
    sessions.put("new", "a")
    assert sessions.get("old") is None and len(sessions) == 2
    sessions.put("kept", "b")  # put again: now more recent than new
    sessions.put("newer", "a")
    assert sessions.get("new") is None and sessions.get("kept") == "b"


def test_a_forgotten_session_is_new_again() -> None:
    sessions = SessionLRU[str](max_sessions=2)
    sessions.put("s", "a")
    sessions.forget("s")
    sessions.forget("never")
    assert len(sessions) == 0 and sessions.put("s", "b") is None
