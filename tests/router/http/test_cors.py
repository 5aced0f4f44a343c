"""Browsers: CORS headers for the configured origins only, preflights answered before any API key check."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from kvroute.processes import FleetPorts, running_router
from tests.router.dispatch.intake.test_admission import KEYS_ENV
from tests.support.http import post

ORIGIN = "https://ui.example"


def _preflight(url: str) -> dict[str, str]:
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        method="OPTIONS",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        return {k.lower(): v for k, v in response.headers.items()}


def test_a_browser_on_an_allowed_origin_may_call_the_api(
    fleet: FleetPorts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEYS_ENV, "browser-key")
    config = fleet.router_config(auth={"api_keys_env": KEYS_ENV}, cors={"allow_origins": [ORIGIN]})
    with running_router(config, tmp_path, name="cors") as url:
        allowed = _preflight(url)
        assert allowed["access-control-allow-origin"] == ORIGIN
        assert "authorization" in allowed["access-control-allow-headers"].lower()
        body = b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
        status, headers, _ = post(
            url + "/v1/chat/completions", body, {"Origin": ORIGIN, "authorization": "Bearer browser-key"}
        )
        assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
        assert "x-kvroute-instance" in headers["access-control-expose-headers"].lower()
        status, headers, _ = post(url + "/v1/chat/completions", body, {"Origin": ORIGIN})
        assert status == 401 and headers["access-control-allow-origin"] == ORIGIN  # the page can read why
        status, headers, _ = post(
            url + "/v1/chat/completions",
            body,
            {"Origin": "https://other.example", "authorization": "Bearer browser-key"},
        )
        assert status == 200 and "access-control-allow-origin" not in {k.lower() for k in headers}


def test_no_cors_headers_unless_configured(fleet: FleetPorts, tmp_path: Path) -> None:
    with running_router(fleet.router_config(), tmp_path, name="plain") as url:
        body = b'{"model": "tiny-llama", "max_tokens": 2, "prompt": "hi"}'
        status, headers, _ = post(url + "/v1/completions", body, {"Origin": ORIGIN})
        assert status == 200 and "access-control-allow-origin" not in {k.lower() for k in headers}
