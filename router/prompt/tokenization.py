"""Prompt tokenization exactly as vLLM's OpenAI server does it, shared by the router and the simulated fleet.

Chat: the model's chat template renders the conversation and tools as vLLM builds them (see
router/prompt/chat_conversation.py), and the rendered text is encoded without adding special tokens (the
template has them). Completions: text is encoded with special tokens added; token ids pass through unchanged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from router.prompt.chat_conversation import (
    InvalidPrompt,
    engine_conversation,
    engine_template_kwargs,
    engine_tools,
)
from router.prompt.multimodal.block_keys import Placed
from router.prompt.multimodal.chat_images import ChatImages
from router.prompt.multimodal.layouts import Idefics3Layout, image_layout
from router.prompt.multimodal.prompt import chat_with_images
from router.prompt.template_inputs import NO_INPUTS, TemplateInputs

# A batch of texts is encoded on this thread, not handed to the tokenizers library's thread pool: the router
# encodes one request's few new pieces at a time, and the pool's handover and its threads' spinning cost a
# new 2 KiB chat 46 context switches and a tenth of a millisecond of system CPU (docs/notes/
# overhead-investigations.md). Set here, on import, before any thread encodes; an operator's setting stays,
# and processes started from here that are not kvroute's (the stack's engines) get the environment as it was.
PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
_PARALLELISM_SET_HERE = PARALLELISM_ENV not in os.environ
os.environ.setdefault(PARALLELISM_ENV, "false")


def environment_as_given(env: Mapping[str, str]) -> dict[str, str]:
    """env without what this module set in the process's environment."""
    return {k: v for k, v in env.items() if not (_PARALLELISM_SET_HERE and k == PARALLELISM_ENV)}


BUILTIN_PREFIX = "builtin:"
BUILTIN_TOKENIZERS = ("tiny-llama",)  # tinymodel/builder.py builds it (its MODEL_NAME)


# A directory is a tokenizer's with tokenizer.json, or with tokenizer_config.json beside a vocabulary (a
# config alone loads as an empty tokenizer, which would hash every prompt to nothing).
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
VOCABULARY_FILES = ("vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")


def local_tokenizer_dir(name: str) -> Path | None:
    """Where the tokenizer vLLM loads for ``--tokenizer name`` is on this machine without downloading: name
    as a directory holding a tokenizer, or as a Hugging Face id whose snapshot the local cache holds."""
    try:
        path = Path(name).expanduser()
        if _is_tokenizer_dir(path):
            return path
        if name.startswith(("/", ".", "~")):
            return None
        return _cached_tokenizer_dir(name)
    except OSError:  # a name no file system takes (too long), a cache that cannot be read
        return None


def _is_tokenizer_dir(path: Path) -> bool:
    if (path / TOKENIZER_FILE).is_file():
        return True
    return (path / TOKENIZER_CONFIG).is_file() and any((path / file).is_file() for file in VOCABULARY_FILES)


def _cached_tokenizer_dir(name: str) -> Path | None:
    from huggingface_hub import constants, try_to_load_from_cache

    for file in (TOKENIZER_FILE, TOKENIZER_CONFIG):
        try:
            cached = try_to_load_from_cache(name, file, cache_dir=constants.HF_HUB_CACHE)
        except ValueError:  # not a repository id
            return None
        if isinstance(cached, str) and _is_tokenizer_dir(Path(cached).parent):
            return Path(cached).parent
    return None


def check_tokenizer_spec(spec: str) -> None:
    """ValueError for what resolve_tokenizer_path cannot give: an unknown builtin, a directory not there, a
    Hugging Face id not in the local cache. Checked without building the builtin model."""
    if spec.startswith(BUILTIN_PREFIX):
        if spec.removeprefix(BUILTIN_PREFIX) not in BUILTIN_TOKENIZERS:
            known = ", ".join(BUILTIN_TOKENIZERS)
            raise ValueError(f"unknown builtin tokenizer {spec!r}; known: {known}")
    elif spec.startswith(("/", ".", "~")):
        if not Path(spec).expanduser().is_dir():
            raise ValueError(f"{spec!r} is not a directory")
    elif local_tokenizer_dir(spec) is None:
        raise ValueError(
            f"{spec!r} is neither a tokenizer directory here nor a model in the local Hugging Face cache "
            "(the router does not download)"
        )


def resolve_tokenizer_path(spec: str) -> Path:
    """A directory path, a Hugging Face id's snapshot in the local cache, or ``builtin:tiny-llama`` for the
    locally built tiny model."""
    if spec.startswith(BUILTIN_PREFIX):
        check_tokenizer_spec(spec)
        from tinymodel import builder as tinymodel

        return tinymodel.ensure_model()
    return local_tokenizer_dir(spec) or Path(spec).expanduser()


_ID_LIMIT = 2**32  # block keys hash token ids as 32-bit words (router/prompt/block_hashing.py)


