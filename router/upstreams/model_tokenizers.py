"""Which tokenizer each model's prompts are tokenized with: the one vLLM loads for it, found on this machine.

vLLM's ``--tokenizer`` defaults to its ``--model``. A model whose configuration names no tokenizer gets the
same, looked for in this order:

1. its name (an adapter's: its base's, whose tokenizer vLLM uses) as a directory holding a tokenizer, or as
   a Hugging Face id in the local cache (the router never downloads);
2. the model's ``root`` as its instances report it in ``/v1/models`` (vLLM's ``--model``), looked for alike;
3. none found: the instances' ``/tokenize`` (exact, one round trip a prompt), with a warning.

The builtin test tokenizer is used only where the configuration names it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from router.config import REMOTE_TOKENIZER, ModelConfig
from router.prompt.tokenization import local_tokenizer_dir, resolve_tokenizer_path
from router.upstreams.instances import Instance

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenizerChoice:
    path: Path | None  # the directory loaded; None: the instances' /tokenize
    origin: str  # what it is and how it was found, for the start-up log and the dashboard
    configured: bool = True  # named by the configuration; False: found by the model's name or root


def choose_tokenizers(
    models: Sequence[ModelConfig], instances: Sequence[Instance]
) -> dict[str, TokenizerChoice]:
    """Each model's tokenizer; instances: those that answered /v1/models (their roots)."""
    choices = {model.name: _choice(model, instances) for model in models}
    for name, choice in choices.items():
        log.info("model %s is tokenized with %s", name, choice.origin)
    return choices


def _choice(model: ModelConfig, instances: Sequence[Instance]) -> TokenizerChoice:
    spec = model.tokenizer
    if spec == REMOTE_TOKENIZER:
        return TokenizerChoice(None, "remote: the instances' /tokenize, as configured")
    if spec is not None:
        return TokenizerChoice(resolve_tokenizer_path(spec), spec)
    found = find_model_tokenizer(model, instances)
    if found is not None:
        return found
    own = model.lora_of or model.name
    reported = ", ".join(model_roots(own, instances)) or "none reported"
    log.warning(
        "model %s: no tokenizer configured, and none on this machine by its name (%s) nor by its root on "
        "its instances (%s), as a directory or a Hugging Face id in the local cache: its prompts are "
        "tokenized by the instances' /tokenize, a round trip each. Set models[].tokenizer to the model's "
        "tokenizer directory, or to remote to choose this",
        model.name,
        own,
        reported,
    )
    return TokenizerChoice(
        None, f"remote: the instances' /tokenize (none found here; roots: {reported})", configured=False
    )


def find_model_tokenizer(model: ModelConfig, instances: Sequence[Instance]) -> TokenizerChoice | None:
    """The tokenizer of a model that names none, found here by its name or its instances' root; None."""
    own = model.lora_of or model.name
    places = [(own, "the model's name")]
    places += [(root, "the model's root on its instances") for root in model_roots(own, instances)]
    for name, how in places:
        found = local_tokenizer_dir(name)
        if found is not None:
            cached = "" if found == Path(name).expanduser() else f", in the Hugging Face cache at {found}"
            return TokenizerChoice(found, f"{name} ({how}{cached})", configured=False)
    return None


def model_roots(model: str, instances: Sequence[Instance]) -> list[str]:
    """model's roots (vLLM's --model) as instances report them, each once."""
    return list(dict.fromkeys(i.roots[model] for i in instances if model in i.roots))
