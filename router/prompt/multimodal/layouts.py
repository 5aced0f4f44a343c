"""Which tokens an image becomes in the prompt, as vLLM 0.32's processor for the model lays them out.

vLLM renders a chat whose template reads content as a string with the model's placeholder (``<image>``) for
each of a message's images before its text, one a line (``renderers/chat_utils.py``), tokenizes it, and then
replaces each placeholder token with the image's tokens: its placeholder, whose whole range the image's keys
cover (router/prompt/multimodal/block_keys.py). How many and which tokens depends on the model's processor.
Laid out here: Idefics3 (``model_executor/models/idefics3.py``, tiles from transformers'
``Idefics3ImageProcessor.get_number_of_image_patches``). A model whose layout is not here keeps its images'
requests routed by load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.prompt.chat_conversation import InvalidPrompt

# transformers' Idefics3 image processor: no side of a resized image is longer than this.
_LARGEST_SIDE = 4096


@dataclass(frozen=True)
class Idefics3Layout:
    """An image is tiles of ``tile_edge`` pixels (once its longest side is ``longest_edge``), each its row
    and column tag and ``seq_len`` image tokens, a line a row, then the whole image (the global tag and its
    tokens) between fake tokens; without splitting, the whole image alone."""

    encode: Callable[[str], list[int]]  # a text's token ids, without special tokens
    placeholder_id: int
    seq_len: int
    splitting: bool
    longest_edge: int
    tile_edge: int
    placeholder: str = "<image>"
    _by_grid: dict[tuple[int, int], list[int]] = field(default_factory=dict, compare=False)

    def tokens(self, size: tuple[int, int]) -> list[int]:
        """The tokens an image of size (width, height) becomes."""
        grid = self._grid(*size) if self.splitting else (0, 0)
        tokens = self._by_grid.get(grid)
        if tokens is None:
            tokens = self._by_grid[grid] = self.encode(self._text(*grid))
        return tokens

    def _text(self, rows: int, cols: int) -> str:
        image = "<image>" * self.seq_len
        whole = "<fake_token_around_image><global-img>" + image
        if not rows and not cols:
            return whole + "<fake_token_around_image>"
        lines = [
            "".join(f"<fake_token_around_image><row_{row}_col_{col}>{image}" for col in range(1, cols + 1))
            + "\n"
            for row in range(1, rows + 1)
        ]
        return "".join(lines) + "\n" + whole + "<fake_token_around_image>"

    def _grid(self, width: int, height: int) -> tuple[int, int]:
        height, width = _longest_side_to(height, width, self.longest_edge)
        height, width = _within(height, width, _LARGEST_SIDE)
        tile = self.tile_edge
        rows, cols = math.ceil(height / tile), math.ceil(width / tile)
        return (rows, cols) if rows > 1 or cols > 1 else (0, 0)


def _longest_side_to(height: int, width: int, longest: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _within(height: int, width: int, largest: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > largest:
        width, height = largest, int(largest / aspect)
    elif height > width and height > largest:
        height, width = largest, int(largest * aspect)
    return max(height, 1), max(width, 1)


def image_layout(model_dir: Path, encode: Callable[[str], list[int]]) -> Idefics3Layout | None:
    """The layout of the model whose files are in model_dir; None when its images are not laid out here."""
    config = _json(model_dir / "config.json")
    if config.get("model_type") != "idefics3":
        return None
    processor, images = (
        _json(model_dir / "processor_config.json"),
        _json(model_dir / "preprocessor_config.json"),
    )
    try:
        (placeholder_id,) = encode("<image>")
        return Idefics3Layout(
            encode,
            placeholder_id,
            int(processor["image_seq_len"]),
            bool(images.get("do_image_splitting", True)),
            int(images["size"]["longest_edge"]),
            int(images["max_image_size"]["longest_edge"]),
        )
    except (KeyError, TypeError, ValueError):  # a processor configured otherwise than read here
        return None


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def laid_out(
    token_ids: Sequence[int], layout: Idefics3Layout, sizes: Sequence[tuple[int, int]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt with each image's placeholder token replaced by its tokens (images in order), and each
    image's (offset, length) in it."""
    positions = [index for index, token in enumerate(token_ids) if token == layout.placeholder_id]
    if len(positions) != len(sizes):
        raise InvalidPrompt(f"{len(positions)} image placeholders in the prompt for {len(sizes)} images")
    expanded: list[int] = []
    ranges: list[tuple[int, int]] = []
    start = 0
    for position, size in zip(positions, sizes, strict=True):
        expanded += token_ids[start:position]
        tokens = layout.tokens(size)
        ranges.append((len(expanded), len(tokens)))
        expanded += tokens
        start = position + 1
    expanded += token_ids[start:]
    return expanded, ranges
