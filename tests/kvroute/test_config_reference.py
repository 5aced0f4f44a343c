"""docs/configuration.md is what the schema makes, and the schema describes every key."""

from __future__ import annotations

from pydantic import BaseModel

from kvroute.config_reference import PAGE, _nested_model, main, render
from router.config import RouterConfig
from scorers.registry import PICKERS, SCORERS


def test_the_page_is_what_the_schema_makes() -> None:
    """Stale after a change to router/config.py or a scorer's parameters: python -m kvroute.config_reference"""
    assert PAGE.read_text() == render()
    assert main(["--check"]) == 0


def _undescribed(model: type[BaseModel], path: str, seen: set[type[BaseModel]]) -> list[str]:
    missing = []
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is None and not field.description:
            missing.append(f"{path}{name}")
        if nested is not None and nested[0] not in seen:
            seen.add(nested[0])
            missing += _undescribed(nested[0], f"{path}{name}{nested[1]}.", seen)
    return missing


def test_every_key_is_described() -> None:
    models = [(RouterConfig, "")] + [
        (registration.params, f"{name}.")
        for registry in (SCORERS, PICKERS)
        for name, registration in registry.items()
    ]
    missing = [key for model, path in models for key in _undescribed(model, path, set())]
    assert missing == []
