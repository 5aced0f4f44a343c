"""A tiny random-weight Idefics3 (a SigLIP-like vision tower, its connector, and a text model of tiny-llama's
sizes and tokenizer), built locally as tiny-llama is, for prompts with images.

The router needs its tokenizer and processor files only (``build_files``); real vLLM serves it once
``build_weights`` (torch and transformers: the stack's environment, ``python -m tinymodel.vision DIR``) has
written random weights. Images are tiles of 64 pixels once their longest side is 128, each tile 16 image
tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tinymodel import builder

VISION_MODEL_NAME = "tiny-idefics3"
TILE_EDGE, LONGEST_EDGE, PATCH, SCALE = 64, 128, 8, 2
IMAGE_SEQ_LEN = (TILE_EDGE // PATCH) ** 2 // SCALE**2
_GRID_TAGS = tuple(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))
SPECIAL_TOKENS = (
    *builder.SPECIAL_TOKENS,
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    *_GRID_TAGS,
)

_VISION = {
    "model_type": "idefics3_vision",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
    "image_size": TILE_EDGE,
    "patch_size": PATCH,
    "num_channels": 3,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}


def config(image_token_id: int) -> dict[str, object]:
    text = {key: value for key, value in builder.LLAMA_CONFIG.items() if key != "architectures"}
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": image_token_id,
        "scale_factor": SCALE,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": _VISION,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }


def build_files(directory: Path) -> None:
    """Its tokenizer (tiny-llama's, with the image tokens), configuration and processor settings."""
    directory.mkdir(parents=True, exist_ok=True)
    builder.build_tokenizer(directory, SPECIAL_TOKENS)
    image_token_id = SPECIAL_TOKENS.index("<image>")  # special tokens come first in the vocabulary
    (directory / "config.json").write_text(json.dumps(config(image_token_id), indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    )
    images = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": LONGEST_EDGE},
        "resample": 1,
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": TILE_EDGE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(images, indent=2))
    processor = {"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_SEQ_LEN}
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))


def ensure_files(home: Path | None = None) -> Path:
    """The model's directory with its files (not its weights: the simulated fleet and the router need none),
    built first if missing."""
    target = (home or builder.default_home()) / "models" / VISION_MODEL_NAME
    if (target / "processor_config.json").exists():
        return target
    return builder.built_once(target, "processor_config.json", build_files)


def build_weights(directory: Path) -> None:
    """Random weights, in bf16, from transformers' own model (torch and transformers needed)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    settings = json.loads((directory / "config.json").read_text())
    for key in ("architectures", "model_type", "torch_dtype"):
        settings.pop(key)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(Idefics3Config(**settings))
    model.to(torch.bfloat16).save_pretrained(str(directory), safe_serialization=True)


if __name__ == "__main__":  # in the stack's environment: python -m tinymodel.vision DIR
    target = Path(sys.argv[1])
    build_files(target)
    build_weights(target)
    print(target)
