"""A router configuration from the vLLM instances themselves: `kvroute serve --worker-urls URL...`.

Each instance says what it serves (`/v1/models`: the served names, the model's path as `root`) and its KV
block size (`/metrics`: vllm:cache_config_info). The tokenizer is the model's own when it is on this machine
(its directory, or its Hugging Face id in the local cache: as the router finds a model's by default,
router/upstreams/model_tokenizers.py), else the instances' `/tokenize` (exact, one round trip a request).
The configuration made is printed, to be kept as a file and edited later.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from router.config import REMOTE_TOKENIZER
from router.prompt.tokenization import local_tokenizer_dir

_NAME_CHARACTERS = re.compile(r"[^A-Za-z0-9_.-]")


class WorkersUnreadable(Exception):
    """An instance could not be asked what it serves; the message says which and why."""


def config_from_workers(
    urls: Sequence[str],
    events: Sequence[str] = (),
    replays: Sequence[str] = (),
    wait_s: float = 30.0,
) -> dict[str, Any]:
    """The configuration of a fleet of these instances (events and replays: their KV event and replay
    endpoints, in the same order, or none), waiting up to wait_s for each to answer."""
    if any(given and len(given) != len(urls) for given in (events, replays)):
        raise WorkersUnreadable(
            "give one --kv-events (and --kv-replay) endpoint per --worker-urls URL, in order"
        )
    served = [_served(url.rstrip("/"), wait_s) for url in urls]
    models: dict[str, str] = {}
    for cards, _ in served:
        for card in cards:
            models.setdefault(card["id"], card.get("root") or card["id"])
    sizes = {size for _, size in served if size is not None}
    if len(sizes) > 1:
        raise WorkersUnreadable(f"the instances report different KV block sizes: {sorted(sizes)}")
    instances = []
    for number, (url, (cards, _)) in enumerate(zip(urls, served, strict=True)):
        instance: dict[str, Any] = {"name": _name(url, number), "url": url.rstrip("/")}
        instance["models"] = [card["id"] for card in cards]
        if events:
            instance["events"] = events[number]
        if replays:
            instance["replay"] = replays[number]
        instances.append(instance)
    return {
        "models": [{"name": name, "tokenizer": _tokenizer(root)} for name, root in models.items()],
        "block_size": sizes.pop() if sizes else 16,
        "instances": instances,
    }


def _tokenizer(root: str) -> str:
    """The model's own if it is here (a directory, or a Hugging Face id); else the instances' /tokenize."""
    return REMOTE_TOKENIZER if local_tokenizer_dir(root) is None else root


def _name(url: str, number: int) -> str:
    """host-port, as a configuration names an instance."""
    parts = urlsplit(url)
    name = _NAME_CHARACTERS.sub("-", f"{parts.hostname or 'instance'}-{parts.port or number}")
    return name.strip("-.")[:63] or f"instance-{number}"


def _served(url: str, wait_s: float) -> tuple[list[dict[str, Any]], int | None]:
    """The model cards of /v1/models and the block size of /metrics, once the instance answers."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            cards = json.loads(_get(url + "/v1/models"))["data"]
            return [card for card in cards if not card.get("parent")], _block_size(_get(url + "/metrics"))
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
            if time.monotonic() >= deadline:
                raise WorkersUnreadable(f"{url}: no answer to /v1/models and /metrics ({exc})") from None
            time.sleep(0.5)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return str(answer.read().decode())


def _block_size(metrics: str) -> int | None:
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info" and sample.labels.get("block_size", "").isdigit():
                return int(sample.labels["block_size"])
    return None
