"""What a command says when the optional part of kvroute it needs (an extra of pyproject.toml) is missing.

`serve`, `epp`, `check-config`, `build-model` and `stack` need only kvroute's dependencies; the simulated
fleet and the demo need kvroute[fleet], the benchmarks kvroute[bench]. A command imports what they add
inside ``requires_extra`` (tests/test_dependencies.py reads those imports as the tools', not the router's).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import sys
from collections.abc import Iterator
from typing import NoReturn

PROJECT_PACKAGES = ("router", "scorers", "fleet", "kvroute", "tinymodel", "kvconnectors")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_EXTRAS = re.compile(r"\[([^\]]*)\]")
_FOR_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


@contextlib.contextmanager
def requires_extra(extra: str) -> Iterator[None]:
    """Around a command's imports: what kvroute[extra] installs missing (a distribution, or a module its
    imports need) ends the command at once with exit status 2 and what to install, not a traceback."""
    missing = _missing(extra)
    if missing:
        _exit(extra, ", ".join(missing))
    try:
        yield
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.partition(".")[0] in PROJECT_PACKAGES:
            raise
        _exit(extra, exc.name)


def _exit(extra: str, missing: str) -> NoReturn:
    print(
        f"kvroute: this command needs {missing}: install kvroute[{extra}] "
        f"(in a checkout: pip install '.[{extra}]')",
        file=sys.stderr,
    )
    raise SystemExit(2)


def _missing(extra: str) -> list[str]:
    """The distributions kvroute[extra] names that are not installed; none known where kvroute is not
    installed itself (a source tree on the path), and its imports tell."""
    try:
        requirements = importlib.metadata.requires("kvroute") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing: list[str] = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        if _FOR_EXTRA.findall(marker) != [extra] or not (name := _NAME.match(spec.strip())):
            continue
        if name.group() == "kvroute":
            included = _EXTRAS.search(spec)
            for other in included.group(1).split(",") if included else ():
                missing.extend(_missing(other.strip()))
            continue
        try:
            importlib.metadata.distribution(name.group())
        except importlib.metadata.PackageNotFoundError:
            missing.append(name.group())
    return missing
