"""The dashboard on the session router: open and self-contained, and, rendered by headless Chromium, showing
the running fleet, flow control's queue by objective and the same A/B numbers as /dashboard/state, which counts
what was sent. On a router with an admin token, the state needs it, and the page asks for it or takes it from
its address."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from kvroute.processes import FleetPorts, running_router
from router.config import parse_config
from router.dispatch.wait.flow_control import Demand
from router.errors import OpenAIError
from router.http.dashboard import flow_control_state
from router.runtime import Runtime
from tests.conftest import sample
from tests.router.http.test_admin import AUTH, TOKEN, call
from tests.support.http import get_json, post

CHROMIUM = Path("/usr/bin/chromium")
FLEET_NAMES = {"fleet-0", "fleet-1", "fleet-2"}
SENT = {"kvroute": 4, "round-robin": 3, "least-loaded": 2}
FLOW_FIELDS = {"name", "priority", "max_queued", "max_queue_s", "queued", "refused"}
INTERACTIVE: dict[str, object] = {"objectives": {"interactive": {"priority": 10}}}


def test_without_an_admin_token_the_dashboard_is_open_and_loads_nothing_from_elsewhere(
    router_url: str,
) -> None:
    with urllib.request.urlopen(router_url + "/dashboard", timeout=10) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in response.headers["content-security-policy"]
        page = response.read().decode()
    assert re.findall(r"(?i)https?://|//[a-z0-9.-]+\.[a-z]{2,}/", page) == []
    assert re.findall(r"(?i)<(?:link|img|iframe)\b|<script\b[^>]*\bsrc=|@import|url\(", page) == []
    state = get_json(router_url + "/dashboard/state")
    assert {i["name"] for i in state["instances"]} == FLEET_NAMES
    assert set(state["index"]) == {"entries", "max_entries", "bytes", "pool_entries"}
    assert set(state["ab"]) == {"split", "baseline", "policies", "comparisons"}
    flow = state["flow_control"]
    assert (flow["enabled"], flow["ordering"], flow["queued"]) == (True, "spt", 0)
    [default] = flow["objectives"]  # none configured: every request's is `default`
    assert set(default) == FLOW_FIELDS
    assert (default["name"], default["priority"], default["queued"]) == ("default", 0, 0)


def test_flow_control_state_lists_the_objectives_by_priority_with_their_queue_and_refusals() -> None:
    raw = {
        "models": [{"name": "tiny-llama"}],
        "instances": [{"name": "a", "url": "http://127.0.0.1:9"}],
        "flow_control": {
            "ordering": "fcfs",
            "objectives": {"batch": {"priority": -5, "max_queued": 0}, "interactive": {"priority": 10}},
        },
    }
    runtime = Runtime(parse_config(raw))
    gate = runtime.flow_gate
    empty = flow_control_state(gate, runtime.metrics)
    assert (empty["enabled"], empty["ordering"], empty["queued"]) == (True, "fcfs", 0)
    assert [(o["name"], o["priority"], o["queued"], o["refused"]) for o in empty["objectives"]] == [
        ("interactive", 10, 0, {}),
        ("default", 0, 0, {}),
        ("batch", -5, 0, {}),
    ]

    # One interactive request waits (no instance has room); a batch one behind it is refused: batch may
    # queue none.
    async def queue_then_refuse() -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        gate.control.admit(
            waiter, Demand("tiny-llama", "tenant-a", "interactive", 100.0, 100), lambda _work, _tokens: False
        )
        with pytest.raises(OpenAIError) as refused:
            await gate.wait(Demand("tiny-llama", "tenant-b", "batch", 100.0, 100))
        assert refused.value.code == "queue_full"

    asyncio.run(queue_then_refuse())
    state = flow_control_state(gate, runtime.metrics)
    assert state["queued"] == 1
    by_name = {o["name"]: o for o in state["objectives"]}
    assert all(set(o) == FLOW_FIELDS for o in state["objectives"])
    assert (by_name["interactive"]["queued"], by_name["interactive"]["refused"]) == (1, {})
    assert (by_name["batch"]["queued"], by_name["batch"]["refused"]) == (0, {"queue_full": 1})
    assert (by_name["batch"]["max_queued"], by_name["default"]["max_queue_s"]) == (0, 20.0)


def requests_by_policy(router_url: str) -> dict[str, dict[str, Any]]:
    policies: dict[str, dict[str, Any]] = get_json(router_url + "/dashboard/state")["ab"]["policies"]
    return policies


def send(router_url: str) -> dict[str, Counter[str]]:
    """Sends SENT's chat completions; the instances that answered, per policy."""
    served: dict[str, Counter[str]] = {policy: Counter() for policy in SENT}
    for policy, count in SENT.items():
        for turn in range(count):
            body = json.dumps(
                {
                    "model": "tiny-llama",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"dashboard check {policy} {turn}"}],
                }
            ).encode()
            status, headers, payload = post(
                router_url + "/v1/chat/completions",
                body,
                {"x-kvroute-policy": policy, "x-session-id": f"dash-{turn}"},
            )
            assert status == 200, payload
            headers = {k.lower(): v for k, v in headers.items()}
            assert headers["x-kvroute-policy"] == policy
            served[policy][headers["x-kvroute-instance"]] += 1
    return served


