# cython: language_level=3, boundscheck=False, wraparound=False
"""The chained block hashes of router/prompt/block_hashing.py, one call for a whole prompt.

Block i's hash is xxh3_64 of its token ids (as uint32 in native order, as array("I") lays them out) seeded
with block i-1's hash; later, when given, is hashed into the parent before every block but the prompt's first.
In Python the loop cost a list-to-array conversion, a slice and a call per block: 1.2-2.2 ms for an 80K-token
prompt, against 0.25 ms here (docs/benchmarks.md, "Other measurements").
"""

from cpython.array cimport array
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint32_t, uint64_t

cdef extern from *:
    """
    #define XXH_INLINE_ALL  /* header only: libxxhash-dev when building, nothing when running */
    #include <xxhash.h>
    """
    uint64_t XXH3_64bits_withSeed(const void *data, size_t length, uint64_t seed) nogil


def chain_hashes(
    object token_ids,
    Py_ssize_t block_size,
    uint64_t parent,
    Py_ssize_t start=0,
    const unsigned char[:] later=None,
):
    """The chained hashes of token_ids' full blocks from block start on, the first seeded with parent."""
    if block_size <= 0 or start < 0:
        raise ValueError("block_size must be positive and start not negative")
    if type(token_ids) is array and (<array>token_ids).ob_descr.typecode == b"I":
        return _array_chain(<array>token_ids, block_size, parent, start, later)
    cdef list tokens = token_ids if type(token_ids) is list else list(token_ids)
    cdef Py_ssize_t blocks = len(tokens) // block_size, index, offset, position
    cdef list hashes = []
    cdef uint32_t *block = <uint32_t *>PyMem_Malloc(block_size * sizeof(uint32_t))
    if block == NULL:
        raise MemoryError()
    try:
        for index in range(start, blocks):
            offset = index * block_size
            for position in range(block_size):
                block[position] = tokens[offset + position]  # OverflowError outside uint32, as array("I")
            if later is not None and index > 0:
                parent = XXH3_64bits_withSeed(&later[0] if later.shape[0] else NULL, later.shape[0], parent)
            parent = XXH3_64bits_withSeed(block, block_size * sizeof(uint32_t), parent)
            hashes.append(parent)
    finally:
        PyMem_Free(block)
    return hashes


cdef list _array_chain(
    array token_ids, Py_ssize_t block_size, uint64_t parent, Py_ssize_t start, const unsigned char[:] later
):
    """chain_hashes of ids that are uint32 already (array("I"), as decoded events hold them): each block is
    hashed where it lies."""
    cdef const uint32_t *tokens = token_ids.data.as_uints
    cdef Py_ssize_t blocks = len(token_ids) // block_size, index
    cdef list hashes = []
    for index in range(start, blocks):
        if later is not None and index > 0:
            parent = XXH3_64bits_withSeed(&later[0] if later.shape[0] else NULL, later.shape[0], parent)
        parent = XXH3_64bits_withSeed(tokens + index * block_size, block_size * sizeof(uint32_t), parent)
        hashes.append(parent)
    return hashes
