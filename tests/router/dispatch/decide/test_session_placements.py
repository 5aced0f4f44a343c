"""A session's turns counted as first, same (the instance of its last turn) or moved."""

from __future__ import annotations

from router.dispatch.decide.session_placements import SessionPlacements


def test_turns_are_placed_against_the_sessions_last() -> None:
    placements = SessionPlacements()
    turns = [("s", "a"), ("s", "a"), ("t", "a"), ("s", "b"), ("s", "b"), ("t", "b")]
    assert [placements.record(*turn) for turn in turns] == [
        "first",
        "same",
        "first",
        "moved",
        "same",
        "moved",
    ]


def test_the_least_recently_seen_session_is_forgotten_first() -> None:
    placements = SessionPlacements(max_sessions=2)
    for session in ("old", "kept", "old", "new"):  # "old" seen again: "kept" is the least recent
        placements.record(session, "a")
    assert len(placements) == 2
    assert placements.record("old", "a") == "same"
    assert placements.record("kept", "a") == "first"
