"""What a chat template renders beside the messages and the generation flags."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)  # not frozen: one is made per chat tokenized
class TemplateInputs:
    tools: Sequence[Any] | None = None  # the request's tools (None: it has none, or they are left out)
    template_kwargs: Mapping[str, Any] | None = None  # the request's chat_template_kwargs
    # Tool calls laid out as vLLM's Responses path lays them out (router/prompt/chat_conversation.py).
    calls_as_given: bool = False


NO_INPUTS = TemplateInputs()
