"""pyproject.toml's dependencies are what `kvroute serve` and `kvroute epp` import: each of them is imported
there, and everything imported there is one of them. What only the tools import is in the extras.

What serve and epp run is read from the source: every import in router/ and scorers/ and in the project's
modules they reach, and from kvroute/cli.py on, every project module it reaches, save the imports a command
makes inside ``requires_extra`` (kvroute/extras.py: the tools') and those under TYPE_CHECKING. An import is
matched to the installed distribution whose files hold that module (``opentelemetry.trace`` is
opentelemetry-api's, though many distributions share ``opentelemetry``); a declared distribution that holds
no module of its own (a meta-package) stands for those it requires.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from kvroute.extras import PROJECT_PACKAGES, requires_extra

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_ROOTS = ("router", "scorers")
CLI = "kvroute.cli"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return _normalized(match.group())


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RUNTIME = {_requirement_name(r) for r in PROJECT["dependencies"]}
EXTRAS = {
    extra: {_requirement_name(r) for r in requirements} - {"kvroute"}
    for extra, requirements in PROJECT["optional-dependencies"].items()
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    _module_name(path): path for package in PROJECT_PACKAGES for path in (ROOT / package).rglob("*.py")
}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_requires_extra(node: ast.With) -> bool:
    return any(
        isinstance(item.context_expr, ast.Call)
        and isinstance(item.context_expr.func, ast.Name)
        and item.context_expr.func.id == "requires_extra"
        for item in node.items
    )


def _run_time_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports under node that serve or epp may run: not the tools' nor the type checker's."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children: list[ast.AST] = list(node.orelse)
    elif isinstance(node, ast.With) and _is_requires_extra(node):
        children = []
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from _run_time_imports(child)


def _imported_names(module: str) -> Iterator[str]:
    """The dotted names module imports, most specific first where a name may be a module or an attribute."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _run_time_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        yield from (f"{base}.{alias.name}" for alias in node.names)


def _project_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _with_parents(module: str) -> Iterator[str]:
    """module and the packages importing it runs first."""
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        if ".".join(parts[:end]) in MODULES:
            yield ".".join(parts[:end])


@cache
def _serve_and_epp() -> dict[str, set[str]]:
    """The third-party names the modules serve and epp run import, and where."""
    start = [CLI, *(m for m in MODULES if m.split(".")[0] in RUNTIME_ROOTS)]
    seen: set[str] = set()
    pending = [parent for module in start for parent in _with_parents(module)]
    third_party: dict[str, set[str]] = {}
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in _imported_names(module):
            top = name.partition(".")[0]
            if top in PROJECT_PACKAGES:
                target = _project_module(name)
                if target is not None:
                    pending.extend(_with_parents(target))
            elif top not in sys.stdlib_module_names and top != "__future__":
                third_party.setdefault(name, set()).add(str(MODULES[module].relative_to(ROOT)))
    return third_party


@cache
def _providers() -> dict[str, frozenset[str]]:
    """Each dotted module or package name the installed distributions' files hold, and which hold it."""
    found: dict[str, set[str]] = {}
    for distribution in importlib.metadata.distributions():
        name = _normalized(distribution.metadata["Name"])
        for file in distribution.files or ():
            parts = file.parts
            if not parts or parts[0] == ".." or "__pycache__" in parts or parts[0].endswith(".dist-info"):
                continue
            if file.suffix == ".py":
                dotted = [*parts[:-1], file.stem]
            elif file.suffix in (".so", ".pyd"):
                dotted = [*parts[:-1], parts[-1].partition(".")[0]]
            else:
                continue
            if dotted[-1] == "__init__":
                dotted.pop()
            for end in range(1, len(dotted) + 1):
                found.setdefault(".".join(dotted[:end]), set()).add(name)
    return {module: frozenset(names) for module, names in found.items()}


def _distributions_of(name: str) -> frozenset[str]:
    """The installed distributions holding the module name imports (the longest name one of them holds)."""
    providers = _providers()
    while name and name not in providers:
        name = name.rpartition(".")[0]
    return providers.get(name, frozenset())


def _stands_for(distribution: str) -> set[str]:
    """distribution, or, for a meta-package (no module of its own), the distributions it requires."""
    holds_modules = any(distribution in names for names in _providers().values())
    if holds_modules:
        return {distribution}
    requires = importlib.metadata.requires(distribution) or []
    return {
        stood
        for requirement in requires
        if "extra ==" not in requirement
        for stood in _stands_for(_requirement_name(requirement))
    }


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_runtime_dependencies_are_installed() -> None:
    assert not [d for d in sorted(RUNTIME) if not _installed(d)], "run `make setup`"