def completion_text_or_ids(prompt: Any) -> str | list[int]:
    """A completions ``prompt``: a string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    ids = token_ids_given(prompt)
    if ids is not None:
        return ids
    raise InvalidPrompt("prompt must be a string, a list of token ids, or a list holding one of those")


def token_ids_given(prompt: Any) -> list[int] | None:
    """A completions ``prompt`` given as token ids (or a one-element list of them), which vLLM takes as the
    prompt they are; None for any other prompt. Ids no engine has (below 0, or past what its block keys
    hash: 32 bits) are an InvalidPrompt: the engine is their judge, the router keys nothing of them."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
        return None
    if prompt and (min(prompt) < 0 or max(prompt) >= _ID_LIMIT):
        raise InvalidPrompt("token ids must be between 0 and 2**32 - 1")
    return list(prompt)


class PromptTokenizer:
    def __init__(self, path: Path) -> None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # torch is not needed here
        from transformers import AutoTokenizer

        self.path = path
        # Files on this machine only: a start-up never waits on, or fails for, the Hugging Face Hub.
        self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        # tokenizer.json may set truncation or padding, which transformers clears on each of its own calls and
        # vLLM never applies to a prompt; texts_ids calls the backend directly, so it clears them once here.
        self._tokenizer.backend_tokenizer.no_truncation()
        self._tokenizer.backend_tokenizer.no_padding()

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def chat_ids(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        inputs: TemplateInputs = NO_INPUTS,
    ) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, inputs)
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def render_chat(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        inputs: TemplateInputs = NO_INPUTS,
        images: ChatImages | None = None,
    ) -> str:
        """The chat's text as vLLM renders it; images: where its images' parts go, their placeholders left
        in the text (router/prompt/multimodal/chat_images.py)."""
        tools, template_kwargs = inputs.tools, inputs.template_kwargs
        if add_generation_prompt and continue_final_message:
            raise InvalidPrompt("add_generation_prompt and continue_final_message cannot both be true")
        tool_dicts: list[dict[Any, Any] | Callable[..., Any]] | None = None
        if tools is not None:
            tool_dicts = [*engine_tools(tools)]
        template = self.template_text(tool_dicts)
        kwargs = engine_template_kwargs(template_kwargs, template) if template_kwargs else {}
        rendered = self._tokenizer.apply_chat_template(
            engine_conversation(messages, template, inputs.calls_as_given, images),
            tools=tool_dicts,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        return str(rendered)

    @cached_property
    def image_layout(self) -> Idefics3Layout | None:
        """The tokens the model's images become, where its processor is laid out here (else None)."""
        return image_layout(self.path, lambda text: self.text_ids(text, add_special_tokens=False))

    def chat_with_images(
        self,
        model_id: str,
        messages: Sequence[Any],
        flags: tuple[bool, bool, bool],
        inputs: TemplateInputs,
        fetched: Mapping[str, bytes] | None = None,
    ) -> tuple[list[int], list[Placed]]:
        """A chat with images: its ids with the images' tokens, and the images placed in them. flags:
        add_generation_prompt, continue_final_message, add_special_tokens."""
        return chat_with_images(self, model_id, messages, flags, inputs, fetched)

    def template_text(self, tools: list[Any] | None) -> str | None:
        """The template a chat renders with; of a dict of named ones, the one transformers picks (and vLLM):
        "tool_use" when tools are given, else "default"."""
        try:
            return str(self._tokenizer.get_chat_template(None, tools=tools))
        except ValueError:  # no template, or named ones without a default
            return None

    def chat_templates(self) -> list[str]:
        """Every template a chat may render with: the one, or each of a dict of named ones."""
        templates = self._tokenizer.chat_template
        if templates is None:
            return []
        return [str(templates)] if isinstance(templates, str) else [str(t) for t in dict(templates).values()]

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def texts_ids(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Many texts in one call to the Rust backend; each result equals ``text_ids`` of that text.

        transformers' own call wraps the backend in ~0.1 ms of Python per request and has it track every
        token's offsets, which costs as much as the encoding itself (~0.5 us per token); the fast variant
        leaves them out. chat_ids keeps going through transformers, so the tests compare the two paths.
        """
        if not texts:
            return []
        if self.splits_special_tokens:  # transformers handles that setting itself
            encoded = self._tokenizer(list(texts), add_special_tokens=add_special_tokens).input_ids
            return [list(ids) for ids in encoded]
        backend = self._tokenizer.backend_tokenizer
        encodings = backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def backend_config(self) -> dict[str, Any]:
        """The HF tokenizers pipeline as tokenizer.json states it: added tokens, normalizer, pre_tokenizer."""
        config: dict[str, Any] = json.loads(self._tokenizer.backend_tokenizer.to_str())
        return config

    @property
    def splits_special_tokens(self) -> bool:
        """Whether special-token text is encoded as plain text rather than as the special tokens."""
        return bool(self._tokenizer.split_special_tokens)

    def completion_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        """A completions ``prompt``: a string, a list of token ids, or a one-element list of either."""
        text_or_ids = self.completion_prompt(prompt)
        if isinstance(text_or_ids, str):
            return self.text_ids(text_or_ids, add_special_tokens)
        return text_or_ids

    def completion_prompt(self, prompt: Any) -> str | list[int]:
        """A completions ``prompt`` as its text, or as its token ids once checked against the vocabulary."""
        text_or_ids = completion_text_or_ids(prompt)
        if isinstance(text_or_ids, list) and any(t < 0 or t >= self.vocab_size for t in text_or_ids):
            raise InvalidPrompt(f"prompt token ids must be in [0, {self.vocab_size})")
        return text_or_ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])
