"""Signatures stay short: what travels together travels as one value (a dataclass), not as a row of
parameters every caller has to line up."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 6  # besides self or cls
PACKAGES = ("router", "scorers")


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    named = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None)


def test_no_function_takes_more_than_six_parameters() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_parameters(node)})"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > MAX_PARAMETERS
    ]
    assert not long, long
