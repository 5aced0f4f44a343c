# cython: language_level=3, boundscheck=False, wraparound=False
"""vLLM's KV event batches as every live engine step sends them, decoded in C (router/index/events.py).

A batch of one store of 32 blocks carries 512 token ids. Decoded by msgspec they were 512 int objects, which
the chain hashing kernel then read back one at a time; left encoded (msgspec.Raw) msgspec still walked them
to find their end. Here a batch is read once: token ids go from the wire into the uint32 array the kernel
hashes, with no object per token.

Only the map encoding of the three event types with the values vLLM sends is read here (a batch of
``[ts, [events], rank]``, each event a map whose first key is its "type"; unknown keys skipped). Anything else
(the older array encoding, a value of an unexpected type, a missing field, a token id that is no uint32) makes
decode return None, and the caller decodes the batch with msgspec as before: what a batch decodes to is
msgspec's answer, reached faster for the common form.
"""

from cpython.array cimport array, clone
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.long cimport PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

cdef extern from *:
    uint64_t __builtin_bswap64(uint64_t value) nogil

cdef array _TOKENS = array("I")
cdef uint64_t _UINT32_MOST = 0xFFFFFFFF  # a C constant: the literal would compare as a Python int
cdef object _UNUSUAL = object()  # not the common form: the caller decodes it with msgspec
cdef int _DEEPEST = 32  # nesting skipped in an unknown field's value; deeper is left to msgspec

cdef enum _Field:
    _BLOCK_HASHES
    _PARENT
    _TOKEN_IDS
    _BLOCK_SIZE
    _LORA_ID
    _MEDIUM
    _LORA_NAME
    _EXTRA_KEYS
    _GROUP_IDX
    _KIND
    _WINDOW
    _FIELDS

cdef enum _Type:
    _STORED
    _REMOVED
    _CLEARED

# BlockStored's fields in its order; BlockRemoved's are block_hashes, medium and group_idx.
cdef tuple _STORED_FIELDS = (
    b"block_hashes", b"parent_block_hash", b"token_ids", b"block_size", b"lora_id", b"medium", b"lora_name",
    b"extra_keys", b"group_idx", b"kv_cache_spec_kind", b"kv_cache_spec_sliding_window",
)
cdef int _STORED_REQUIRED = (1 << _EXTRA_KEYS) - 1  # the fields before extra_keys have no default
cdef int _REMOVED_FIELDS = (1 << _BLOCK_HASHES) | (1 << _MEDIUM) | (1 << _GROUP_IDX)
cdef int _REMOVED_REQUIRED = (1 << _BLOCK_HASHES) | (1 << _MEDIUM)


# The bytes an int that can be a token id takes after its tag: 0 for a positive fixint, -1 for what is no such
# int (a negative fixint, any other type).
cdef Py_ssize_t _WIDTHS[256]
for _tag in range(256):
    _WIDTHS[_tag] = -1
for _tag in range(0x80):
    _WIDTHS[_tag] = 0
for _tag, _width in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8), (0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)):
    _WIDTHS[_tag] = _width


cdef struct _Reader:
    const unsigned char *data
    Py_ssize_t size
    Py_ssize_t at


cdef inline uint64_t _be(const unsigned char *at, int width) noexcept nogil:
    cdef uint64_t value = 0
    cdef int i
    for i in range(width):
        value = (value << 8) | at[i]
    return value


cdef inline uint64_t _load_be64(const unsigned char *at) noexcept nogil:
    cdef uint64_t value
    memcpy(&value, at, 8)
    return __builtin_bswap64(value)


cdef inline uint32_t _be16(const unsigned char *at) noexcept nogil:
    return (<uint32_t>at[0] << 8) | at[1]


cdef inline uint32_t _be32(const unsigned char *at) noexcept nogil:
    return (<uint32_t>at[0] << 24) | (<uint32_t>at[1] << 16) | (<uint32_t>at[2] << 8) | at[3]


cdef inline bint _has(_Reader *r, Py_ssize_t count) noexcept nogil:
    return r.size - r.at >= count


cdef Py_ssize_t _container(_Reader *r, unsigned char fix, unsigned char wide16, unsigned char wide32) noexcept nogil:
    """The length of the array (fix 0x90) or map (fix 0x80) at r, read past its header; -1 if it is none."""
    if not _has(r, 1):
        return -1
    cdef unsigned char tag = r.data[r.at]
    if tag & 0xF0 == fix:
        r.at += 1
        return tag & 0x0F
    if tag == wide16 and _has(r, 3):
        r.at += 3
        return _be16(r.data + r.at - 2)
    if tag == wide32 and _has(r, 5):
        r.at += 5
        return _be32(r.data + r.at - 4)
    return -1


