"""The batch path to the Rust backend gives the ids transformers' own call gives, text by text."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from router.prompt.template_inputs import TemplateInputs
from router.prompt.tokenization import PromptTokenizer

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


def test_truncation_and_padding_in_tokenizer_json_are_not_applied(model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    path = copy / "tokenizer.json"
    config = json.loads(path.read_text())
    config["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    path.write_text(json.dumps(config))
    tokenizer = PromptTokenizer(copy)
    long_text = TEXTS[-1]
    assert len(tokenizer.texts_ids([long_text])[0]) > 8
    assert tokenizer.texts_ids([long_text]) == [tokenizer.text_ids(long_text)]


def test_a_dict_of_named_templates_renders_with_the_one_transformers_picks(
    model_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    path = copy / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = [
        {
            "name": "default",
            "template": "D{% for m in messages %}{% for part in m.content %}{{ part.text }}"
            "{% endfor %}{% endfor %}{{ enable_thinking }}",
        },
        {"name": "tool_use", "template": "T{{ tools | length }}{{ enable_thinking }}"},
    ]
    path.write_text(json.dumps(config))
    tokenizer = PromptTokenizer(copy)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    tool = {"type": "function", "function": {"name": "f"}}

    # The default template loops over parts (not "a\nb") and reads the kwarg; tools pick tool_use.
    assert (
        tokenizer.render_chat(parts, inputs=TemplateInputs(template_kwargs={"enable_thinking": False}))
        == "DabFalse"
    )
    assert (
        tokenizer.render_chat(
            parts, inputs=TemplateInputs(tools=[tool], template_kwargs={"enable_thinking": True})
        )
        == "T1True"
    )
    assert tokenizer.render_chat(parts, inputs=TemplateInputs(tools=[])) == "T0"


def test_named_templates_without_a_default_have_none(model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    path = copy / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    path.write_text(json.dumps(config))
    tokenizer = PromptTokenizer(copy)
    assert tokenizer.template_text(None) is None
    assert tokenizer.template_text([]) == "T"


_THREADS_AROUND_A_BATCH = """
import os, sys
from pathlib import Path
from router.prompt.tokenization import PARALLELISM_ENV, PromptTokenizer, environment_as_given
tokenizer = PromptTokenizer(Path(sys.argv[1]))
before = len(os.listdir("/proc/self/task"))
ids = tokenizer.texts_ids(["def f(x):\\n    return x\\n" * 200] * 8, add_special_tokens=False)
passed_on = int(PARALLELISM_ENV in environment_as_given(os.environ))
print(before, len(os.listdir("/proc/self/task")), len(ids), passed_on)
"""


@pytest.mark.parametrize("setting", [None, "true"])
def test_a_batch_is_encoded_on_the_calling_thread_unless_the_operator_says_otherwise(
    model_dir: Path, setting: str | None
) -> None:
    """The tokenizers library's thread pool (started on a batch's first parallel encode) costs the router a
    handover and spinning threads per request; an operator's TOKENIZERS_PARALLELISM is kept, and only that
    is passed on to the engines the stack starts."""
    env = {key: value for key, value in os.environ.items() if key != "TOKENIZERS_PARALLELISM"}
    if setting is not None:
        env["TOKENIZERS_PARALLELISM"] = setting
    run = subprocess.run(
        [sys.executable, "-c", _THREADS_AROUND_A_BATCH, str(model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    before, after, encoded, passed_on = map(int, run.stdout.split())
    assert encoded == 8
    if setting is None:
        assert after == before and not passed_on
    else:  # the pool's threads: the check above can fail
        assert after > before and passed_on
