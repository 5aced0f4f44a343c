"""docs/extending.md's recipes, followed: each file and name it points at is where it says, and a scorer, a
filter and an API added as it says are used by a router serving real requests (in this process, against the
simulated fleet). Its recipes for a request stage and a front door are checked by tests/test_layers.py (the
conductor's stages, once each and in order; a door runs none itself)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from kvroute.processes import FleetPorts
from router.apis.routes import ROUTED_PATHS, Api
from router.config import ConfigError, parse_config
from router.upstreams.filters import HEALTHY
from scorers import registry
from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.request import RoutingRequest
from tests.support.http import post
from tests.support.in_process import serving

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "docs" / "extending.md"
POLICY_HEADER = "x-kvroute-policy"
INSTANCE_HEADER = "x-kvroute-instance"
REQUESTS = 6

_CODE = re.compile(r"`([^`]+)`")
_PATH = re.compile(r"[\w./-]+(\.py|\.pxd|/)")
# A name the recipes say a file defines: a class, function or constant, a method as Class.method, a call's
# signature as name(args).
_NAME = re.compile(r"(?P<name>[A-Za-z_]\w*(\.[A-Za-z_]\w*)?)(\(.*\))?")
_MODULE = re.compile(r"(router|scorers)(\.\w+)+")


def _spans() -> list[str]:
    return _CODE.findall(RECIPES.read_text())


@cache
def _defined(path: Path) -> frozenset[str]:
    """The names path defines at its top level and in its classes (as Class.name and as name)."""
    if path.suffix == ".pxd":  # Cython: its cdef classes and their fields
        return frozenset(re.findall(r"\b(\w+)\s*(?:[:(;]|$)", path.read_text(), re.MULTILINE))
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            for member in ast.walk(node):
                for name in _assigned(member):
                    names |= {name, f"{node.name}.{name}"}
        names.update(_assigned(node))
    return frozenset(names)


def _assigned(node: ast.AST) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _files() -> list[Path]:
    return [ROOT / span for span in _spans() if _PATH.fullmatch(span) and "/" in span]


def test_every_file_and_folder_the_recipes_name_exists() -> None:
    named = [span for span in _spans() if _PATH.fullmatch(span)]
    assert named
    # A bare file name would be ambiguous once a second module takes it: the recipes give paths.
    assert [span for span in named if "/" not in span] == []
    assert [span for span in named if not (ROOT / span).exists()] == []
    modules = [span for span in _spans() if _MODULE.fullmatch(span)]
    assert [m for m in modules if importlib.util.find_spec(m) is None] == []


def test_every_name_the_recipes_give_is_defined_in_a_file_they_name() -> None:
    """A renamed function (`_forward`, once, where the calls had moved to `_traced`) fails here."""
    defined = frozenset().union(*(_defined(path) for path in _files() if path.is_file()))
    names = [
        found["name"]
        for span in _spans()
        if not _PATH.fullmatch(span) and not _MODULE.fullmatch(span) and (found := _NAME.fullmatch(span))
    ]
    assert len(names) > 20
    assert [name for name in names if name not in defined] == []


class PreferredParams(Params):
    instance: str


class Preferred:
    """The recipe's scorer: 1 for the instance its parameters name, 0 for the others."""

    def __init__(self, params: PreferredParams) -> None:
        self._instance = params.instance

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [float(c.name == self._instance) for c in candidates]


class Without:
    """The recipe's filter: every candidate but the one named."""

    def __init__(self, instance: str) -> None:
        self._instance = instance

    def filter(self, request: RoutingRequest, candidates: list[Any]) -> list[Any]:
        return [c for c in candidates if c.name != self._instance]


def _chat(url: str, policy: str) -> str:
    """The instance a chat forced to policy was served by."""
    body = {"model": "tiny-llama", "max_tokens": 1, "messages": [{"role": "user", "content": "hello"}]}
    status, headers, payload = post(
        url + "/v1/chat/completions", json.dumps(body).encode(), {POLICY_HEADER: policy}
    )
    assert status == 200, payload
    return {k.lower(): v for k, v in headers.items()}[INSTANCE_HEADER]


def test_a_scorer_registered_as_the_recipe_says_routes_by_its_parameters(
    fleet: FleetPorts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry.SCORERS, "preferred", Registration(PreferredParams, Preferred))
    policies = {
        name: {"scorers": [{"type": "preferred", "params": {"instance": name}}]}
        for name in ("fleet-1", "fleet-2")
    }
    with serving(fleet.router_config(policies=policies, default_policy="fleet-1")) as url:
        assert {_chat(url, "fleet-1") for _ in range(REQUESTS)} == {"fleet-1"}
        assert {_chat(url, "fleet-2") for _ in range(REQUESTS)} == {"fleet-2"}
    # Its parameters are checked as the built-in scorers' are: strictly, by name.
    typo = {"p": {"scorers": [{"type": "preferred", "params": {"instanse": "fleet-1"}}]}}
    with pytest.raises(ConfigError, match=r"params\.instanse: .*did you mean instance"):
        parse_config(fleet.router_config(policies=typo, default_policy="p"))


def test_a_filter_added_to_healthy_keeps_its_instance_from_every_request(
    fleet: FleetPorts, monkeypatch: pytest.MonkeyPatch
) -> None:
    for leg, filters in list(HEALTHY.items()):  # every leg: a whole request is a decode leg's
        monkeypatch.setitem(HEALTHY, leg, (*filters, Without("fleet-0")))
    with serving(fleet.router_config()) as url:
        served = {_chat(url, "round-robin") for _ in range(REQUESTS)}
    assert served == {"fleet-1", "fleet-2"}


def test_an_api_added_to_the_routed_paths_is_routed_to_an_instance(
    fleet: FleetPorts, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = "/v1/audio/transcriptions"
    body = json.dumps({"model": "tiny-llama"}).encode()
    with serving(fleet.router_config()) as url:
        status, headers, _ = post(url + path, body)
    assert status == 404 and INSTANCE_HEADER not in {k.lower() for k in headers}  # the router's own 404
    monkeypatch.setitem(ROUTED_PATHS, path, Api("transcriptions", "model_only"))
    with serving(fleet.router_config()) as url:
        status, headers, _ = post(url + path, body)
    # The simulated engine serves no transcriptions: its own 404, relayed from the instance chosen.
    assert status == 404 and INSTANCE_HEADER in {k.lower() for k in headers}
