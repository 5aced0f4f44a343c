"""The tiny model builds the same bytes every time, and its tokenizer renders chats as vLLM expects."""

from __future__ import annotations

import json
from pathlib import Path

from router.prompt.tokenization import PromptTokenizer
from tinymodel.builder import CHAT_TEMPLATE, LLAMA_CONFIG, VOCAB_SIZE, ensure_model, model_dir


def test_builds_are_identical_and_reused(tmp_path: Path) -> None:
    first, second = ensure_model(tmp_path / "a"), ensure_model(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert ensure_model(tmp_path / "a") == first  # already there: not rebuilt
    assert json.loads((first / "config.json").read_text()) == LLAMA_CONFIG


def test_a_model_built_by_an_older_kvroute_gets_the_current_chat_template(tmp_path: Path) -> None:
    directory = model_dir(tmp_path)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old", "bos_token": "<s>"}))
    assert ensure_model(tmp_path) == directory
    assert json.loads((directory / "tokenizer_config.json").read_text()) == {
        "chat_template": CHAT_TEMPLATE,
        "bos_token": "<s>",
    }
    assert sorted(path.name for path in directory.iterdir()) == ["config.json", "tokenizer_config.json"]


def test_chat_template_adds_bos_once_and_the_generation_prompt(tokenizer: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.render_chat(messages)
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    ids = tokenizer.chat_ids(messages)
    assert ids[0] == 0 and 0 not in ids[1:]
    assert tokenizer.vocab_size == VOCAB_SIZE


def test_text_content_parts_join_with_newlines(tokenizer: PromptTokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.chat_ids(parts) == tokenizer.chat_ids([{"role": "user", "content": "a\nb"}])
