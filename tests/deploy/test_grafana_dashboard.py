"""configs/grafana-kvroute.json: a well-formed Grafana dashboard whose queries read only what the router exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from router.index.block_index import BlockIndex
from router.index.figures import figures_of
from router.index.index_metrics import IndexCollector
from router.metrics import Family, RouterMetrics

DASHBOARD_PATH = Path(__file__).resolve().parents[2] / "configs" / "grafana-kvroute.json"
GRID_COLUMNS = 24
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}

_NAME = re.compile(r"kvroute_[a-z0-9_]+")
_SELECTOR = re.compile(r"(kvroute_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_VARIABLE = re.compile(r"\$\{?(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((kvroute_[a-z0-9_]+),\s*(\w+)\)$")
# What Prometheus scrapes of a family, by type: counters end in _total, histograms come in three parts.
_SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _walk(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _walk(panel.get("panels", []))  # a collapsed row holds its panels


DASHBOARD: dict[str, Any] = json.loads(DASHBOARD_PATH.read_text())
PANELS = list(_walk(DASHBOARD["panels"]))
CHARTS = [p for p in PANELS if p["type"] != "row"]
QUERIES = [
    pytest.param(target, id=f"{panel['title']}/{target.get('refId')}")
    for panel in CHARTS
    for target in panel.get("targets", [])
]
VARIABLES = {v["name"]: v for v in DASHBOARD["templating"]["list"]}


class Series(NamedTuple):
    family: str
    labels: frozenset[str]


def _exported_series() -> dict[str, Series]:
    """Every series name the router's registry exposes -> its family and the label names it carries."""
    metrics = RouterMetrics()
    index = BlockIndex(block_size=16)
    index.apply(("fleet-0", 0), [])  # an instance the index knows, so its per-tier series exist
    metrics.registry.register(IndexCollector(lambda: figures_of(index, [])))
    for family in vars(metrics).values():
        if isinstance(family, Family):  # one child each, so the samples show every family's label names
            family(*["x"] * len(family.metric._labelnames))
    series: dict[str, Series] = {}
    for family in metrics.registry.collect():
        labels = frozenset(name for sample in family.samples for name in sample.labels) - {"le"}
        for suffix in _SERIES_SUFFIXES[family.type]:
            series[family.name + suffix] = Series(
                family.name, labels | {"le"} if suffix == "_bucket" else labels
            )
    return series


EXPORTED = _exported_series()


def metric_names(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def _labels(names: Iterable[str]) -> set[str]:
    return {label.strip() for group in names for label in group.split(",") if label.strip()}


def test_is_a_dashboard_with_a_prometheus_datasource_variable() -> None:
    assert DASHBOARD["title"] and DASHBOARD["uid"]
    assert isinstance(DASHBOARD["schemaVersion"], int) and DASHBOARD["schemaVersion"] >= 36
    datasource = VARIABLES["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    assert CHARTS and all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in CHARTS)


def test_panels_have_unique_ids_and_fit_the_grid_without_overlapping() -> None:
    ids = [p["id"] for p in PANELS]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids)
    taken: dict[tuple[int, int], str] = {}
    for panel in PANELS:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) and grid[k] >= 0 for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[x, y]}"
                taken[x, y] = panel["title"]


def test_every_chart_has_queries_with_distinct_ref_ids() -> None:
    for panel in CHARTS:
        targets = panel["targets"]
        assert targets and all(t["expr"].strip() for t in targets), panel["title"]
        ref_ids = [t["refId"] for t in targets]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]


@pytest.mark.parametrize("name", ["policy", "vllm_instance"])
def test_filters_are_label_values_of_exported_series(name: str) -> None:
    variable = VARIABLES[name]
    assert variable["type"] == "query" and variable["includeAll"] and variable["multi"]
    assert variable["datasource"]["uid"] == "${datasource}"
    found = _LABEL_VALUES.match(variable["query"]["query"])
    assert found, variable["query"]
    series, label = found.groups()
    assert label == name and label in EXPORTED[series].labels


@pytest.mark.parametrize("target", QUERIES)
def test_query_reads_only_exported_series_and_labels(target: dict[str, Any]) -> None:
    expr = target["expr"]
    names = metric_names(expr)
    assert names, expr
    assert names <= EXPORTED.keys(), f"not exported by the router: {sorted(names - EXPORTED.keys())}"
    for series, matchers in _SELECTOR.findall(expr):
        assert set(_MATCHER.findall(matchers)) <= EXPORTED[series].labels, (series, matchers)
    available = set().union(*(EXPORTED[n].labels for n in names))
    grouped = _labels(_GROUPING.findall(expr))
    assert grouped <= available, f"grouped by labels no series has: {sorted(grouped - available)}"
    # A legend can only name labels that survive the aggregation.
    legend = set(_LEGEND_LABEL.findall(target.get("legendFormat", "")))
    assert legend <= (grouped - {"le"} if grouped else available), (legend, expr)
    assert set(_VARIABLE.findall(expr)) <= VARIABLES.keys() | GRAFANA_BUILTINS, expr


def test_every_exported_family_is_charted() -> None:
    used = {name for panel in CHARTS for t in panel["targets"] for name in metric_names(t["expr"])}
    charted = {EXPORTED[name].family for name in used if name in EXPORTED}
    # The standard process_ series are any process's: a dashboard selects the router's among them by job.
    families = {series.family for series in EXPORTED.values() if series.family.startswith("kvroute_")}
    assert families <= charted, f"exported but on no panel: {sorted(families - charted)}"