def test_serve_and_epp_import_only_runtime_dependencies() -> None:
    declared = {stood for distribution in RUNTIME for stood in _stands_for(distribution)}
    undeclared: dict[str, set[str]] = {}
    for name, files in _serve_and_epp().items():
        if not _distributions_of(name) & declared:
            holders = " or ".join(sorted(_distributions_of(name))) or f"{name} (installed by nothing)"
            undeclared.setdefault(holders, set()).update(files)
    assert not {holders: sorted(files) for holders, files in sorted(undeclared.items())}, (
        "serve or epp imports these, which pyproject.toml's dependencies do not name (an extra's library is "
        "imported inside `with requires_extra(...)`, kvroute/extras.py)"
    )


@pytest.mark.parametrize("distribution", sorted(RUNTIME))
def test_each_runtime_dependency_is_imported_by_serve_or_epp(distribution: str) -> None:
    imported = {d for name in _serve_and_epp() for d in _distributions_of(name)}
    assert _stands_for(distribution) & imported, (
        f"{distribution} is a runtime dependency, yet neither serve nor epp imports it: an extra's, or none"
    )


def test_the_extras_hold_no_runtime_dependency() -> None:
    assert {extra: sorted(names & RUNTIME) for extra, names in EXTRAS.items() if names & RUNTIME} == {}


def _without_the_tools_libraries(code: str) -> subprocess.CompletedProcess[str]:
    """code run by a Python to which what the fleet and bench extras add cannot be imported."""
    hidden = sorted(
        {
            module
            for distribution in EXTRAS["fleet"] | EXTRAS["bench"]
            for module, names in _providers().items()
            if "." not in module and names == {distribution}
        }
    )
    assert "cbor2" in hidden
    prelude = f"import sys\nfor name in {hidden!r}:\n    sys.modules[name] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_serve_and_epp_start_without_the_tools_libraries() -> None:
    for command in ("serve", "epp"):
        done = _without_the_tools_libraries(f"from kvroute.cli import main\nmain([{command!r}, '--help'])")
        assert done.returncode == 0, done.stderr
        assert "--config" in done.stdout


def test_a_tools_command_without_its_extra_names_what_to_install() -> None:
    done = _without_the_tools_libraries("from kvroute.cli import main\nsys.exit(main(['fleet']))")
    assert done.returncode == 2
    assert done.stderr == (
        "kvroute: this command needs cbor2: install kvroute[fleet] (in a checkout: pip install '.[fleet]')\n"
    )


def test_an_extra_not_installed_is_named_before_the_command_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    installed, required = importlib.metadata.distribution, importlib.metadata.requires

    def distribution(name: str) -> importlib.metadata.Distribution:
        if _normalized(name) in ("matplotlib", "cbor2"):
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)

    def requires(name: str) -> list[str] | None:
        """kvroute's as pyproject.toml has them now, whatever an older install recorded."""
        if name != "kvroute":
            return required(name)
        extras = PROJECT["optional-dependencies"].items()
        return [*PROJECT["dependencies"], *(f'{r}; extra == "{e}"' for e, rs in extras for r in rs)]

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(importlib.metadata, "requires", requires)
    with pytest.raises(SystemExit) as exited, requires_extra("bench"):
        pytest.fail("the command ran")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute: this command needs cbor2, matplotlib: install kvroute[bench]"), err


def test_the_fleets_hash_algorithms_are_the_ones_it_offers() -> None:
    """kvroute fleet names them without importing the fleet (cbor2 is kvroute[fleet]'s)."""
    from fleet.block_pool import HASH_ALGORITHMS
    from kvroute.cli import _parser

    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    option = next(a for a in commands.choices["fleet"]._actions if a.dest == "prefix_caching_hash_algo")
    assert sorted(option.choices or ()) == sorted(HASH_ALGORITHMS)
    assert option.default in HASH_ALGORITHMS


def test_both_otlp_exporters_import_beside_envoys_api() -> None:
    """xds-protos ships an older copy of opentelemetry-proto's files; the install must leave the exporters' own."""
    code = (
        "from envoy.service.ext_proc.v3 import external_processor_pb2\n"
        "from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
    )
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr[-2000:]
