"""freeze_startup_objects: start-up's objects out of the collector's walks, and how often the young
generation is collected after it (less often for `serve`, Python's default for the endpoint picker)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from router.upstreams.http_session import freeze_startup_objects

_PYTHON_DEFAULT = (700, 10, 10)


@pytest.fixture
def restored_collector() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(*_PYTHON_DEFAULT)
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_what_start_up_built_is_out_of_the_collectors_walks(restored_collector: None) -> None:
    start_up = [[index] for index in range(1_000)]  # containers the collector tracks
    assert any(tracked is start_up for tracked in gc.get_objects())
    freeze_startup_objects()
    assert gc.get_freeze_count() >= len(start_up)
    assert not any(tracked is start_up for tracked in gc.get_objects())  # in no generation a collection walks


@pytest.mark.parametrize(
    ("fewer_young_collections", "thresholds"),
    [(True, (20_000, 20, 20)), (False, _PYTHON_DEFAULT)],
    ids=["serve", "endpoint-picker"],
)
def test_the_young_generation_is_collected_as_asked(
    restored_collector: None, fewer_young_collections: bool, thresholds: tuple[int, int, int]
) -> None:
    freeze_startup_objects(fewer_young_collections=fewer_young_collections)
    assert gc.get_threshold() == thresholds
