"""No function in router/ or scorers/ over 80 lines and no class over 400: a step that outgrows them is two."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400


def _oversized(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}: function {node.name}, {lines} lines")
            elif isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                found.append(f"{path.relative_to(ROOT)}: class {node.name}, {lines} lines")
    return found


@pytest.mark.parametrize("package", ["router", "scorers"])
def test_no_function_or_class_outgrows_its_bound(package: str) -> None:
    assert not _oversized(package)
