"""A multimodal item's hash as vLLM 0.32 computes it (``multimodal/hasher.py``, ``MultiModalHasher``; called
from ``ProcessorInputs.get_mm_hashes``), the identifier its KV blocks' keys carry.

vLLM hashes its keyword arguments in name order, ``model_id`` (the engine's ``--model``, not the served name)
and ``image``, over a framed stream: every chunk is preceded by its length in 8 little-endian bytes, every
value by a tag (none, sequence, mapping, leaf), a mapping's keys framed as strings, numbers as numpy's int64
or float64 bytes. An image loaded from a URL is hashed by its encoded bytes as sent, not its pixels; when its
mode is not RGB (which vLLM's loader converts it to) the conversion's settings are hashed beside the bytes; an
EXIF ImageID in it replaces both. A client's ``uuid`` for an item is its identifier, unhashed. The algorithm
is blake3 unless the engine runs with ``--mm-hasher-algorithm``.
"""

from __future__ import annotations

import hashlib
import io
import struct
import uuid
from collections.abc import Iterator
from typing import Any

from blake3 import blake3
from PIL import ExifTags, Image, UnidentifiedImageError

_NONE, _SEQUENCE, _MAPPING, _LEAF = b"\x00", b"\x01", b"\x02", b"\x03"
# vLLM's ImageMediaIO: the mode images are converted to, and the background an alpha channel goes onto.
IMAGE_MODE = "RGB"
_BACKGROUND = (255, 255, 255)


class UnreadableImage(ValueError):
    """The image's bytes are no image a loader reads: the engine will refuse it."""


def _framed(chunk: bytes) -> Iterator[bytes]:
    yield len(chunk).to_bytes(8, "little")
    yield chunk


def _leaf(value: bytes | str | int | float) -> Iterator[bytes]:
    if isinstance(value, bytes):
        yield from _framed(value)
    elif isinstance(value, str):
        yield from _framed(value.encode())
    elif isinstance(value, bool):  # numpy's bool is one byte
        yield from _framed(b"\x01" if value else b"\x00")
    elif isinstance(value, int):
        yield from _framed(value.to_bytes(8, "little", signed=True))
    else:
        yield from _framed(struct.pack("<d", value))


def _value(value: Any) -> Iterator[bytes]:
    if value is None:
        yield _NONE
    elif isinstance(value, list | tuple):
        yield _SEQUENCE
        yield len(value).to_bytes(8, "little")
        for element in value:
            yield from _value(element)
    elif isinstance(value, dict):
        yield _MAPPING
        yield len(value).to_bytes(8, "little")
        for key, element in value.items():
            yield from _framed(str(key).encode())
            yield from _value(element)
    elif isinstance(value, SentImage):
        yield _LEAF
        yield from value.chunks()
    else:
        yield _LEAF
        yield from _leaf(value)


# EXIF orientations that turn an image a quarter: vLLM's loader transposes it, so its width and height swap.
_QUARTER_TURNS = frozenset({5, 6, 7, 8})
_ORIENTATION = 0x0112


class SentImage:
    """An image as vLLM's loader keeps it for hashing: its bytes as sent, whether they are converted, and
    its size as the processor sees it (width, height, once turned upright)."""

    def __init__(self, data: bytes) -> None:
        try:
            with Image.open(io.BytesIO(data)) as image:  # the header only: nothing is decoded
                exif = image.getexif()
                mode, (width, height) = image.mode, image.size
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as error:
            raise UnreadableImage(f"not an image a loader reads: {error}") from None
        image_id = exif.get(ExifTags.Base.ImageID)
        self.data, self.converted = data, mode != IMAGE_MODE
        self.image_id = image_id.bytes if isinstance(image_id, uuid.UUID) else None
        self.size = (height, width) if exif.get(_ORIENTATION) in _QUARTER_TURNS else (width, height)

    def chunks(self) -> Iterator[bytes]:
        if self.image_id is not None:
            yield from _framed(self.image_id)
            return
        yield from _framed(b"image")
        if self.converted:
            io_config = {"image_mode": IMAGE_MODE, "rgba_background_color": _BACKGROUND}
            yield from _value({"io_config": io_config, "data": self.data})
        else:
            yield from _value(self.data)


def image_hash(model_id: str, image: SentImage, algorithm: str = "blake3") -> str:
    """The identifier of an image, at an engine serving model_id."""
    digest = blake3() if algorithm == "blake3" else hashlib.new(algorithm)
    for name, value in (("image", image), ("model_id", model_id)):  # in name order
        for chunk in _framed(name.encode()):
            digest.update(chunk)
        for chunk in _value(value):
            digest.update(chunk)
    return digest.hexdigest()
