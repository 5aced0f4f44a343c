# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The block index's tables (router/index/holdings.py): insertion-ordered maps from 64-bit keys to integers,
held in C arrays instead of a Python object per key and value.

A dict of ints costs about 100 bytes an entry (its slot, a key object, a value object); here an entry is 19
bytes in arrays plus 4-byte slots in a table two thirds larger than the arrays: the index's RSS per block held
was 198-211 bytes with dicts. Values below 2^80 are held inline (a block's kvroute hash packed with its
16-bit reference count; an owner mask of a fleet of up to 80 owners); a wider one (an owner mask in a larger
fleet) as a pointer to its int, in an array made when the first comes, the ints interned: most blocks have
one holder or a few, so the same masks recur.

The layout is CPython's own for dicts: a hash table of slots holding positions in an entries array kept in
insertion order, so iteration goes oldest first (the bound evicts from the front) and setting a key present
keeps its place; removal leaves a hole, compacted away when the table grows or holes pile up.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsUnsignedLongLongMask
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint64_t
from libc.stdlib cimport qsort
from libc.string cimport memcpy, memset

cdef enum:
    _EMPTY = -1
    _REMOVED = -2

cdef enum:  # what an iteration yields
    _KEYS = 0
    _VALUES = 1
    _ITEMS = 2

cdef enum:
    _LIVE = 0
    _HOLE = 1
    _WIDE = 2  # the value is an int in _objects

cdef extern from *:
    """
    /* A key's home slot in a table of any size: its Fibonacci hash (sequential keys, as tests and benchmarks
       use, spread too) scaled to the size by a 128-bit product, so the table need not be a power of 2. */
    static inline Py_ssize_t u64map_home(uint64_t key, uint64_t size) {
        return (Py_ssize_t)(((unsigned __int128)(key * 0x9E3779B97F4A7C15ULL) * size) >> 64);
    }
    """
    Py_ssize_t u64map_home(uint64_t key, uint64_t size) nogil
    void __builtin_prefetch(const void *address) nogil

cdef extern from *:
    """
    #include <sys/mman.h>
    /* Arrays of a megabyte or more are mapped for themselves: released, their pages go back to the system at
       once. From malloc, the arrays a table outgrew stayed resident in the heap (in glibc, freed blocks below
       its mmap threshold, which rises to 32 MiB as large blocks are freed, are kept for reuse). */
    #define U64MAP_MAPPED ((size_t)1 << 20)
    static void *u64map_alloc(size_t bytes) {
        if (bytes < U64MAP_MAPPED)
            return PyMem_Malloc(bytes);
        void *mapped = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mapped == MAP_FAILED)
            return NULL;
        /* In 2 MiB pages where the kernel has them to give (transparent huge pages, "madvise" by default on
           Debian): a probe into a table of millions then misses the cache, not the TLB as well. */
#ifdef MADV_HUGEPAGE
        madvise(mapped, bytes, MADV_HUGEPAGE);
#endif
        return mapped;
    }
    static void u64map_release(void *memory, size_t bytes) {
        if (memory == NULL)
            return;
        if (bytes < U64MAP_MAPPED)
            PyMem_Free(memory);
        else
            munmap(memory, bytes);
    }
    """
    void *u64map_alloc(size_t bytes)
    void u64map_release(void *memory, size_t bytes)


cdef object _ABSENT = object()
cdef object _WORD = 1 << 64
cdef object _INLINE = 1 << 80
cdef Py_ssize_t _MOST_ENTRIES = 0x7FFFFFFF  # positions are int32 slots
cdef Py_ssize_t _INSERTION_SORTED = 64  # stores of at most this many blocks: repeats found by insertion sort
# Entries ahead whose home slots a rebuild starts loading: a table of millions misses the cache at each.
cdef Py_ssize_t _REBUILD_AHEAD = 16
cdef Py_ssize_t _INTERNED_MOST = 4096  # distinct wide values shared at once; past it, interning starts over


