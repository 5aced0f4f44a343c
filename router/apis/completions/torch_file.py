"""A dense tensor saved by ``torch.save`` (its zip format), read into numpy without torch.

The file is a zip archive, stored uncompressed: ``<root>/data.pkl`` is a pickle that rebuilds the tensor
(``torch._utils._rebuild_tensor_v2``: storage, offset, size, stride) from a storage whose bytes are the
member ``<root>/data/<key>``, in the byte order ``<root>/byteorder`` names. Only that shape is read: the
unpickler resolves the few names a dense tensor's pickle holds and nothing else, as ``torch.load`` does
with ``weights_only=True``. bfloat16, which numpy lacks, is read as its uint16 bit patterns.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

BFLOAT16 = "bfloat16"
# torch's storage class names and the dtypes of their elements (numpy's name, or BFLOAT16).
_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": BFLOAT16,
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}


class UnreadableTensor(ValueError):
    """The bytes are no dense tensor saved by torch.save: the engine refuses them too."""


@dataclass(frozen=True)
class SavedTensor:
    """A tensor's elements, C-contiguous; for bfloat16, their bit patterns as uint16."""

    values: np.ndarray
    dtype: str  # numpy's name for it, or BFLOAT16


@dataclass(frozen=True)
class _StorageType:
    dtype: str


@dataclass(frozen=True)
class _Storage:
    elements: np.ndarray
    dtype: str


def read_tensor(payload: bytes) -> SavedTensor:
    """The one tensor a torch.save file holds; UnreadableTensor for anything else."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(payload))
        names = archive.namelist()
    except (zipfile.BadZipFile, ValueError) as error:  # the legacy (pre-1.6) format is no zip either
        raise UnreadableTensor(f"not a torch.save zip file: {error}") from None
    pickles = [name for name in names if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise UnreadableTensor("not a torch.save zip file: no data.pkl")
    root = pickles[0].removesuffix("data.pkl")
    if any(info.compress_type != zipfile.ZIP_STORED for info in archive.infolist()):
        raise UnreadableTensor("a compressed member: torch.save stores its members as they are")
    if _member(archive, root + "byteorder", b"little") != b"little":
        raise UnreadableTensor("a big-endian tensor")
    try:
        tensor = _TensorUnpickler(archive, root).load()
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, IndexError) as error:
        raise UnreadableTensor(f"not a dense tensor: {error}") from None
    if not isinstance(tensor, SavedTensor):
        raise UnreadableTensor(f"holds a {type(tensor).__name__}, not a tensor")
    return tensor


def _member(archive: zipfile.ZipFile, name: str, default: bytes) -> bytes:
    try:
        return archive.read(name)
    except KeyError:
        return default


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, archive: zipfile.ZipFile, root: str) -> None:
        super().__init__(io.BytesIO(archive.read(root + "data.pkl")))
        self._archive = archive
        self._root = root

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if (module, name) == ("collections", "OrderedDict"):  # the tensor's backward hooks: always empty
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a dense tensor")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("not a tensor's storage")
        storage_type, key, numel = pid[1], pid[2], pid[4]
        if not isinstance(storage_type, _StorageType) or not isinstance(numel, int):
            raise pickle.UnpicklingError("not a tensor's storage")
        stored = np.dtype("uint16" if storage_type.dtype == BFLOAT16 else storage_type.dtype)
        data = self._archive.read(f"{self._root}data/{key}")
        if len(data) < numel * stored.itemsize:
            raise pickle.UnpicklingError(f"storage {key} holds fewer than its {numel} elements")
        return _Storage(np.frombuffer(data, dtype=stored, count=numel), storage_type.dtype)


def _rebuild_tensor(
    storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *_: object
) -> SavedTensor:
    """The elements the view (offset, size, stride) of storage covers, copied out in C order."""
    elements = storage.elements
    if len(size) != len(stride) or offset < 0 or any(n < 0 for n in size) or any(s < 0 for s in stride):
        raise pickle.UnpicklingError("a view outside its storage")
    if 0 not in size and offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) >= len(
        elements
    ):
        raise pickle.UnpicklingError("a view outside its storage")
    itemsize = elements.itemsize
    view = np.lib.stride_tricks.as_strided(
        elements[offset:] if 0 not in size else elements[:0],
        shape=size,
        strides=tuple(s * itemsize for s in stride),
        writeable=False,
    )
    return SavedTensor(np.ascontiguousarray(view), storage.dtype)
