"""Chat templates of both content formats, rendered by the router and by vLLM's own renderer.

The stack's model has one template; these tests need others. vLLM's GPU-less render server (``vllm launch
render``, the same chat handling as ``vllm serve`` without an engine) takes a template per request with
``--trust-request-chat-template``, and the router gets each template through a copy of the tokenizer files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvroute.processes import free_port_block, spawn, wait_healthy
from kvroute.stack.config import load_stack_config
from router.prompt.template_reading import content_format
from router.prompt.tokenization import PromptTokenizer
from tests.stack.client import post
from tests.stack.conftest import CONFIG, REPO
from tests.support.chat_templates import TEMPLATES
from tinymodel import builder as tinymodel

pytestmark = pytest.mark.stack

RENDERED = [name for name in TEMPLATES if name != "a tuple loop over messages"]  # that one fails to render
CHATS: dict[str, list[dict[str, Any]]] = {
    "plain strings": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Run the tests."},
    ],
    "text parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": ""}, "two"],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "done", "cache_control": {"type": "x"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}, "exit 0"]},
        {"role": "assistant", "content": None},
    ],
    "developer messages": [
        {"role": "system", "content": "Rules."},
        {"role": "developer", "content": [{"type": "text", "text": "More rules."}, "And more."]},
        {"role": "user", "content": "Go."},
    ],
}


def stack_python() -> Path:
    return load_stack_config(CONFIG).python_path(REPO)


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port_block(1)
    argv = [
        str(stack_python()),
        "-m",
        "vllm.entrypoints.launchers.render.entry",
        "--model",
        str(tinymodel.ensure_model()),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--trust-request-chat-template",
    ]
    child = spawn("vllm-render", argv, tmp_path_factory.mktemp("render"))
    try:
        wait_healthy(child, [f"http://127.0.0.1:{port}/health"], timeout_s=180)
        yield f"http://127.0.0.1:{port}"
    finally:
        child.stop()


def tokenizer_with(template: str, directory: Path) -> PromptTokenizer:
    """The tiny model's tokenizer with another chat template."""
    model = tinymodel.ensure_model()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(model / name, directory / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return PromptTokenizer(directory)


def test_content_format_is_vllms() -> None:
    """vLLM's own detection, run in the stack's interpreter, on every template of the corpus."""
    script = (
        "import json, sys\n"
        "from vllm.renderers.hf import _detect_content_format\n"
        "templates = json.load(sys.stdin)\n"
        "print(json.dumps({n: _detect_content_format(t, default='string') for n, t in templates.items()}))\n"
    )
    templates = {name: template for name, (template, _) in TEMPLATES.items()}
    done = subprocess.run(
        [str(stack_python()), "-c", script],
        input=json.dumps(templates),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    vllm_formats = json.loads(done.stdout.strip().splitlines()[-1])
    assert vllm_formats == {name: expected for name, (_, expected) in TEMPLATES.items()}
    assert {name: content_format(template) for name, template in templates.items()} == vllm_formats


@pytest.mark.parametrize("template_name", RENDERED)
@pytest.mark.parametrize("chat_name", CHATS)
def test_chat_ids_equal_vllms_renderer(
    renderer: str, tmp_path: Path, template_name: str, chat_name: str
) -> None:
    template, _ = TEMPLATES[template_name]
    messages = CHATS[chat_name]
    body = {"model": "tiny", "messages": messages, "chat_template": template}
    vllm_ids = post(renderer + "/tokenize", body).body["tokens"]
    assert tokenizer_with(template, tmp_path).chat_ids(messages) == vllm_ids