# A table's arrays, as held at one moment: to be released once others replace them.
cdef struct _Arrays:
    uint64_t *keys
    uint64_t *low
    uint16_t *high
    uint8_t *state
    int32_t *slots
    PyObject **objects  # NULL until a wide value came
    Py_ssize_t capacity  # of the entries arrays
    Py_ssize_t size  # of the table
    Py_ssize_t used  # entries in them, holes included


cdef void _release(_Arrays held, bint references):
    """Free held's arrays; references: drop the wide values' references too (False: they moved)."""
    cdef Py_ssize_t position
    if held.objects != NULL:
        if references:
            for position in range(held.used):
                if held.state[position] == _WIDE:
                    Py_XDECREF(held.objects[position])
        u64map_release(held.objects, held.capacity * sizeof(PyObject *))
    u64map_release(held.keys, held.capacity * sizeof(uint64_t))
    u64map_release(held.low, held.capacity * sizeof(uint64_t))
    u64map_release(held.high, held.capacity * sizeof(uint16_t))
    u64map_release(held.state, held.capacity * sizeof(uint8_t))
    u64map_release(held.slots, held.size * sizeof(int32_t))


cdef inline uint64_t _key(object key) except? 0:
    """key as a C integer: OverflowError outside [0, 2^64). Special methods take their key as an object, as
    Cython would otherwise pass a typed one through the sequence protocol's ssize_t."""
    return key


