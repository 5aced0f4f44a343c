"""A router whose token ids are not its instances' says so: an error log naming the model and the instance, a
metric, /health and the dashboard. The engine here is a fake whose /v1/models reports the model's directory
(its root, as vLLM does) and whose /tokenize agrees with that directory's tokenizer, or not."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvroute.processes import running_router_process
from router.metrics import RouterMetrics
from router.prompt.tokenization import PromptTokenizer
from router.prompt.tokenizer_check import TokenizerWatch, check_at_start
from tests.conftest import sample
from tests.support.fake_upstreams import serving_app
from tests.support.http import get_json, post
from tests.support.waiting import eventually

MODEL = "served-llama"
BLOCK_SIZE = 16
PROMPT = "Summarise the failing tests in tests/test_models.py, one line each. " * 6


@contextmanager
def engine(
    root: Path, shift: int, chat_shift: int | None = None, ready: threading.Event | None = None
) -> Iterator[int]:
    """A fake vLLM serving MODEL from root, its /tokenize ids shifted by shift (0: the same as root's), a
    chat's by chat_shift when given; yields its port. Until ready is set it answers 503, as an engine still
    loading its weights is not yet up."""
    tokenizer = PromptTokenizer(root)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if ready is None or ready.is_set() else 503)

    async def models(request: web.Request) -> web.Response:
        if ready is not None and not ready.is_set():
            return web.Response(status=503)
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "root": str(root), "parent": None}]}
        )

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            ids = tokenizer.chat_ids(body["messages"], body.get("add_generation_prompt", True))
        else:
            ids = tokenizer.text_ids(body["prompt"], body.get("add_special_tokens", True))
        by = shift if chat_shift is None or "messages" not in body else chat_shift
        shifted = [token + by for token in ids]
        return web.json_response({"count": len(shifted), "tokens": shifted, "max_model_len": 2048})

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    with serving_app(app) as port:
        yield port


@pytest.fixture
def model_root(model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model in a directory of another name: nothing here goes by the builtin's name."""
    root = tmp_path / "weights" / "served-llama-dir"
    shutil.copytree(model_dir, root)
    return root


def _config(port: int) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL}],  # no tokenizer: the one vLLM loads, found by the instances' root
        "block_size": BLOCK_SIZE,
        "instances": [{"name": "engine-a", "url": f"http://127.0.0.1:{port}"}],
    }


@contextmanager
def router(
    model_root: Path, tmp_path: Path, shift: int, chat_shift: int | None = None
) -> Iterator[tuple[str, Path]]:
    """A router in front of one fake engine (shift: its ids'); yields its URL and its log."""
    with (
        engine(model_root, shift, chat_shift) as port,
        running_router_process(_config(port), tmp_path) as (url, child),
    ):
        yield url, child.log_path


def test_an_instance_whose_ids_differ_raises_the_alarm(model_root: Path, tmp_path: Path) -> None:
    with router(model_root, tmp_path, shift=1) as (url, log_path):
        labels = {"model": MODEL, "vllm_instance": "engine-a"}
        assert eventually(lambda: sample(url, "kvroute_tokenizer_mismatch", **labels)) == 1
        assert sample(
            url, "kvroute_tokenization_audits_total", model=MODEL, kind="start_text", result="mismatch"
        )
        alarm = f"tokenizer mismatch: model {MODEL} on instance engine-a (start_text)"
        state = get_json(url + "/dashboard/state")
        assert alarm in state["alarms"]
        [model] = state["tokenizers"]
        assert model["model"] == MODEL and model["tokenizer"].startswith(str(model_root))
        assert [(m["instance"], m["check"]) for m in model["mismatches"]] == [("engine-a", "start_text")]
        assert model["mismatches"][0]["first_different"] == 0
        health = get_json(url + "/health")
        assert (health["status"], health["warnings"]) == ("degraded", [alarm])
        errors = [line for line in log_path.read_text().splitlines() if "ERROR" in line]
        assert any(f"model {MODEL}, instance engine-a" in line for line in errors), errors


