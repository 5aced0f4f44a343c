"""A completion's ``prompt_embeds`` as vLLM 0.32 keys its blocks (``renderers/embed_utils.py``,
``safe_load_prompt_embeds``; ``v1/core/kv_cache_utils.py``, ``_gen_prompt_embeds_extra_hash_keys``).

vLLM decodes the base64 (strictly), loads the tensor, drops a leading dimension of one, and casts a
floating-point tensor to the model's dtype (its ``--dtype``). The prompt is then one position per row, each
token id 0, and each full block's extra key is the SHA-256 of the bytes of that block's rows, as its
BlockStored events announce them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Literal, NamedTuple

import numpy as np

from router.apis.completions.torch_file import BFLOAT16, UnreadableTensor, read_tensor

EngineDtype = Literal["float32", "float16", "bfloat16"]
# vLLM's --dtype names for them
DTYPE_NAMES: dict[str, EngineDtype] = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}
_FLOATING = frozenset({"float64", "float32", "float16", BFLOAT16})


class EmbeddedPrompt(NamedTuple):
    """What the index keys of a prompt given as embeddings: its length, and each full block's digest."""

    positions: int
    block_digests: list[bytes]


def embedded_prompt(encoded: str, dtype: EngineDtype, block_size: int) -> EmbeddedPrompt:
    """The prompt an engine running in dtype makes of encoded; UnreadableTensor where it would refuse it."""
    try:
        payload = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as error:
        raise UnreadableTensor(f"not base64: {error}") from None
    tensor = read_tensor(payload)
    rows = tensor.values
    if rows.ndim > 2 and rows.shape[0] == 1:
        rows = rows[0]
    if rows.ndim != 2:
        raise UnreadableTensor(f"a tensor of shape {rows.shape}, not (positions, hidden size)")
    if tensor.dtype not in _FLOATING:
        raise UnreadableTensor(f"a tensor of {tensor.dtype}: vLLM casts only floating-point ones")
    data = _cast(rows, tensor.dtype, dtype)
    row_bytes = data.shape[1] * data.itemsize
    raw = np.ascontiguousarray(data).data.cast("B")
    step = block_size * row_bytes
    digests = [
        hashlib.sha256(raw[start : start + step]).digest()
        for start in range(0, len(data) // block_size * step, step)
    ]
    return EmbeddedPrompt(len(data), digests)


def _cast(values: np.ndarray, source: str, dtype: EngineDtype) -> np.ndarray:
    """values, of the dtype source, as torch's ``.to(dtype)`` gives them (bfloat16 as uint16 bit patterns)."""
    if source == dtype:
        return values
    # torch converts a double to a float first, then to half or bfloat16 (c10's Half and BFloat16 take
    # floats): rounding twice, as here.
    single = _as_float32(values, source)
    if dtype == "float32":
        return single
    if dtype == "float16":
        return single.astype(np.float16)
    return _bfloat16_bits(single)


def _as_float32(values: np.ndarray, source: str) -> np.ndarray:
    if source == BFLOAT16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 to bfloat16, rounding to nearest even; any NaN to c10's 0x7FC0."""
    bits = values.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)
