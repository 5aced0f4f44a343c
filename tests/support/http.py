"""Plain HTTP calls a test makes of a router or an engine, with no client library between."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of a JSON POST, an error answer's too."""
    request = urllib.request.Request(
        url, data=body, headers={"content-type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)