cdef inline Py_ssize_t _array(_Reader *r) noexcept nogil:
    return _container(r, 0x90, 0xDC, 0xDD)


cdef inline Py_ssize_t _map(_Reader *r) noexcept nogil:
    return _container(r, 0x80, 0xDE, 0xDF)


cdef Py_ssize_t _sized(_Reader *r, unsigned char first, const unsigned char **start) noexcept nogil:
    """The str (first: 0xD9, str8) or bin (first: 0xC4, bin8) at r, of a length in 8, 16 or 32 bits (tags
    first, first + 1, first + 2), or a fixstr for a str: its length and where its bytes start, read past it;
    -1 if it is none, or is cut short."""
    if not _has(r, 1):
        return -1
    cdef unsigned char tag = r.data[r.at]
    cdef Py_ssize_t length, header
    if first == 0xD9 and tag & 0xE0 == 0xA0:
        length, header = tag & 0x1F, 1
    elif tag == first and _has(r, 2):
        length, header = r.data[r.at + 1], 2
    elif tag == first + 1 and _has(r, 3):
        length, header = _be16(r.data + r.at + 1), 3
    elif tag == first + 2 and _has(r, 5):
        length, header = _be32(r.data + r.at + 1), 5
    else:
        return -1
    if not _has(r, header + length):
        return -1
    start[0] = r.data + r.at + header
    r.at += header + length
    return length


cdef inline Py_ssize_t _text(_Reader *r, const unsigned char **start) noexcept nogil:
    return _sized(r, 0xD9, start)


cdef int _skip(_Reader *r, int depth) noexcept nogil:
    """Read past the value at r, whatever it is; -1 when it is malformed or nested past _DEEPEST."""
    if not _has(r, 1) or depth > _DEEPEST:
        return -1
    cdef unsigned char tag = r.data[r.at]
    cdef Py_ssize_t count, index, length
    cdef const unsigned char *start
    if tag <= 0x7F or tag >= 0xE0 or tag == 0xC0 or tag == 0xC2 or tag == 0xC3:  # fixints, nil, false, true
        r.at += 1
        return 0
    if tag & 0xE0 == 0xA0 or 0xD9 <= tag <= 0xDB:
        return 0 if _text(r, &start) >= 0 else -1
    if tag & 0xF0 == 0x90 or tag == 0xDC or tag == 0xDD:
        count = _array(r)
        for index in range(count):
            if _skip(r, depth + 1) < 0:
                return -1
        return 0 if count >= 0 else -1
    if tag & 0xF0 == 0x80 or tag == 0xDE or tag == 0xDF:
        count = _map(r)
        for index in range(2 * count):
            if _skip(r, depth + 1) < 0:
                return -1
        return 0 if count >= 0 else -1
    if tag == 0xCC or tag == 0xD0:
        length = 2
    elif tag == 0xCD or tag == 0xD1:
        length = 3
    elif tag == 0xCE or tag == 0xD2 or tag == 0xCA:
        length = 5
    elif tag == 0xCF or tag == 0xD3 or tag == 0xCB:
        length = 9
    elif 0xD4 <= tag <= 0xD8:  # fixext 1, 2, 4, 8, 16
        length = 2 + (1 << (tag - 0xD4))
    elif (tag == 0xC4 or tag == 0xC7) and _has(r, 2):  # bin8, ext8
        length = 2 + r.data[r.at + 1] + (tag == 0xC7)
    elif (tag == 0xC5 or tag == 0xC8) and _has(r, 3):
        length = 3 + _be16(r.data + r.at + 1) + (tag == 0xC8)
    elif (tag == 0xC6 or tag == 0xC9) and _has(r, 5):
        length = 5 + _be32(r.data + r.at + 1) + (tag == 0xC9)
    else:
        return -1
    if not _has(r, length):
        return -1
    r.at += length
    return 0


cdef object _int(_Reader *r):
    """The int at r, read past it; _UNUSUAL if it is none."""
    if not _has(r, 1):
        return _UNUSUAL
    cdef unsigned char tag = r.data[r.at]
    cdef int width
    if tag <= 0x7F:
        r.at += 1
        return tag
    if tag >= 0xE0:
        r.at += 1
        return <int>tag - 0x100
    if 0xCC <= tag <= 0xCF:
        width = 1 << (tag - 0xCC)
    elif 0xD0 <= tag <= 0xD3:
        width = 1 << (tag - 0xD0)
    else:
        return _UNUSUAL
    if not _has(r, 1 + width):
        return _UNUSUAL
    cdef uint64_t value = _be(r.data + r.at + 1, width)
    r.at += 1 + width
    if tag <= 0xCF:
        return PyLong_FromUnsignedLongLong(value)
    if width < 8 and value >> (8 * width - 1):  # negative: extend its sign
        value |= ~((<uint64_t>1 << (8 * width)) - 1)
    return PyLong_FromLongLong(<int64_t>value)