def test_an_instance_that_agrees_is_checked_quietly_and_its_root_tokenizes(
    model_root: Path, tmp_path: Path
) -> None:
    with router(model_root, tmp_path, shift=0) as (url, log_path):
        labels = {"model": MODEL, "vllm_instance": "engine-a"}
        eventually(
            lambda: sample(
                url, "kvroute_tokenization_audits_total", model=MODEL, kind="start_chat", result="match"
            )
        )
        assert sample(url, "kvroute_tokenizer_mismatch", **labels) == 0
        state = get_json(url + "/dashboard/state")
        assert state["alarms"] == []
        assert state["tokenizers"][0]["matched"] == ["engine-a"]
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).encode()
        status, headers, _ = post(url + "/v1/completions", body)
        tokens = len(PromptTokenizer(model_root).text_ids(PROMPT))
        assert (status, int(headers["x-kvroute-prompt-blocks"])) == (200, tokens // BLOCK_SIZE)
        assert "ERROR" not in log_path.read_text()


def test_a_chat_rendered_otherwise_where_the_text_matches_is_no_alarm(
    model_root: Path, tmp_path: Path
) -> None:
    """The engine's template, not its tokenizer: such chats go to the engine, with a warning."""
    with router(model_root, tmp_path, shift=0, chat_shift=1) as (url, log_path):
        eventually(
            lambda: sample(
                url, "kvroute_tokenization_audits_total", model=MODEL, kind="start_chat", result="mismatch"
            )
        )
        assert sample(url, "kvroute_tokenizer_mismatch", model=MODEL, vllm_instance="engine-a") == 0
        state = get_json(url + "/dashboard/state")
        assert state["alarms"] == [] and get_json(url + "/health")["status"] == "ok"
        [model] = state["tokenizers"]
        assert [(m["instance"], m["check"]) for m in model["renderings"]] == [("engine-a", "start_chat")]
        assert "a chat renders to other token ids there (start_chat:" in log_path.read_text()


def test_a_model_whose_engine_comes_up_later_is_tokenized_with_its_root_from_then_on(
    model_root: Path, tmp_path: Path
) -> None:
    ready = threading.Event()
    with (
        engine(model_root, shift=0, ready=ready) as port,
        running_router_process(_config(port), tmp_path) as (url, child),
    ):
        [model] = get_json(url + "/dashboard/state")["tokenizers"]
        assert model["tokenizer"].startswith("remote")  # no engine answered at start
        ready.set()
        found = eventually(
            lambda: (
                (t := get_json(url + "/dashboard/state")["tokenizers"][0]["tokenizer"]).startswith(
                    str(model_root)
                )
                and t
            )
        )
        assert "the model's root on its instances" in found
        eventually(lambda: get_json(url + "/dashboard/state")["tokenizers"][0]["matched"] == ["engine-a"])
        assert "is tokenized here from now on" in child.log_path.read_text()


class _CountingTokenizer:
    """A model's tokenizer here, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def completion_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return [1, 2, 3]

    def chat_ids(self, messages: Any) -> list[int]:
        self.calls += 1
        return [4, 5]


class _Engine:
    """An instance's /tokenize, as RemoteTokenizer answers it: the same ids as here, but for one instance."""

    def __init__(self, instance: str, differs: bool = False) -> None:
        self.instance, self._differs = instance, differs

    async def completion_ids(self, prompt: Any) -> list[int]:
        return [9] if self._differs else [1, 2, 3]

    async def chat_ids(self, messages: Any) -> list[int]:
        return [4, 5]


def test_the_ids_here_are_computed_once_a_model_for_every_instance_compared() -> None:
    watch = TokenizerWatch(RouterMetrics())
    tokenizer = _CountingTokenizer()
    engines = [_Engine(f"i{n}", differs=n == 7) for n in range(50)]
    asyncio.run(check_at_start(watch, {"m": tokenizer}, {"m": engines}))  # type: ignore[dict-item]
    assert tokenizer.calls == 2  # the text and the chat, not twice for each of 50 instances
    assert [alarm for alarm in watch.alarms() if "i7" in alarm] and len(watch.alarms()) == 1
