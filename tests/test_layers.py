"""The packages' layering: imports point one way, and no module takes part in a cycle.

Every import counts, at module level, inside functions and under TYPE_CHECKING alike: a cycle hidden in a
function is still one that a reader has to untangle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "scorers", "fleet", "kvroute", "tinymodel", "kvconnectors")

# Within router, a layer may import its own and those listed after it, never one before it. The request's way
# is http or epp -> dispatch (the conductor, then its stages) -> upstreams -> index -> prompt; metrics and
# errors are the floor. Any of them may
# use scorers/, which uses nothing of the router's.
ROUTER_LAYERS: list[set[str]] = [
    {"router.http", "router.epp"},
    {"router.reload"},
    {"router.runtime"},
    # Discovery hands what it finds to the runtime through a callback (FleetSink), which starts it.
    {"router.discovery"},
    # The conductor, then its stages in the order a request meets them, each importing only those after it;
    # the request context and the routed APIs are their floor.
    {"router.dispatch.conductor", "router.dispatch.assembly"},
    {"router.dispatch.intake"},
    {"router.dispatch.wait"},
    {"router.dispatch.answer"},
    {"router.dispatch.place"},
    {"router.dispatch.observe"},
    {"router.dispatch.decide"},
    {"router.dispatch"},
    # What the receive stage reads of each API that needs the fleet or the replicas' store: a stored
    # response's instance, its conversation.
    {
        "router.apis.read",
        "router.apis.responses.ids",
        "router.apis.responses.stored",
        "router.apis.messages.read",
    },
    # Agent programs: what the observe stage tells them, and what waiting reads of them.
    {"router.programs"},
    # A request's spans: dispatch opens them; what they read of a decision is described, not imported.
    {"router.tracing"},
    # What replicas share through their store: over the upstreams' load and flow control's counts.
    {"router.shared"},
    {"router.upstreams"},
    {"router.index"},
    {
        "router.config",
        "router.strict_yaml",
        "router.tracing.config",
        "router.programs.settings",
        "router.shared.settings",
        "router.settings_base",
        "router.upstreams.settings",
        "router.index.settings",
        "router.discovery.settings",
        "router.dispatch.wait.settings",
        "router.dispatch.place.settings",
        "router.dispatch.intake.settings",
        "router.http.settings",
        "router.prompt.settings",
    },
    # Each API's body and the chat vLLM renders for it (router/apis/, a folder an API).
    {"router.apis"},
    {"router.prompt"},
    {
        "router.metrics",
        "router.errors",
        "router.allocator",
        "router.worker_threads",
        "router.bounded_read",
        "router.supervisor",
        "router.label_selector",
        "router.traffic_split",
    },
]
# The two front doors share everything below them and nothing of each other.
FRONT_DOORS = ("router.http", "router.epp")
# What the simulated fleet shares with the router: the prompt's rendering (the agents' APIs' as chats) and the
# KV event wire format.
FLEET_MAY_IMPORT = (
    "router.prompt",
    "router.apis.openai_body",
    "router.apis.responses.chat",
    "router.apis.messages.chat",
    "router.index.events",
    "tinymodel",
    "fleet",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> Iterator[str]:
    """The project's modules that path imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports the module; `from module import name` the module.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


GRAPH = {name: set(_imports(path, name, set(_modules()))) for name, path in _modules().items()}


def _layer(module: str) -> int | None:
    """The most specific layer a router module is in."""
    best: tuple[int, int] | None = None
    for index, prefixes in enumerate(ROUTER_LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def test_every_router_module_has_a_layer() -> None:
    unplaced = [m for m in GRAPH if m.startswith("router.") and _layer(m) is None]
    assert not unplaced


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("router")))
def test_router_imports_point_down(module: str) -> None:
    upward = [t for t in GRAPH[module] if not t.startswith(("router", "scorers", "tinymodel"))]
    assert not upward, f"{module} imports outside router: {upward}"
    if module == "router":
        return
    layer = _layer(module)
    assert layer is not None
    above = [t for t in GRAPH[module] if t.startswith("router.") and (_layer(t) or 0) < layer]
    assert not above, f"{module} imports from a layer above it: {above}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(FRONT_DOORS)))
def test_front_doors_import_nothing_of_each_other(module: str) -> None:
    other = FRONT_DOORS[1] if module.startswith(FRONT_DOORS[0]) else FRONT_DOORS[0]
    crossing = [t for t in GRAPH[module] if t == other or t.startswith(other + ".")]
    assert not crossing, f"{module} imports the other front door: {crossing}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("scorers")))
def test_scorers_import_nothing_of_the_router(module: str) -> None:
    """The scoring framework and its plugins stand alone: the router hands them what they read."""
    others = [t for t in GRAPH[module] if not t.startswith("scorers")]
    assert not others, f"{module} imports {others}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("fleet")))
def test_fleet_imports_only_what_it_shares_with_the_router(module: str) -> None:
    others = [t for t in GRAPH[module] if not t.startswith(FLEET_MAY_IMPORT)]
    assert not others, f"{module} imports {others}"


@pytest.mark.parametrize("package", ["tinymodel", "kvconnectors"])
def test_imports_nothing_of_the_project(package: str) -> None:
    """tinymodel is shared by all; kvconnectors runs inside vLLM, where nothing else of the project is."""
    assert not [
        t
        for m, targets in GRAPH.items()
        if m.startswith(package)
        for t in targets
        if not t.startswith(package)
    ]


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components: any with more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in GRAPH.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not cycles


STAGES = ("admit", "receive", "prepare", "wait", "place")  # as Conductor.conduct calls them
DOORS = (ROOT / "router/http/proxy.py", ROOT / "router/epp/picking.py")


def _called(function: ast.AST) -> list[str]:
    """The names of what function calls, in the order they appear."""
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)]
    calls.sort(key=lambda call: (call.lineno, call.col_offset))
    names = []
    for call in calls:
        if isinstance(call.func, ast.Attribute):
            names.append(call.func.attr)
        elif isinstance(call.func, ast.Name):
            names.append(call.func.id)
    return names


def test_the_conductor_runs_every_stage_once_in_order() -> None:
    tree = ast.parse((ROOT / "router/dispatch/conductor.py").read_text())
    conduct = next(
        node for node in ast.walk(tree) if isinstance(node, ast.AsyncFunctionDef) and node.name == "conduct"
    )
    assert [name for name in _called(conduct) if name in STAGES] == list(STAGES)


@pytest.mark.parametrize("door", DOORS, ids=lambda path: path.parent.name)
def test_a_door_runs_no_stage_itself(door: Path) -> None:
    """A door hands the conductor its request and says how it is placed: the stages before placing are
    the conductor's alone, so no door can run them out of order or forget to free a slot."""
    called = _called(ast.parse(door.read_text()))
    assert "conduct" in called
    assert not {"admit", "receive", "prepare", "wait", "wait_turn"} & set(called)