cdef inline bint _nil(_Reader *r) noexcept nogil:
    """Whether nil is at r; read past it if so."""
    if _has(r, 1) and r.data[r.at] == 0xC0:
        r.at += 1
        return True
    return False


cdef object _optional_int(_Reader *r):
    return None if _nil(r) else _int(r)


cdef object _optional_str(_Reader *r):
    if _nil(r):
        return None
    cdef const unsigned char *start
    cdef Py_ssize_t length = _text(r, &start)
    if length < 0:
        return _UNUSUAL
    try:
        return PyUnicode_DecodeUTF8(<const char *>start, length, NULL)
    except UnicodeDecodeError:
        return _UNUSUAL


cdef object _hash(_Reader *r):
    """A block hash: an int, or bytes (vLLM's full hashes)."""
    if not _has(r, 1):
        return _UNUSUAL
    if not 0xC4 <= r.data[r.at] <= 0xC6:  # no bin
        return _int(r)
    cdef const unsigned char *start
    cdef Py_ssize_t length = _sized(r, 0xC4, &start)
    if length < 0:
        return _UNUSUAL
    return PyBytes_FromStringAndSize(<const char *>start, length)


cdef object _optional_hash(_Reader *r):
    return None if _nil(r) else _hash(r)


cdef object _hashes(_Reader *r):
    cdef Py_ssize_t count = _array(r), index
    if count < 0 or count > r.size - r.at:  # every item takes a byte at least
        return _UNUSUAL
    cdef list hashes = [None] * count
    cdef object value
    for index in range(count):
        value = _hash(r)
        if value is _UNUSUAL:
            return _UNUSUAL
        hashes[index] = value
    return hashes


cdef object _extra_keys(_Reader *r):
    """None, or one None per block (a request with no adapter, salt or media, as vLLM 0.32 announces it)."""
    if _nil(r):
        return None
    cdef Py_ssize_t count = _array(r), index
    if count < 0 or count > r.size - r.at:
        return _UNUSUAL
    for index in range(count):
        if not _nil(r):
            return _UNUSUAL
    return [None] * count


cdef object _tokens(_Reader *r):
    """The array of ints at r as array("I"); _UNUSUAL if any is no uint32. Token ids of a large vocabulary
    come as uint16 and uint32 in no order: each is read as the top bytes of an 8-byte load, without a
    branch on its width (mispredicted, the branches took three quarters of the time)."""
    cdef Py_ssize_t count = _array(r)
    if count < 0 or count > r.size - r.at:
        return _UNUSUAL
    cdef array tokens = clone(_TOKENS, count, False)
    cdef uint32_t *out = tokens.data.as_uints
    cdef const unsigned char *data = r.data
    cdef Py_ssize_t index, width, at = r.at, size = r.size  # locals: out's stores would reload r's
    cdef unsigned char tag
    cdef uint64_t value
    for index in range(count):
        if at >= size:
            return _UNUSUAL
        tag = data[at]
        width = _WIDTHS[tag]
        if width == 0:  # positive fixint
            out[index] = tag
            at += 1
            continue
        if width < 0 or size - at < 1 + width:  # no int that can be an id, or cut short
            return _UNUSUAL
        if size - at >= 9:
            value = _load_be64(data + at + 1) >> (64 - 8 * width)
        else:  # the payload's last bytes: no 8 to load
            value = _be(data + at + 1, <int>width)
        if value > _UINT32_MOST or (tag >= 0xD0 and (value >> (8 * width - 1)) != 0):  # past uint32, negative
            return _UNUSUAL
        out[index] = <uint32_t>value
        at += 1 + width
    r.at = at
    return tokens


cdef int _field(const unsigned char *name, Py_ssize_t length, int likely) noexcept:
    """The _Field named name, or -1; likely is tried first (vLLM sends the fields in their order)."""
    cdef int field
    if likely < _FIELDS and _is(name, length, _STORED_FIELDS[likely]):
        return likely
    for field in range(_FIELDS):
        if _is(name, length, _STORED_FIELDS[field]):
            return field
    return -1


cdef inline bint _is(const unsigned char *text, Py_ssize_t length, bytes word) noexcept:
    """Whether the str of length bytes at text (length -1: none was there) is word."""
    return len(word) == length and memcmp(<const char *>word, text, length) == 0