cdef class U64Map:
    """A dict from ints in [0, 2^64) to non-negative ints, in insertion order."""

    cdef uint64_t *_keys
    cdef uint64_t *_low
    cdef uint16_t *_high
    cdef uint8_t *_state
    cdef int32_t *_slots
    cdef Py_ssize_t _used  # entries in the arrays, holes included
    cdef Py_ssize_t _capacity  # of the entries arrays
    cdef Py_ssize_t _live
    cdef Py_ssize_t _first  # no live entry before it: evicting from the front skips what it removed
    cdef Py_ssize_t _size  # of the table
    cdef Py_ssize_t _layout  # changes whenever entries move: an iteration in progress stops
    cdef PyObject **_objects  # per entry, the wide value's int; NULL until a wide value comes
    cdef dict _interned

    def __cinit__(self):
        self._interned = {}
        self._allocate(8)

    def __dealloc__(self):
        _release(self._held(), True)

    cdef _Arrays _held(self):
        cdef _Arrays held
        held.keys, held.low, held.high, held.state = self._keys, self._low, self._high, self._state
        held.slots, held.objects = self._slots, self._objects
        held.capacity, held.size, held.used = self._capacity, self._size, self._used
        return held

    cdef PyObject **_new_objects(self, Py_ssize_t capacity) except NULL:
        cdef PyObject **objects = <PyObject **>u64map_alloc(capacity * sizeof(PyObject *))
        if objects == NULL:
            raise MemoryError()
        memset(objects, 0, capacity * sizeof(PyObject *))
        return objects

    cdef object _interned_value(self, object value):
        found = self._interned.get(value)
        if found is not None:
            return found
        if len(self._interned) >= _INTERNED_MOST:
            self._interned.clear()  # those in use stay alive where they are held
        self._interned[value] = value
        return value

    cdef int _allocate(self, Py_ssize_t capacity) except -1:
        """Empty arrays for capacity entries and a table with at least 40% of its slots empty (a probe for a
        key not there, most of the index's, then looks at 3.6 slots on average, against 8.5 at 25%), in
        place of the arrays held, which the caller has released or keeps. Nothing changes when they cannot
        be had."""
        cdef Py_ssize_t size = capacity + capacity * 2 // 3 + 1
        cdef uint64_t *keys = <uint64_t *>u64map_alloc(capacity * sizeof(uint64_t))
        cdef uint64_t *low = <uint64_t *>u64map_alloc(capacity * sizeof(uint64_t))
        cdef uint16_t *high = <uint16_t *>u64map_alloc(capacity * sizeof(uint16_t))
        cdef uint8_t *state = <uint8_t *>u64map_alloc(capacity * sizeof(uint8_t))
        cdef int32_t *slots = <int32_t *>u64map_alloc(size * sizeof(int32_t))
        cdef _Arrays made
        if not (keys and low and high and state and slots):
            made.keys, made.low, made.high, made.state, made.slots = keys, low, high, state, slots
            made.objects, made.capacity, made.size, made.used = NULL, capacity, size, 0
            _release(made, False)
            raise MemoryError()
        memset(slots, 0xFF, size * sizeof(int32_t))  # every slot _EMPTY
        self._keys, self._low, self._high, self._state, self._slots = keys, low, high, state, slots
        self._capacity, self._used, self._live, self._first = capacity, 0, 0, 0
        self._size = size
        self._layout += 1
        return 0

    cdef inline Py_ssize_t _home(self, uint64_t key) nogil:
        return u64map_home(key, self._size)

    cdef inline Py_ssize_t _next(self, Py_ssize_t slot) nogil:
        slot += 1
        return 0 if slot == self._size else slot

    cdef inline void _prefetch(self, uint64_t key) noexcept nogil:
        """Start loading key's home slot: a batch's probes into a table of millions then miss the cache
        together, not one after another."""
        __builtin_prefetch(&self._slots[self._home(key)])

    cdef Py_ssize_t _slot(self, uint64_t key):
        """The slot holding key's entry, or -1."""
        cdef Py_ssize_t slot = self._home(key)
        cdef int32_t position
        while True:
            position = self._slots[slot]
            if position == _EMPTY:
                return -1
            if position >= 0 and self._keys[position] == key:
                return slot
            slot = self._next(slot)

    cdef Py_ssize_t _find(self, uint64_t key):
        """The entry of key, or -1."""
        cdef Py_ssize_t slot = self._slot(key)
        return -1 if slot < 0 else self._slots[slot]

    cdef int _rebuild(self, Py_ssize_t capacity) except -1:
        """Entries in order into arrays of capacity, holes dropped; as it was when they cannot be had."""
        cdef _Arrays old = self._held()
        cdef PyObject **moved = NULL
        cdef Py_ssize_t position, slot, at
        if old.objects != NULL:
            moved = self._new_objects(capacity)
        try:
            self._allocate(capacity)
        except MemoryError:
            u64map_release(moved, capacity * sizeof(PyObject *))
            raise
        self._objects = moved
        for position in range(old.used):
            if position + _REBUILD_AHEAD < old.used:  # the table's slots are missed ahead, together
                self._prefetch(old.keys[position + _REBUILD_AHEAD])
            if old.state[position] == _HOLE:
                continue
            at = self._used
            self._keys[at], self._low[at] = old.keys[position], old.low[position]
            self._high[at], self._state[at] = old.high[position], old.state[position]
            if old.state[position] == _WIDE:
                self._objects[at] = old.objects[position]  # the reference moves with it
            slot = self._home(old.keys[position])
            while self._slots[slot] != _EMPTY:
                slot = self._next(slot)
            self._slots[slot] = <int32_t>at
            self._used += 1
        self._live = self._used
        _release(old, False)
        return 0

    cdef int _make_room(self) except -1:
        """Room for one more entry: holes compacted away when they are a third of the arrays, else the
        arrays grow by a quarter (a copy of an entry costs less than the memory a larger step leaves empty).
        A table that peaked and emptied shrinks at its next compaction, as a dict does at its next resize."""
        if self._used < self._capacity:
            return 0
        if self._used - self._live >= self._capacity // 3:  # to half again what is live: a table shrinks
            return self._rebuild(self._live + self._live // 2 + 8)
        if self._capacity >= _MOST_ENTRIES:
            raise MemoryError("U64Map: 2^31 - 1 entries")
        return self._rebuild(min(self._capacity + self._capacity // 4 + 8, _MOST_ENTRIES))

    cdef int _store(self, Py_ssize_t position, object value) except -1:
        """value at position, whose state is _LIVE or _WIDE (the value there is replaced)."""
        if 0 <= value < _INLINE:
            if self._state[position] == _WIDE:
                Py_XDECREF(self._objects[position])
            self._low[position] = <uint64_t>(value & 0xFFFFFFFFFFFFFFFF)
            self._high[position] = <uint16_t>(value >> 64)
            self._state[position] = _LIVE
        elif value < 0:
            raise ValueError(f"U64Map holds non-negative ints, not {value}")
        else:
            if type(value) is not int:
                value = int(value)  # held as it is read back: a bool or an int subclass would not be
            shared = self._interned_value(value)
            if self._objects == NULL:
                self._objects = self._new_objects(self._capacity)
            Py_INCREF(shared)
            if self._state[position] == _WIDE:
                Py_XDECREF(self._objects[position])
            self._objects[position] = <PyObject *>shared
            self._state[position] = _WIDE
        return 0

    cdef object _value(self, Py_ssize_t position):
        if self._state[position] == _WIDE:
            return <object>self._objects[position]
        if self._high[position] == 0:
            return self._low[position]
        return (<object>self._high[position]) * _WORD + self._low[position]

    cdef int _insert(self, uint64_t key, object value) except -1:
        """key, absent, as the newest entry."""
        cdef Py_ssize_t position
        self._make_room()
        position = self._used
        self._keys[position] = key
        self._state[position] = _LIVE
        self._store(position, value)
        self._link(position)
        return 0

    cdef void _link(self, Py_ssize_t position):
        """The entry at position, the newest, filled in: entered in the table."""
        cdef Py_ssize_t slot = self._home(self._keys[position])
        while self._slots[slot] >= 0:  # an empty or a removed slot takes it
            slot = self._next(slot)
        self._slots[slot] = <int32_t>position
        self._used += 1
        self._live += 1

    cdef int _insert_inline(self, uint64_t key, uint64_t low, uint16_t high) except -1:
        """_insert of the value high * 2^64 + low, made of its parts: no int object is made for it."""
        cdef Py_ssize_t position
        self._make_room()
        position = self._used
        self._keys[position] = key
        self._low[position] = low
        self._high[position] = high
        self._state[position] = _LIVE
        self._link(position)
        return 0

    cdef object _remove(self, Py_ssize_t slot):
        """The entry in slot goes; its value."""
        cdef Py_ssize_t position = self._slots[slot]
        value = self._value(position)
        if self._state[position] == _WIDE:
            Py_XDECREF(self._objects[position])
        self._slots[slot] = _REMOVED
        self._state[position] = _HOLE
        self._live -= 1
        if self._live == 0:  # empty: start over, so the front is found at once
            self._rebuild(8)
        return value

    # ---- the dict protocol, as the index uses it ------------------------------------------------------

    def __len__(self):
        return self._live

    def __contains__(self, key):
        return self._find(_key(key)) >= 0

    def get(self, uint64_t key, default=None):
        cdef Py_ssize_t position = self._find(key)
        return default if position < 0 else self._value(position)

    def __getitem__(self, key):
        cdef Py_ssize_t position = self._find(_key(key))
        if position < 0:
            raise KeyError(key)
        return self._value(position)

    def __setitem__(self, key, value):
        self._set(key, value)

    def __delitem__(self, key):
        cdef Py_ssize_t slot = self._slot(_key(key))
        if slot < 0:
            raise KeyError(key)
        self._remove(slot)

    def pop(self, uint64_t key, default=_ABSENT):
        cdef Py_ssize_t slot = self._slot(key)
        if slot < 0:
            if default is _ABSENT:
                raise KeyError(key)
            return default
        return self._remove(slot)

    cdef int _set(self, object key, object value) except -1:
        cdef uint64_t native = _key(key)
        cdef Py_ssize_t position = self._find(native)
        if position >= 0:
            self._store(position, value)  # in place: a key present keeps its age, as in a dict
        else:
            self._insert(native, value)
        return 0

    def update(self, pairs):
        """From an iterable of (key, value) pairs (a dict's update, for what the index passes)."""
        for key, value in pairs:
            self._set(key, value)

    def isdisjoint(self, keys):
        """True when none of keys is here (a dict's keys().isdisjoint)."""
        cdef uint64_t key
        for key in keys:
            if self._find(key) >= 0:
                return False
        return True

    def clear(self):
        cdef _Arrays old = self._held()
        self._allocate(8)  # first: a table that cannot be had leaves this one as it was
        self._objects = NULL
        _release(old, True)
        self._interned.clear()

    def __iter__(self):
        return self.keys()

    def keys(self):
        return self._walk(_KEYS)

    def values(self):
        return self._walk(_VALUES)

    def items(self):
        return self._walk(_ITEMS)

    def _walk(self, int what):
        """The live entries' keys, values or items, oldest first."""
        cdef Py_ssize_t layout = self._layout, position = self._first, live = self._live
        while True:
            if self._layout != layout or self._live != live:
                raise RuntimeError("U64Map changed during iteration")
            if position >= self._used:
                return
            if self._state[position] != _HOLE:
                if what == _KEYS:
                    yield self._keys[position]
                elif what == _VALUES:
                    yield self._value(position)
                else:
                    yield self._keys[position], self._value(position)
            position += 1

    def oldest(self, Py_ssize_t count):
        """The keys of the count oldest entries (the bound's next victims), oldest first."""
        cdef list found = []
        cdef Py_ssize_t position = self._first
        while position < self._used and len(found) < count:
            if self._state[position] != _HOLE:
                found.append(self._keys[position])
            elif len(found) == 0:
                self._first = position + 1  # holes at the front: never scanned again
            position += 1
        return found

    def masks_of(self, chain, dict pending=None):
        """Each key's value, 0 when absent, or'ed with its value in pending when there is one: matching's probe
        of a prompt's blocks, the speculative entries' included (a second pass over an 80K-token prompt's 5,000
        blocks in Python cost about as much as the probe)."""
        cdef Py_ssize_t index = 0, position
        cdef list out = [0] * len(chain)
        cdef bint speculated = bool(pending)
        for key in chain:
            position = self._find(_key(key))
            value = self._value(position) if position >= 0 else 0
            if speculated:
                extra = pending.get(key)
                if extra is not None:
                    value = value | extra
            out[index] = value
            index += 1
        return out

    def __eq__(self, other):
        if isinstance(other, U64Map):
            return list(self.items()) == list(other.items())
        if isinstance(other, dict):
            return dict(self.items()) == other
        return NotImplemented

    def __repr__(self):
        return f"U64Map({dict(self.items())!r})"

    def __sizeof__(self):
        """Its arrays, table and wide values (those interned now, a sample of the rest): what sys.getsizeof
        reports of the index."""
        wide = 0 if self._objects == NULL else self._capacity * sizeof(PyObject *)
        wide += sum(v.__sizeof__() for v in self._interned.values())
        entry = 2 * sizeof(uint64_t) + sizeof(uint16_t) + sizeof(uint8_t)
        return object.__sizeof__(self) + self._capacity * entry + self._size * sizeof(int32_t) + wide


# ---- the index's bulk operations ----------------------------------------------------------------------

cdef enum:
    _COUNT_BITS = 16

COUNT_BITS = _COUNT_BITS  # an owner's entry: kvroute hash << COUNT_BITS | its reference count

cdef uint64_t _hash_key(object block_hash) except? 0xFFFFFFFFFFFFFFFF:
    cdef const unsigned char *data
    cdef Py_ssize_t length, index
    cdef uint64_t key = 0
    if isinstance(block_hash, bytes):
        data = <const unsigned char *>PyBytes_AS_STRING(block_hash)
        length = PyBytes_GET_SIZE(block_hash)
        for index in range(max(0, length - 8), length):
            key = (key << 8) | data[index]
        return key
    return PyLong_AsUnsignedLongLongMask(block_hash)


def u64_key(object block_hash):
    """A block hash as a U64Map key: an int by its two's complement's low 64 bits (vLLM's 64-bit hashes as
    they are), bytes by their last 8, big-endian (the low 64 bits of vLLM's full hashes)."""
    return _hash_key(block_hash)


def u64_keys(object block_hashes):
    """u64_key of each of block_hashes, as a list."""
    return [_hash_key(block_hash) for block_hash in block_hashes]


def enter_new(U64Map holders, U64Map blocks, list own, list keys, object bit):
    """An owner's store of blocks no one holds, under keys it does not use (router/index/holdings.py): in
    holders each of own (kvroute hashes) -> bit, in blocks each of keys -> its own hash << COUNT_BITS | 1 (a
    reference count of 1), both the last block first. False, with nothing entered, when any of own is held
    or any of keys used, or either names one twice: those take the per-block path."""
    cdef Py_ssize_t count = len(own), index
    cdef uint64_t own_hash, bit_low
    cdef uint16_t high, bit_high
    cdef bint narrow
    if len(keys) != count:
        raise ValueError(f"{count} hashes for {len(keys)} keys")
    if not 0 <= bit:
        raise ValueError(f"U64Map holds non-negative ints, not {bit}")
    # Both as C integers once (OverflowError outside [0, 2^64)): each is probed, checked and entered.
    cdef uint64_t *values = <uint64_t *>PyMem_Malloc(4 * count * sizeof(uint64_t) + 1)
    if values == NULL:
        raise MemoryError()
    cdef uint64_t *own_c = values
    cdef uint64_t *keys_c = values + count
    try:
        for index in range(count):
            own_c[index], keys_c[index] = own[index], keys[index]
            holders._prefetch(own_c[index])
            blocks._prefetch(keys_c[index])
        for index in range(count):
            if holders._find(own_c[index]) >= 0:
                return False
        for index in range(count):
            if blocks._find(keys_c[index]) >= 0:
                return False
        if _repeats(own_c, count, values + 2 * count) or _repeats(keys_c, count, values + 3 * count):
            return False
        narrow = bit < _INLINE
        bit_low = <uint64_t>(bit & 0xFFFFFFFFFFFFFFFF) if narrow else 0
        bit_high = <uint16_t>(bit >> 64) if narrow else 0
        # Each is known absent now: entered without a second probe for it.
        for index in range(count - 1, -1, -1):
            if narrow:
                holders._insert_inline(own_c[index], bit_low, bit_high)
            else:
                holders._insert(own_c[index], bit)
        for index in range(count - 1, -1, -1):
            own_hash = own_c[index]
            high = <uint16_t>(own_hash >> (64 - _COUNT_BITS))
            blocks._insert_inline(keys_c[index], (own_hash << _COUNT_BITS) | 1, high)
        return True
    finally:
        PyMem_Free(values)


cdef int _ascending(const void *first, const void *second) noexcept nogil:
    cdef uint64_t a = (<const uint64_t *>first)[0], b = (<const uint64_t *>second)[0]
    return (a > b) - (a < b)


cdef bint _repeats(const uint64_t *values, Py_ssize_t count, uint64_t *scratch) noexcept nogil:
    """Whether any of values comes twice; scratch: room for count values. A store is mostly of some tens of
    blocks, sorted by insertion; a long prompt's thousands by qsort."""
    cdef Py_ssize_t index, at
    cdef uint64_t value
    if count > _INSERTION_SORTED:
        memcpy(scratch, values, count * sizeof(uint64_t))
        qsort(scratch, count, sizeof(uint64_t), _ascending)
        for index in range(1, count):
            if scratch[index] == scratch[index - 1]:
                return True
        return False
    for index in range(count):
        value, at = values[index], index
        while at > 0 and scratch[at - 1] > value:
            scratch[at] = scratch[at - 1]
            at -= 1
        if at > 0 and scratch[at - 1] == value:
            return True
        scratch[at] = value
    return False


def and_runs(list masks):
    """The running AND of masks (each block's holders: the owners holding every block so far) as its runs of
    one value: [(end, value)], where the AND is value from the previous run's end to end, nonzero, ends
    increasing. It only loses bits, so a run ends where it changes. A mask that is the same object as the
    one before (the tables intern wide masks: a large fleet's recur block after block) cannot change it."""
    cdef list runs = []
    cdef Py_ssize_t index, count = len(masks)
    cdef object alive, mask, anded, previous
    if count == 0 or not masks[0]:
        return runs
    alive = previous = masks[0]
    for index in range(1, count):
        mask = masks[index]
        if mask is previous:  # alive is within it already
            continue
        previous = mask
        anded = alive & mask
        if anded != alive:
            runs.append((index, alive))
            if not anded:
                return runs
            alive = anded
    runs.append((count, alive))
    return runs