class DashboardDom(HTMLParser):
    """The dumped DOM's data-field elements as {(row, field): (text, data-value)}; row is the enclosing
    data-instance, data-objective, data-policy or data-comparison, or None."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[tuple[str | None, str], tuple[str, Any]] = {}
        self.chart_bars: list[tuple[str, str]] = []
        self._row: str | None = None
        self._open: tuple[str, str, Any] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        row = (
            a.get("data-instance")
            or a.get("data-objective")
            or a.get("data-policy")
            or a.get("data-comparison")
        )
        if tag in ("tr", "li") and row is not None:
            self._row = row
        if tag == "rect" and a.get("data-policy"):
            self.chart_bars.append((a["data-policy"] or "", a.get("data-quantile") or ""))
        if a.get("data-field"):
            value = a.get("data-value")
            self._open = (tag, a["data-field"] or "", None if value is None else json.loads(value))
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._open is not None and tag == self._open[0]:
            _, field, value = self._open
            self.fields[(self._row, field)] = ("".join(self._text).strip(), value)
            self._open = None
        if tag in ("tr", "li"):
            self._row = None


def render(url: str, profile: Path, timeout_s: float = 60.0) -> str:
    """The DOM after the page's scripts ran for 8 s of virtual time (four refreshes)."""
    args = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=8000",
        "--dump-dom",
        url,
    ]
    browser = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = browser.communicate(timeout=timeout_s)
    finally:
        # Chromium's helpers share its process group; none may outlive the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(browser.pid, signal.SIGKILL)
        browser.communicate()
    assert browser.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Chromium: make browser")
def test_dashboard_renders_the_fleet_and_the_ab_numbers(router_url: str, tmp_path: Path) -> None:
    before = requests_by_policy(router_url)
    served = send(router_url)

    def counted(policy: str, field: str) -> Any:
        return before.get(policy, {}).get(field, 0)

    # A request is counted once its answer is relayed, which may be just after the client has it.
    deadline = time.monotonic() + 10
    while True:
        state = get_json(router_url + "/dashboard/state")
        policies = state["ab"]["policies"]
        if all(policies[p]["requests"] == counted(p, "requests") + n for p, n in SENT.items()):
            break
        assert time.monotonic() < deadline, f"A/B counts never reached {SENT}: {policies}"
        time.sleep(0.05)
    for policy in SENT:
        per_instance = Counter(policies[policy]["requests_per_instance"])
        per_instance.subtract(counted(policy, "requests_per_instance") or {})
        assert +per_instance == served[policy]
        assert policies[policy]["errors"] == counted(policy, "errors")

    started = time.monotonic()
    dom = DashboardDom()
    dom.feed(render(router_url + "/dashboard", tmp_path / "profile"))
    rendered_s = time.monotonic() - started
    fields = dom.fields
    after = get_json(router_url + "/dashboard/state")
    assert after["ab"] == state["ab"], "no request ran, so the A/B report stands still"

    assert fields[(None, "status")][0] == "live", fields.get((None, "status"))
    assert {row for row, field in fields if field == "health"} == FLEET_NAMES
    for instance in after["instances"]:
        name = instance["name"]
        assert fields[(name, "health")][0] == ("up" if instance["healthy"] else "down")
        assert fields[(name, "in-flight")][1] == instance["in_flight"]
        assert fields[(name, "blocks-gpu")][1] == instance["blocks"]["gpu"]
        # Its agent programs (their tool calls' time-to-live may pass while the page renders)
        states = ("running", "tool-call", "paused")
        assert all(isinstance(fields[(name, f"programs-{f}")][1], int) for f in states)
        assert isinstance(fields[(name, "programs-working-set")][1], int)
    flow = after["flow_control"]
    assert fields[(None, "flow-enabled")] == ("on", True)
    assert fields[(None, "flow-ordering")][1] == flow["ordering"]
    assert fields[(None, "flow-queued")][1] == flow["queued"]
    assert fields[(None, "programs-waiting")] == ("0 / 0", {"back": 0, "new": 0})
    assert {row for row, field in fields if field == "max-queued"} == {o["name"] for o in flow["objectives"]}
    for objective in flow["objectives"]:
        name = objective["name"]
        assert fields[(name, "priority")][1] == objective["priority"]
        assert fields[(name, "queued")][1] == objective["queued"]
        assert fields[(name, "refused")][1] == objective["refused"]
    assert {row for row, field in fields if field == "requests"} == set(after["ab"]["policies"])
    for policy, stats in after["ab"]["policies"].items():
        assert fields[(policy, "requests")] == (str(stats["requests"]), stats["requests"])
        text, value = fields[(policy, "ttft-p50")]
        assert value == stats["ttft_ms"]["p50"]
        assert value is None or float(text) == value
        assert fields[(policy, "e2e-p50")][1] == stats["e2e_ms"]["p50"]
        assert fields[(policy, "requests-per-instance")][1] == stats["requests_per_instance"]
    assert Counter(p for p, _ in dom.chart_bars) == {p: 3 for p in after["ab"]["policies"]}
    for comparison in after["ab"]["comparisons"]:
        key = f"{comparison['baseline']}:{comparison['candidate']}"
        assert fields[(key, "verdict")][0] == comparison["verdict"]
    assert rendered_s < 30, f"Chromium took {rendered_s:.1f} s"