cdef class BatchDecoder:
    """Decodes the common form of a batch into the event types it is given."""

    cdef object _stored, _removed, _cleared
    cdef int _most_rank
    cdef bint _enabled

    def __init__(self, stored, removed, cleared, int most_rank, bint enabled=True):
        """enabled=False: every payload is left to the caller (None), for a reference that decodes alone."""
        self._stored, self._removed, self._cleared = stored, removed, cleared
        self._most_rank, self._enabled = most_rank, enabled

    def decode(self, object payload):
        """(ts, events, data_parallel_rank) of the batch payload holds, or None when it is not of the common
        form (or not a batch at all)."""
        return self._read(payload, True)

    def event(self, object payload):
        """The event payload holds (an item of a batch's events), or None when it is not of the common form."""
        return self._read(payload, False)

    cdef object _read(self, object payload, bint batch):
        cdef Py_buffer view
        cdef _Reader r
        if not self._enabled:
            return None
        PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
        try:
            r.data, r.size, r.at = <const unsigned char *>view.buf, view.len, 0
            if batch:
                return self._batch(&r)
            event = self._event(&r)
            return None if event is _UNUSUAL or r.at != r.size else event
        finally:
            PyBuffer_Release(&view)

    cdef object _batch(self, _Reader *r):
        cdef Py_ssize_t items = _array(r), count, index
        if items != 2 and items != 3:
            return None
        cdef double ts
        cdef unsigned char tag = r.data[r.at] if _has(r, 1) else 0
        cdef uint64_t bits
        cdef uint32_t narrow
        if tag == 0xCB and _has(r, 9):
            bits = _be(r.data + r.at + 1, 8)
            memcpy(&ts, &bits, 8)
            r.at += 9
        elif tag == 0xCA and _has(r, 5):
            narrow = _be32(r.data + r.at + 1)
            ts = (<float *>&narrow)[0]
            r.at += 5
        else:
            return None
        count = _array(r)
        if count < 0 or count > r.size - r.at:
            return None
        cdef list events = [None] * count
        cdef object event
        for index in range(count):
            event = self._event(r)
            if event is _UNUSUAL:
                return None
            events[index] = event
        cdef object rank = None
        if items == 3:
            rank = _optional_int(r)
            if rank is _UNUSUAL or (rank is not None and not 0 <= rank <= self._most_rank):
                return None
        if r.at != r.size:
            return None
        return ts, events, rank

    cdef object _event(self, _Reader *r):
        cdef Py_ssize_t keys = _map(r), length, index
        cdef const unsigned char *name = NULL
        if keys < 1:
            return _UNUSUAL
        length = _text(r, &name)  # the tag, first, as vLLM's encoder puts it
        if not _is(name, length, b"type"):
            return _UNUSUAL
        length = _text(r, &name)
        cdef int allowed, required
        cdef _Type kind
        if _is(name, length, b"BlockStored"):
            kind, allowed, required = _STORED, (1 << _FIELDS) - 1, _STORED_REQUIRED
        elif _is(name, length, b"BlockRemoved"):
            kind, allowed, required = _REMOVED, _REMOVED_FIELDS, _REMOVED_REQUIRED
        elif _is(name, length, b"AllBlocksCleared"):
            kind, allowed, required = _CLEARED, 0, 0
        else:
            return _UNUSUAL
        cdef list values = [None] * _FIELDS
        cdef int seen = 0, field = -1
        cdef object value
        for index in range(keys - 1):
            length = _text(r, &name)
            if length < 0:
                return _UNUSUAL
            field = _field(name, length, field + 1)
            if field < 0 and _is(name, length, b"type"):
                return _UNUSUAL  # tagged twice
            if field < 0 or not allowed >> field & 1:  # a field this vLLM adds: skipped, as msgspec does
                if _skip(r, 0) < 0:
                    return _UNUSUAL
                continue
            if seen >> field & 1:
                return _UNUSUAL  # named twice
            seen |= 1 << field
            if field == _BLOCK_HASHES:
                value = _hashes(r)
            elif field == _PARENT:
                value = _optional_hash(r)
            elif field == _TOKEN_IDS:
                value = _tokens(r)
            elif field == _BLOCK_SIZE:
                value = _int(r)
            elif field == _EXTRA_KEYS:
                value = _extra_keys(r)
            elif field == _MEDIUM or field == _LORA_NAME or field == _KIND:
                value = _optional_str(r)
            else:  # lora_id, group_idx, the sliding window
                value = _optional_int(r)
            if value is _UNUSUAL:
                return _UNUSUAL
            values[field] = value
        if seen & required != required:
            return _UNUSUAL
        if kind == _CLEARED:
            return self._cleared()
        if kind == _REMOVED:
            return self._removed(values[_BLOCK_HASHES], values[_MEDIUM], values[_GROUP_IDX])
        return self._stored(*values)
