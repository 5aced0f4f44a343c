"""An engine profile: the simulated engine's timing and memory as measured on a real engine, as JSON that
`kvroute bench simulate --profile` loads and `kvroute bench calibrate` writes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvroute.simulate.hardware import EngineSpec


@dataclass(frozen=True)
class Profile:
    engine: EngineSpec
    source: str  # what was measured: the engine, its model, when
    measured: dict[str, Any] = field(default_factory=dict)  # what the engine spec was fitted to
    check: dict[str, Any] = field(default_factory=dict)  # the simulator against the engine on a fixed trace

    def write(self, path: Path) -> None:
        document = {"engine": asdict(self.engine), "source": self.source, "measured": self.measured}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**document, "check": self.check}, indent=2) + "\n")


def load_profile(path: Path) -> Profile:
    """A profile written by `kvroute bench calibrate`, or by hand: `engine` holds EngineSpec's fields."""
    try:
        document = json.loads(path.read_text())
        engine: Mapping[str, Any] = document["engine"]
        unknown = set(engine) - {f.name for f in fields(EngineSpec)}
        if unknown:
            raise ValueError(f"unknown engine fields {sorted(unknown)}")
        return Profile(
            EngineSpec(**engine),
            str(document.get("source", "")),
            document.get("measured") or {},
            document.get("check") or {},
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not an engine profile: {exc}") from exc
