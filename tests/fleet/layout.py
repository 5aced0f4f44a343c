"""The layout of OpenAI bodies, to compare the fleet's answers with real vLLM's key for key."""

from __future__ import annotations

import json
from typing import Any


def key_paths(value: Any, path: str = "") -> list[str]:
    """Every key, dotted, in order: the first choice and the first data item stand for all."""
    paths = []
    if isinstance(value, dict):
        for key, item in value.items():
            paths.append(path + key)
            if key == "choices" and item:
                paths += key_paths(item[0], f"{path}{key}[0].")
            elif isinstance(item, dict) and key != "error":
                paths += key_paths(item, f"{path}{key}.")
            elif key == "data" and isinstance(item, list) and item:
                paths += key_paths(item[0], f"{path}{key}[0].")
    return paths


def sse_chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
