"""A model's tokenizer by default: the one vLLM loads for it, found here by its name or its instances' root;
else the instances' /tokenize, said loudly. Never the test model's unless the configuration names it."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from router.apis.openai_body import CompletionRequest
from router.config import parse_config
from router.prompt.token_cache import CachedChatTokenizer
from router.prompt.tokenization import PromptTokenizer, local_tokenizer_dir
from router.runtime import Runtime, SharedIndex
from router.upstreams.instances import Instance, InstanceSetup
from router.upstreams.model_tokenizers import choose_tokenizers
from router.upstreams.peer_sync import PeerEndpoints

PROMPT = "Run the tests in tests/test_models.py and tell me which fail. " * 4
DOWN = {"name": "down", "url": "http://127.0.0.1:9"}  # nothing listens: no root reported


@pytest.fixture
def local_model(model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model under a name of its own: found by its path, not by the builtin's name."""
    copy = tmp_path / "models" / "my-llama"
    shutil.copytree(model_dir, copy)
    return copy


def started(raw: dict[str, Any], prompt_model: str) -> tuple[Runtime, int]:
    """The runtime's state once started, and the prompt tokens it counts for PROMPT sent to prompt_model."""

    async def main() -> tuple[Runtime, int]:
        async with Runtime(parse_config(raw)) as runtime:
            body = CompletionRequest(model=prompt_model, prompt=PROMPT)
            prepared = await runtime.decider.prepare(body, None)
        return runtime, prepared.request.prompt_tokens

    return asyncio.run(main())


def test_a_model_named_by_a_local_directory_routes_with_that_directorys_tokenizer(local_model: Path) -> None:
    name = str(local_model)
    raw = {"models": [{"name": name}, {"name": "lora", "lora_of": name}], "instances": [DOWN]}
    runtime, tokens = started(raw, "lora")
    assert tokens == len(PromptTokenizer(local_model).text_ids(PROMPT)) > 0
    own, adapter = runtime.tokenizers[name], runtime.tokenizers["lora"]
    assert own is adapter  # the adapter tokenizes with its base's, one cache for both
    assert isinstance(own, CachedChatTokenizer) and own.tokenizer.path == local_model
    assert runtime.tokenizer_watch.origins[name] == f"{name} (the model's name)"


@pytest.mark.parametrize("name", ["no-such-org/no-such-model", "tiny-llama"])
def test_a_model_whose_tokenizer_is_nowhere_here_falls_back_loudly_to_the_instances(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """tiny-llama too: a name is not the builtin test tokenizer, which only a configuration names."""
    caplog.set_level(logging.WARNING, "router.upstreams.model_tokenizers")
    runtime, tokens = started({"models": [{"name": name}], "instances": [DOWN]}, name)
    assert (runtime.tokenizers, tokens) == ({}, 0)  # no instance up to ask
    [warning] = [r for r in caplog.records if r.name == "router.upstreams.model_tokenizers"]
    assert warning.levelname == "WARNING"
    assert f"model {name}: no tokenizer configured" in warning.getMessage()
    assert "tokenized by the instances' /tokenize" in warning.getMessage()
    assert runtime.tokenizer_watch.origins[name].startswith("remote: the instances' /tokenize (none found")


def test_the_test_tokenizer_is_used_where_the_configuration_names_it(model_dir: Path) -> None:
    raw = {"models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}], "instances": [DOWN]}
    runtime, tokens = started(raw, "tiny-llama")
    assert tokens == len(PromptTokenizer(model_dir).text_ids(PROMPT))
    assert runtime.tokenizer_watch.origins == {"tiny-llama": "builtin:tiny-llama"}


def test_the_root_its_instances_report_names_a_models_tokenizer(local_model: Path) -> None:
    """vLLM's /v1/models gives each served model's --model as root: a directory here, or a Hub id."""
    config = parse_config(
        {"models": [{"name": "served"}, {"name": "sql", "lora_of": "served"}], "instances": [DOWN]}
    )
    elsewhere = Instance(
        "a", "http://a", frozenset({"served"}), setup=InstanceSetup(roots={"served": "/not/on/this/machine"})
    )
    here = Instance(
        "b", "http://b", frozenset({"served"}), setup=InstanceSetup(roots={"served": str(local_model)})
    )
    choices = choose_tokenizers(config.models, [elsewhere, here])
    assert choices["served"].path == choices["sql"].path == local_model
    assert choices["served"].origin == f"{local_model} (the model's root on its instances)"
    assert choose_tokenizers(config.models, [elsewhere])["served"].path is None


def test_a_hugging_face_id_is_found_in_the_local_cache_without_downloading(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--acme--llama-9b"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(model_dir / file, snapshot / file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert local_tokenizer_dir("acme/llama-9b") == snapshot
    assert local_tokenizer_dir("acme/llama-70b") is None
    config = parse_config(
        {
            "models": [{"name": "acme/llama-9b"}, {"name": "x", "tokenizer": "acme/llama-9b"}],
            "instances": [DOWN],
        }
    )
    config.require_tokenizers("router.yaml")
    assert config.tokenizer_warnings() == []
    choices = choose_tokenizers(config.models, [])
    assert choices["acme/llama-9b"].path == choices["x"].path == snapshot
    assert (
        choices["acme/llama-9b"].origin
        == f"acme/llama-9b (the model's name, in the Hugging Face cache at {snapshot})"
    )
    assert PromptTokenizer(snapshot).text_ids(PROMPT) == PromptTokenizer(model_dir).text_ids(PROMPT)


def test_an_index_host_loads_no_tokenizer(local_model: Path, tmp_path: Path) -> None:
    """`serve --workers N`'s index host routes nothing: the workers tokenize, it only holds the index."""
    raw = {"models": [{"name": str(local_model)}], "instances": [DOWN]}

    async def main() -> tuple[dict[str, Any], dict[str, str]]:
        shared = SharedIndex(str(tmp_path / "index"), hosts=True)
        async with Runtime(parse_config(raw), PeerEndpoints(), shared) as host:
            return dict(host.tokenizers), dict(host.tokenizer_watch.origins)

    assert asyncio.run(main()) == ({}, {})
    lone, _ = started(raw, str(local_model))
    assert set(lone.tokenizers) == {str(local_model)}  # what it would have loaded
