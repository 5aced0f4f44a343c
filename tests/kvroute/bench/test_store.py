"""`kvroute bench store` runs its three operations on a real redis-server and a real nats-server."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.bench.store import run


def test_each_operation_is_timed_on_both_engines_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "store.json"
    figures = run(100, str(out))
    assert sorted((f.engine, f.operation) for f in figures) == [
        (engine, operation)
        for engine in ("nats", "redis")
        for operation in ("conversation", "fan-out", "limit")
    ]
    for figure in figures:
        assert figure.errors == 0, figure
        assert 0 < figure.p50_us <= figure.p99_us, figure
        assert figure.ops_per_s > 0 and figure.cpu_us_per_op > 0, figure
    assert len(json.loads(out.read_text())) == 6
