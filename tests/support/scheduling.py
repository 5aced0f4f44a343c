"""How `pytest -n 2` shares the tests between its workers: each file whole on one worker (its module's
fixtures start once), and every test that starts real engines on the same worker, one after another (two vLLM
stacks at once would not fit the machine's two cores, and the stack's session fixture starts once)."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

_REAL_ENGINES = ("tests/stack/", "tests/deploy/test_image.py")


def starts_engines(nodeid: str) -> bool:
    return nodeid.startswith(_REAL_ENGINES)


class EnginesTogether(LoadScopeScheduling):
    """xdist's per-file scheduling, the files that start real engines one unit. Run with
    --no-loadscope-reorder, the units go out in the order of the collection, where that unit comes first: the
    longest, it starts at once and the other worker takes the rest meanwhile."""

    def _split_scope(self, nodeid: str) -> str:
        return "real engines" if starts_engines(nodeid) else nodeid.split("::", 1)[0]
