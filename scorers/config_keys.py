""" "Did you mean": the key a misspelt configuration key was likely meant to be, among those its place
takes."""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping, Sequence
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import ErrorDetails


def suggested(message: str, model: type[BaseModel], error: ErrorDetails) -> str:
    """message about error (from validating model), with the key meant when it is an unknown key close to
    one its place takes."""
    if error["type"] == "extra_forbidden" and (meant := close_key(model, error["loc"])) is not None:
        return f"{message} (did you mean {meant}?)"
    return message


def close_key(model: type[BaseModel], loc: Sequence[int | str]) -> str | None:
    """For an unknown key at loc (its path from model), the closest key the model there has, if one is
    close."""
    *parent, key = loc
    place = _model_at(model, parent)
    if place is None or not isinstance(key, str):
        return None
    close = difflib.get_close_matches(key, list(place.model_fields), n=1, cutoff=0.75)
    return close[0] if close else None


def _model_at(model: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model whose fields the key path loc runs into, through lists, mappings and optional values."""
    current: Any = model
    for part in loc:
        current = _without_none(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return None
            current = field.annotation
        elif get_origin(current) in (list, tuple, dict, Sequence, Mapping):
            args = get_args(current)
            current = args[-1] if args else None  # a list's items, a mapping's values
        else:
            return None
    current = _without_none(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _without_none(hint: Any) -> Any:
    if get_origin(hint) in (Union, types.UnionType):
        kinds = [kind for kind in get_args(hint) if kind is not type(None)]
        return kinds[0] if len(kinds) == 1 else hint
    return hint