@pytest.fixture(scope="module")
def guarded_url(fleet: FleetPorts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router with an admin token, and an objective of flow control's configured."""
    config = fleet.router_config(admin={"token": TOKEN}, flow_control=INTERACTIVE)
    with running_router(config, tmp_path_factory.mktemp("guarded"), name="guarded") as url:
        yield url


def test_with_an_admin_token_the_state_needs_it(guarded_url: str) -> None:
    """The state holds the A/B report, which /admin/ab gives to the token alone."""
    with urllib.request.urlopen(guarded_url + "/dashboard", timeout=10) as response:
        assert response.status == 200  # the page holds no data
    before = sample(guarded_url, "kvroute_client_errors_total", code="missing_token") or 0.0
    status, body = call("GET", guarded_url + "/dashboard/state")
    assert status == 401 and body["error"]["code"] == "missing_token"
    assert "ab" not in body
    status, body = call(
        "GET", guarded_url + "/dashboard/state", headers={"authorization": "Bearer wrong-token-0000000000"}
    )
    assert status == 403 and body["error"]["code"] == "wrong_token"
    status, body = call("GET", guarded_url + "/dashboard/state", headers=AUTH)
    assert status == 200 and set(body["ab"]) == {"split", "baseline", "policies", "comparisons"}
    flow = body["flow_control"]
    assert (flow["enabled"], flow["queued"]) == (True, 0)
    objectives = [(o["name"], o["priority"], o["queued"]) for o in flow["objectives"]]
    assert objectives == [("interactive", 10, 0), ("default", 0, 0)]
    assert sample(guarded_url, "kvroute_client_errors_total", code="missing_token") == before + 1


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Chromium: make browser")
def test_the_page_asks_for_the_admin_token_or_takes_it_from_its_address(
    guarded_url: str, tmp_path: Path
) -> None:
    asked = render(guarded_url + "/dashboard", tmp_path / "asked")
    dom = DashboardDom()
    dom.feed(asked)
    assert "admin token is needed" in dom.fields[(None, "status")][0]
    assert re.search(r'<form id="token-form">', asked), "the token form is hidden"
    assert not any(field == "health" for _, field in dom.fields)

    given = render(guarded_url + f"/dashboard#token={TOKEN}", tmp_path / "given")
    dom = DashboardDom()
    dom.feed(given)
    assert dom.fields[(None, "status")][0] == "live", dom.fields.get((None, "status"))
    assert {row for row, field in dom.fields if field == "health"} == FLEET_NAMES
    assert dom.fields[("interactive", "priority")] == ("10", 10)
    assert dom.fields[("default", "queued")] == ("0", 0)
    assert re.search(r'<form id="token-form" hidden="">', given), "the token form is shown"
    assert TOKEN not in given
