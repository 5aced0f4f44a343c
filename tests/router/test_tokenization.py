"""The batch path to the Rust backend gives the ids transformers' own call gives, text by text."""

from __future__ import annotations

import pytest

from router.tokenization import PromptTokenizer

TEXTS = [
    "",
    "hello world",
    " x  y\nz é 🙂 日本語 e\u0301 👨\u200d👩\u200d👧",
    "<s><|user|>\nfix it</s>\n<|assistant|>\n",
    "</s></s><</s>> <pad>",
    "def f(x):\n    return x\n" * 300,
    " ".join(["router cache prefix token block engine"] * 2000),
]


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_texts_ids_equal_text_ids(tokenizer: PromptTokenizer, add_special_tokens: bool) -> None:
    expected = [tokenizer.text_ids(text, add_special_tokens) for text in TEXTS]
    assert tokenizer.texts_ids(TEXTS, add_special_tokens) == expected
    assert [tokenizer.texts_ids([text], add_special_tokens)[0] for text in TEXTS] == expected
    assert tokenizer.texts_ids([], add_special_tokens) == []
