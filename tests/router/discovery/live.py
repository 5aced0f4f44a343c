"""A router (`kvroute serve`) that knows its instances only from discovery, and what tests ask of it."""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvroute.processes import running_router
from tests.conftest import sample
from tests.router.discovery.kube_api import KubeAPI
from tests.support.waiting import eventually

ROUTED = "x-kvroute-instance"


@contextlib.contextmanager
def router(kube: KubeAPI, tmp_path: Path, discovery: dict[str, Any], **extra: Any) -> Iterator[str]:
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    config = {
        "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],
        "block_size": 32,
        "health": {"interval_s": 0.2},
        "discovery": {"kubeconfig": str(kubeconfig), "namespace": "default", **discovery},
        **extra,
    }
    with running_router(config, tmp_path) as url:
        yield url


def healthy(url: str) -> list[str]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            body = response.read()
    except urllib.error.HTTPError as unavailable:  # 503 while no instance is healthy
        body = unavailable.read()
    return sorted(json.loads(body)["healthy_instances"])


def chat(url: str, max_tokens: int = 2) -> str:
    """The instance a short chat went to (round robin: each instance in turn)."""
    body = json.dumps(
        {"model": "tiny-llama", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hello"}]}
    ).encode()
    headers = {"content-type": "application/json", "x-kvroute-policy": "round-robin"}
    request = urllib.request.Request(url + "/v1/chat/completions", body, headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return str(response.headers[ROUTED])


def routed(url: str, count: int = 6) -> set[str]:
    return {chat(url) for _ in range(count)}


def seconds_until(condition: Callable[[], object], timeout_s: float = 15.0) -> float:
    """Seconds until condition held (a 503 meanwhile, no instance healthy yet, counts as not); fails the
    test past timeout_s."""
    start = time.monotonic()
    eventually(lambda: _holds(condition), timeout_s)
    return time.monotonic() - start


def _holds(condition: Callable[[], object]) -> bool:
    try:
        return bool(condition())
    except urllib.error.HTTPError as error:
        if error.code != 503:
            raise
        return False


def stream(url: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": "tiny-llama",
            "max_tokens": 600,
            "stream": True,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "a long answer"}],
        }
    )
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"content-type": "application/json", "x-kvroute-policy": "round-robin"}
    connection.request("POST", "/v1/chat/completions", body, headers)
    return connection, connection.getresponse()


def removed_mid_stream(url: str, instance: str, remove: Callable[[], None]) -> None:
    """A stream in flight on instance when remove() takes it away finishes; 1 s later it gets no new request,
    the others still do."""
    for _ in range(4):
        connection, response = stream(url)
        if response.headers[ROUTED] == instance:
            break
        response.read()
        connection.close()
    assert response.headers[ROUTED] == instance
    others = routed(url) - {instance}
    remove()
    time.sleep(1.0)
    assert routed(url) == others
    answer = response.read().decode()
    connection.close()
    assert response.status == 200 and answer.rstrip().endswith("data: [DONE]")
    assert answer.count("data: ") > 500, "the stream was cut short"


def outage_survived(
    url: str, kube: KubeAPI, source: str, add_second: Callable[[], None], remove_first: Callable[[], None]
) -> None:
    """With vllm-0 serving: a 410 Gone and then the API server gone keep the last set serving and are counted;
    back on its port, what changed meanwhile (add_second: vllm-1) and after (remove_first) is followed."""

    def restarts() -> float:
        return sample(url, "kvroute_discovery_watch_restarts_total", source=source) or 0

    kube.expire_watches(1)  # the next watch is answered 410 Gone: listed again, counted
    kube.stop_listening()  # the server goes away: every watch breaks
    seconds_until(lambda: restarts() >= 1)
    time.sleep(1.0)
    assert routed(url) == {"vllm-0"}, "the last known set stops serving without the API server"
    kube.start()  # back, on the same port; an engine came while it was away
    add_second()
    seconds_until(lambda: "vllm-1" in routed(url, 2), timeout_s=20)
    assert restarts() >= 2  # the 410 and the connection refused while it was away
    remove_first()
    seconds_until(lambda: routed(url) == {"vllm-1"}, timeout_s=5)
