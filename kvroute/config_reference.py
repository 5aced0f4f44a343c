"""docs/configuration.md, made from the configuration's schema: the pydantic models of router/config.py and
the scorers' and pickers' parameter models, their types, defaults and descriptions.

    python -m kvroute.config_reference            # writes docs/configuration.md
    python -m kvroute.config_reference --check    # exit 1 when the page is not what the schema makes

The test suite runs the check, so the page cannot fall behind the code.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from router.config import RouterConfig
from scorers.registry import PICKERS, SCORERS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

_INTRO = """# Configuration reference

Made from the schema by `python -m kvroute.config_reference` (`make test` fails when this page is stale):
every key of a router configuration file (YAML), its type, its default and what it does. Unknown keys are
errors, and so is a value out of range; `kvroute check-config FILE` says which, by key path. A section's key
path is the YAML path to it: `models[]` is each item of the list `models`, `policies{}` each value of the
mapping `policies`.
"""


def render() -> str:
    parts = [_INTRO]
    parts += _sections("", RouterConfig)
    parts.append(
        "## Scorers and pickers\n\nA policy's `scorers` are `{type, weight, params}`, its `picker` "
        "`{type, params}`; the `params` of each type:\n"
    )
    for kind, registry in (("scorer", SCORERS), ("picker", PICKERS)):
        for name, registration in registry.items():
            parts.append(_table(f"{kind} `{name}`", registration.params, level=3))
    return "\n".join(parts)


def _sections(path: str, model: type[BaseModel]) -> Iterator[str]:
    """The model's table, then a section for each model nested in it, depth first."""
    yield _table(f"`{path}`" if path else "The top level", model, level=2)
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is not None:
            inner, suffix = nested
            yield from _sections(f"{path}.{name}{suffix}".lstrip("."), inner)


def _table(title: str, model: type[BaseModel], level: int) -> str:
    lines = [f"{'#' * level} {title}", ""]
    if model.__doc__ and model.__module__.startswith(("router", "scorers")) and model.__doc__.strip():
        lines += [" ".join(model.__doc__.split()), ""]
    if not model.model_fields:
        return "\n".join([*lines, "No parameters.", ""])
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        cells = [f"`{name}`", _type_name(field.annotation), _default(field), field.description or ""]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join([*lines, ""])


def _nested_model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """A model the field holds (itself, in a list or as a mapping's values, or optional), with the suffix
    its key path takes."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if origin is list and args:
        found = _nested_model(args[0])
        return (found[0], "[]") if found else None
    if origin is dict and len(args) == 2:
        found = _nested_model(args[1])
        return (found[0], "{}") if found else None
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            found = _nested_model(arg)
            if found:
                return found
    return None


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in args)
    if origin is typing.Literal:
        return " or ".join(json.dumps(arg) for arg in args)
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type_name(args[1])}" if len(args) == 2 else "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "see its section"
    if isinstance(value, dict) and any(isinstance(v, BaseModel) for v in value.values()):
        return ", ".join(f"`{key}`" for key in value)
    return f"`{json.dumps(value, default=str)}`"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale, writing nothing")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE} is stale: run python -m kvroute.config_reference", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
