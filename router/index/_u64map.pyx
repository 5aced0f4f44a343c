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
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint64_t
from libc.stdlib cimport qsort
from libc.string cimport memcpy, memset

from router.prompt._chain_kernel import chain_hashes

cdef enum:  # a slot holds 0 (empty), -1 (removed) or an entry's position + 1: a fresh table is all zeros
    _EMPTY = 0
    _REMOVED = -1

cdef enum:  # what an iteration yields
    _KEYS = 0
    _VALUES = 1
    _ITEMS = 2

cdef enum:  # what U64Map._own_hash found
    _ABSENT_HERE = 0
    _FOUND = 1
    _WIDE_HERE = 2

cdef enum:  # an entry's state: fresh arrays are all holes
    _HOLE = 0
    _LIVE = 1
    _WIDE = 2  # the value is an int in objects

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
    int __builtin_ctz(unsigned int value) nogil

cdef extern from *:
    """
    #include <sys/mman.h>
    #include <unistd.h>
    /* Zeroed memory. Arrays of a megabyte or more are mapped for themselves: their pages are zeros until
       touched (a new table of millions of slots costs nothing to clear), and released, they go back to the
       system at once. From malloc, the arrays a table outgrew stayed resident in the heap (in glibc, freed
       blocks below its mmap threshold, which rises to 32 MiB as large blocks are freed, are kept for reuse). */
    #define U64MAP_MAPPED ((size_t)1 << 20)
    static void *u64map_alloc(size_t bytes) {
        if (bytes < U64MAP_MAPPED)
            return PyMem_Calloc(1, bytes);
        void *mapped = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mapped == MAP_FAILED)
            return NULL;
        /* In 4 KiB pages, even where the kernel would give 2 MiB ones (transparent huge pages "always"): a
           table moves to larger arrays a slice per batch, but the first slice writes the new slots all over
           them, and in huge pages that faults in the whole array at once (tens of milliseconds of page
           zeroing on the event loop, scripts/measure_index_growth_stalls.py); in small pages the zeroing
           follows the move. Lookups miss the TLB more: up to a tenth slower here (docs/benchmarks.md). */
#ifdef MADV_NOHUGEPAGE
        madvise(mapped, bytes, MADV_NOHUGEPAGE);
#endif
        return mapped;
    }
    /* The pages wholly within bytes [start, end) of an array of bytes given back to the system, where it was
       mapped for itself: they read as zeros after (entries of state 0, holes), at no memory. */
    static void u64map_forget(void *memory, size_t bytes, size_t start, size_t end) {
        if (memory == NULL || bytes < U64MAP_MAPPED)
            return;
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        start = (start + page - 1) / page * page;
        end = end / page * page;
        if (end > start)
            madvise((char *)memory + start, end - start, MADV_DONTNEED);
    }
    /* Bytes [start, end) of an array of bytes given their pages now, where it was mapped for itself, their
       contents kept: a table's new slots, before a move writes them all over. Written at random, each write
       to a page not yet touched cost a fault of its own: up to 3,300 in one 32-block store (3.5 ms held
       on the event loop) at a move's start. Returns where the pages given end (bytes: all of them). */
    static size_t u64map_populate(void *memory, size_t bytes, size_t start, size_t end) {
        if (memory == NULL || bytes < U64MAP_MAPPED || start >= bytes)
            return bytes;
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        start = start / page * page;
        end = (end + page - 1) / page * page;
        if (end > bytes)
            end = bytes;
#ifdef MADV_POPULATE_WRITE
        if (madvise((char *)memory + start, end - start, MADV_POPULATE_WRITE) == 0)
            return end;
#endif
        /* Before Linux 5.14: a write to each page that leaves its value, one fault each. */
        for (size_t at = start; at < end; at += page)
            __atomic_fetch_or((volatile char *)memory + at, 0, __ATOMIC_RELAXED);
        return end;
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
    void u64map_forget(void *memory, size_t bytes, size_t start, size_t end)
    size_t u64map_populate(void *memory, size_t bytes, size_t start, size_t end)
    void u64map_release(void *memory, size_t bytes)


cdef object _ABSENT = object()
cdef object _WORD = 1 << 64
cdef object _INLINE = 1 << 80
cdef Py_ssize_t _MOST_ENTRIES = 0x7FFFFFFE  # slots hold position + 1 in an int32
cdef Py_ssize_t _INSERTION_SORTED = 64  # stores of at most this many blocks: repeats found by insertion sort
# Entries ahead whose home slots a move starts loading: a table of millions misses the cache at each.
cdef Py_ssize_t _MOVE_AHEAD = 16
cdef Py_ssize_t _PROBE_AHEAD = 16  # masks_of's keys between a home slot's load and its probe
cdef Py_ssize_t _INTERNED_MOST = 4096  # distinct wide values shared at once; past it, interning starts over
# Entries moved to a table's new arrays per insert while it moves: a move of 10M entries at once held the event
# loop for a second; in steps, an insert costs a few microseconds more for 1/64 of the inserts that follow.
MOVE_STEP = 64
# Bytes of a table's new slots given their pages per insert before its move starts: 4 pages, ~10 µs. A move
# into a table of 4M entries waits ~1,600 inserts for its 26 MB of slots, of the 1.3M inserts it has room for.
cdef Py_ssize_t _WARMED_PER_INSERT = 16384
cdef Py_ssize_t _FORGOTTEN_AT_ONCE = 1 << 16  # entries moved between two givings back of their memory
cdef Py_ssize_t _HOLES_PER_MOVE = 16  # holes skipped in a step count this much less than entries moved
# A full table grows by 1 / _GROWTH_DIVISOR. Its entries are moved and their new pages zeroed g / (g - 1) times
# over its growth, g the factor: 5x at a quarter (the kernel's zeroing and the moves were a quarter of ingest's
# CPU into 10M blocks), 3x at a half. Untouched pages of mapped arrays cost nothing; the slots, touched all
# over, hold up to 10 bytes a live entry instead of 8.4 just after a growth.
cdef Py_ssize_t _GROWTH_DIVISOR = 2


# A table's arrays: its entries in insertion order, and the slots that find them by key.
cdef struct _Arrays:
    uint64_t *keys
    uint64_t *low
    uint16_t *high
    uint8_t *state
    int32_t *slots
    PyObject **objects  # NULL until a wide value came
    Py_ssize_t capacity  # of the entries arrays
    Py_ssize_t size  # of the table of slots
    Py_ssize_t used  # entries in them, holes included
    Py_ssize_t live


cdef int _allocate(_Arrays *made, Py_ssize_t capacity) except -1:
    """Zeroed arrays for capacity entries (all holes) and a table of empty slots, at least 40% of them staying
    empty (a probe for a key not there, most of the index's, then looks at 3.6 slots on average, against 8.5
    at 25%). MemoryError, with made untouched, when they cannot be had."""
    cdef Py_ssize_t size = capacity + capacity * 2 // 3 + 1
    cdef _Arrays arrays
    memset(&arrays, 0, sizeof(_Arrays))
    arrays.capacity, arrays.size = capacity, size
    arrays.keys = <uint64_t *>u64map_alloc(capacity * sizeof(uint64_t))
    arrays.low = <uint64_t *>u64map_alloc(capacity * sizeof(uint64_t))
    arrays.high = <uint16_t *>u64map_alloc(capacity * sizeof(uint16_t))
    arrays.state = <uint8_t *>u64map_alloc(capacity * sizeof(uint8_t))
    arrays.slots = <int32_t *>u64map_alloc(size * sizeof(int32_t))
    if not (arrays.keys and arrays.low and arrays.high and arrays.state and arrays.slots):
        _release(&arrays)
        raise MemoryError()
    made[0] = arrays
    return 0


cdef int _add_objects(_Arrays *arrays) except -1:
    """Room in arrays for wide values, made when the first comes."""
    if arrays.objects == NULL:
        arrays.objects = <PyObject **>u64map_alloc(arrays.capacity * sizeof(PyObject *))
        if arrays.objects == NULL:
            raise MemoryError()
    return 0


cdef void _release(_Arrays *arrays):
    """Free arrays, and the references of the wide values still in them; arrays is empty after."""
    cdef Py_ssize_t position
    if arrays.objects != NULL:
        for position in range(arrays.used):
            if arrays.state[position] == _WIDE:
                Py_XDECREF(arrays.objects[position])
        u64map_release(arrays.objects, arrays.capacity * sizeof(PyObject *))
    u64map_release(arrays.keys, arrays.capacity * sizeof(uint64_t))
    u64map_release(arrays.low, arrays.capacity * sizeof(uint64_t))
    u64map_release(arrays.high, arrays.capacity * sizeof(uint16_t))
    u64map_release(arrays.state, arrays.capacity * sizeof(uint8_t))
    u64map_release(arrays.slots, arrays.size * sizeof(int32_t))
    memset(arrays, 0, sizeof(_Arrays))


cdef void _forget(_Arrays *arrays, Py_ssize_t start, Py_ssize_t end) noexcept:
    """The memory of entries start to end (moved on: holes now) given back, where their arrays allow."""
    _forget_part(arrays.keys, sizeof(uint64_t), arrays.capacity, start, end)
    _forget_part(arrays.low, sizeof(uint64_t), arrays.capacity, start, end)
    _forget_part(arrays.high, sizeof(uint16_t), arrays.capacity, start, end)
    _forget_part(arrays.state, sizeof(uint8_t), arrays.capacity, start, end)
    _forget_part(arrays.objects, sizeof(PyObject *), arrays.capacity, start, end)


cdef inline void _forget_part(
    void *memory, size_t width, Py_ssize_t capacity, Py_ssize_t start, Py_ssize_t end
) noexcept:
    u64map_forget(memory, capacity * width, start * width, end * width)


cdef inline Py_ssize_t _home(const _Arrays *arrays, uint64_t key) noexcept nogil:
    return u64map_home(key, arrays.size)


cdef Py_ssize_t _probe(const _Arrays *arrays, uint64_t key, Py_ssize_t since) noexcept nogil:
    """The slot of key's entry in arrays, or -1; entries before position since count as gone (moved on)."""
    cdef Py_ssize_t slot = _home(arrays, key)
    cdef int32_t held
    while True:
        held = arrays.slots[slot]
        if held == _EMPTY:
            return -1
        if held > since and arrays.keys[held - 1] == key:  # a moved entry's memory may be given back
            return slot
        slot += 1
        if slot == arrays.size:
            slot = 0


cdef void _link(_Arrays *arrays, Py_ssize_t position) noexcept nogil:
    """The entry at position, filled in, entered in the slots: an empty or a removed slot takes it."""
    cdef Py_ssize_t slot = _home(arrays, arrays.keys[position])
    while arrays.slots[slot] > 0:
        slot += 1
        if slot == arrays.size:
            slot = 0
    arrays.slots[slot] = <int32_t>(position + 1)
    arrays.live += 1


cdef object _value(const _Arrays *arrays, Py_ssize_t position):
    if arrays.state[position] == _WIDE:
        return <object>arrays.objects[position]
    if arrays.high[position] == 0:
        return arrays.low[position]
    return (<object>arrays.high[position]) * _WORD + arrays.low[position]


cdef inline Py_ssize_t _entry(const _Arrays *arrays, Py_ssize_t slot) noexcept nogil:
    return arrays.slots[slot] - 1


cdef class U64Map:
    """A dict from ints in [0, 2^64) to non-negative ints, in insertion order.

    Outgrowing its arrays (or holding a third of holes), it moves to new ones a step at a time, a few entries
    per insert, while lookups see both: the oldest entries moved first (in the new arrays' front), then those
    still to move (in the old arrays), then the ones inserted meanwhile (in the new arrays, after room kept for
    the rest)."""

    cdef _Arrays _now
    cdef _Arrays _old  # a move's source, its entries from _old_at on still there; keys NULL when none
    cdef Py_ssize_t _old_at
    cdef Py_ssize_t _old_kept  # the old arrays' entries from it on still have their memory
    cdef Py_ssize_t _moved  # _now's entries before it came from _old
    cdef Py_ssize_t _reserved  # _now's entries from it on came while moving
    cdef Py_ssize_t _first  # no live entry in _now before it: evicting from the front skips what it removed
    cdef Py_ssize_t _layout  # changes whenever entries move: an iteration in progress stops
    cdef Py_ssize_t _move_step
    cdef size_t _warmed  # bytes of _now's slots given their pages: a move starts once all are
    cdef dict _interned
    # The wide value interned last, and what it was interned as: a store's blocks all take one owner's mask.
    cdef object _last_given, _last_shared

    def __cinit__(self, Py_ssize_t move_step=MOVE_STEP):
        if move_step < 1:
            raise ValueError(f"a move of at least one entry per insert, not {move_step}")
        self._move_step = move_step
        self._interned = {}
        self._last_given = self._last_shared = None
        _allocate(&self._now, 8)

    def __dealloc__(self):
        _release(&self._now)
        _release(&self._old)

    @property
    def moving(self):
        """Entries still to move to the new arrays (0: none are moving)."""
        return self._old.live

    cdef inline bint _in_move(self) noexcept nogil:
        return self._old.keys != NULL

    cdef object _interned_value(self, object value):
        # The same object again, as each block of a store passes its owner's mask: no lookup, which hashes
        # all of a wide int (250 bytes in a fleet of 2,000; a third of a 32-block store's time).
        if value is self._last_given:
            return self._last_shared
        found = self._interned.get(value)
        if found is None:
            if len(self._interned) >= _INTERNED_MOST:
                self._interned.clear()  # those in use stay alive where they are held
            self._interned[value] = found = value
        self._last_given, self._last_shared = value, found
        return found

    cdef inline void _prefetch(self, uint64_t key) noexcept nogil:
        """Start loading key's home slot: a batch's probes into a table of millions then miss the cache
        together, not one after another."""
        __builtin_prefetch(&self._now.slots[_home(&self._now, key)])

    cdef inline void _prefetch_entry(self, uint64_t key) noexcept nogil:
        """Start loading the entry key's home slot names (its key and value), once _prefetch loaded that slot:
        most keys probed are at home or absent."""
        cdef int32_t held = self._now.slots[_home(&self._now, key)]
        if held > 0:
            __builtin_prefetch(&self._now.keys[held - 1])
            __builtin_prefetch(&self._now.low[held - 1])
            __builtin_prefetch(&self._now.state[held - 1])

    cdef Py_ssize_t _slot(self, uint64_t key, _Arrays **arrays) noexcept:
        """The slot of key's entry, and in arrays the arrays holding it; -1 when it is not here."""
        cdef Py_ssize_t slot = _probe(&self._now, key, 0)
        arrays[0] = &self._now
        if slot < 0 and self._in_move():
            arrays[0] = &self._old
            slot = _probe(&self._old, key, self._old_at)
        return slot

    cdef bint _holds(self, uint64_t key) noexcept:
        cdef _Arrays *arrays
        return self._slot(key, &arrays) >= 0

    cdef int _own_hash(self, uint64_t key, uint64_t *own) noexcept:
        """In own, key's packed entry of a blocks table (router/index/holdings.py) shifted past its count: the
        kvroute hash. _FOUND; _ABSENT_HERE; _WIDE_HERE when its value is wide (no packed entry is)."""
        cdef _Arrays *arrays
        cdef Py_ssize_t slot = self._slot(key, &arrays), position
        if slot < 0:
            return _ABSENT_HERE
        position = _entry(arrays, slot)
        if arrays.state[position] == _WIDE:
            return _WIDE_HERE
        own[0] = (<uint64_t>arrays.high[position] << (64 - _COUNT_BITS)) | (arrays.low[position] >> _COUNT_BITS)
        return _FOUND

    cdef object _get(self, uint64_t key, object default):
        cdef _Arrays *arrays
        cdef Py_ssize_t slot = self._slot(key, &arrays)
        return default if slot < 0 else _value(arrays, _entry(arrays, slot))

    cdef int _store(self, _Arrays *arrays, Py_ssize_t position, object value) except -1:
        """value at position, whose state is _LIVE or _WIDE (the value there is replaced)."""
        if 0 <= value < _INLINE:
            if arrays.state[position] == _WIDE:
                Py_XDECREF(arrays.objects[position])
            arrays.low[position] = <uint64_t>(value & 0xFFFFFFFFFFFFFFFF)
            arrays.high[position] = <uint16_t>(value >> 64)
            arrays.state[position] = _LIVE
        elif value < 0:
            raise ValueError(f"U64Map holds non-negative ints, not {value}")
        else:
            if type(value) is not int:
                value = int(value)  # held as it is read back: a bool or an int subclass would not be
            shared = self._interned_value(value)
            _add_objects(arrays)
            Py_INCREF(shared)
            if arrays.state[position] == _WIDE:
                Py_XDECREF(arrays.objects[position])
            arrays.objects[position] = <PyObject *>shared
            arrays.state[position] = _WIDE
        return 0

    # ---- room for entries, and moves ---------------------------------------------------------------------

    cdef int _make_room(self) except -1:
        """Room for one more entry, moving a step meanwhile. Full, a table moves to new arrays: holes
        compacted away when they are a third of the arrays, else arrays half again as large. A table that
        peaked and emptied shrinks at its next compaction, as a dict does at its next resize."""
        cdef Py_ssize_t capacity, live
        if self._in_move():
            self._move_warmed()
        if self._now.used < self._now.capacity:
            return 0
        while self._in_move():  # full before the move ended (inserts outran it): the rest at once
            self._move(self._old.used)
        live = self._now.live
        capacity = self._now.capacity
        if self._now.used - live >= capacity // 3:  # to half again what is live: a table shrinks
            capacity = live + live // 2 + 8
        elif capacity >= _MOST_ENTRIES:
            raise MemoryError("U64Map: 2^31 - 2 entries")
        else:
            capacity = min(capacity + capacity // _GROWTH_DIVISOR + 8, _MOST_ENTRIES)
        self._start_move(capacity)
        self._move_warmed()
        return 0

    cdef int _move_warmed(self) except -1:
        """A step of the move, once the new slots have their pages; until then, the next of those pages."""
        cdef size_t slots_bytes = self._now.size * sizeof(int32_t)
        if self._warmed < slots_bytes:
            self._warmed = u64map_populate(
                self._now.slots, slots_bytes, self._warmed, self._warmed + _WARMED_PER_INSERT
            )
            if self._warmed < slots_bytes:
                return 0
        return self._move(self._move_step)

    cdef int _start_move(self, Py_ssize_t capacity) except -1:
        """New arrays of capacity in place of those held, which are left to move, in order, from the front;
        as it was when they cannot be had."""
        cdef _Arrays made
        _allocate(&made, capacity)
        self._old, self._now = self._now, made
        self._old_at = self._old_kept = self._moved = self._first = 0
        self._reserved = self._now.used = self._old.live  # what moves fits before what comes meanwhile
        self._warmed = 0
        self._layout += 1
        return 0

    cdef int _move(self, Py_ssize_t budget) except -1:
        """Up to budget of the old arrays' entries moved to the new ones (holes skipped, each costing a
        fraction of a move); the old arrays released once the last has moved."""
        cdef _Arrays *old = &self._old
        cdef _Arrays *now = &self._now
        cdef Py_ssize_t position, at, spent = 0
        budget *= _HOLES_PER_MOVE
        while self._old_at < old.used and spent < budget:
            position = self._old_at
            if position + _MOVE_AHEAD < old.used:  # the new slots are missed ahead, together
                __builtin_prefetch(&now.slots[_home(now, old.keys[position + _MOVE_AHEAD])])
            if old.state[position] == _HOLE:
                self._old_at += 1
                spent += 1
                continue
            if old.state[position] == _WIDE:
                _add_objects(now)  # first: a MemoryError leaves the entry where it is
            self._old_at += 1
            spent += _HOLES_PER_MOVE
            at = self._moved
            self._moved += 1
            now.keys[at], now.low[at], now.high[at] = old.keys[position], old.low[position], old.high[position]
            now.state[at] = old.state[position]
            if old.state[position] == _WIDE:
                now.objects[at] = old.objects[position]  # the reference moves with it
            old.state[position] = _HOLE
            old.live -= 1
            _link(now, at)
        self._layout += 1
        if self._old_at == old.used:
            _release(old)  # holes alone are left: their references went with the entries
        elif self._old_at - self._old_kept >= _FORGOTTEN_AT_ONCE:
            # What moved gives its memory back as the move goes: a table moving holds its entries once (its
            # old slots aside), as the bound and the memory figures assume.
            _forget(old, self._old_kept, self._old_at)
            self._old_kept = self._old_at
        return 0

    cdef int _start_over(self) except -1:
        """Empty arrays, the smallest, in place of what is held (nothing live): the front is found at once."""
        cdef _Arrays made
        _allocate(&made, 8)
        _release(&self._now)
        _release(&self._old)
        self._now = made
        self._first = 0
        self._layout += 1
        return 0

    # ---- entries in and out ------------------------------------------------------------------------------

    cdef Py_ssize_t _new_entry(self, uint64_t key) except -1:
        """The position of a new entry for key, absent, as the newest; its state and value for the caller."""
        cdef Py_ssize_t position
        self._make_room()
        position = self._now.used
        self._now.keys[position] = key
        self._now.used += 1
        return position

    cdef int _insert(self, uint64_t key, object value) except -1:
        """key, absent, as the newest entry."""
        cdef Py_ssize_t position = self._new_entry(key)
        self._now.state[position] = _LIVE
        try:
            self._store(&self._now, position, value)
        except BaseException:
            self._now.state[position] = _HOLE  # refused (a negative value): a hole, never linked
            raise
        _link(&self._now, position)
        return 0

    cdef int _insert_inline(self, uint64_t key, uint64_t low, uint16_t high) except -1:
        """_insert of the value high * 2^64 + low, made of its parts: no int object is made for it."""
        cdef Py_ssize_t position = self._new_entry(key)
        self._now.low[position] = low
        self._now.high[position] = high
        self._now.state[position] = _LIVE
        _link(&self._now, position)
        return 0

    cdef object _remove(self, _Arrays *arrays, Py_ssize_t slot):
        """The entry in slot of arrays goes; its value."""
        cdef Py_ssize_t position = _entry(arrays, slot)
        value = _value(arrays, position)
        if arrays.state[position] == _WIDE:
            Py_XDECREF(arrays.objects[position])
        arrays.slots[slot] = _REMOVED
        arrays.state[position] = _HOLE
        arrays.live -= 1
        if self._now.live + self._old.live == 0:
            self._start_over()
        return value

    cdef int _set(self, object key, object value) except -1:
        cdef uint64_t native = _key(key)
        cdef _Arrays *arrays
        cdef Py_ssize_t slot = self._slot(native, &arrays)
        if slot >= 0:
            self._store(arrays, _entry(arrays, slot), value)  # in place: a key present keeps its age
        else:
            self._insert(native, value)
        return 0

    # ---- the dict protocol, as the index uses it ------------------------------------------------------

    def __len__(self):
        return self._now.live + self._old.live

    def __contains__(self, key):
        return self._holds(_key(key))

    def get(self, uint64_t key, default=None):
        return self._get(key, default)

    def __getitem__(self, key):
        found = self._get(_key(key), _ABSENT)
        if found is _ABSENT:
            raise KeyError(key)
        return found

    def __setitem__(self, key, value):
        self._set(key, value)

    def __delitem__(self, key):
        cdef _Arrays *arrays
        cdef Py_ssize_t slot = self._slot(_key(key), &arrays)
        if slot < 0:
            raise KeyError(key)
        self._remove(arrays, slot)

    def pop(self, uint64_t key, default=_ABSENT):
        cdef _Arrays *arrays
        cdef Py_ssize_t slot = self._slot(key, &arrays)
        if slot < 0:
            if default is _ABSENT:
                raise KeyError(key)
            return default
        return self._remove(arrays, slot)

    def update(self, pairs):
        """From an iterable of (key, value) pairs (a dict's update, for what the index passes)."""
        for key, value in pairs:
            self._set(key, value)

    def isdisjoint(self, keys):
        """True when none of keys is here (a dict's keys().isdisjoint)."""
        cdef uint64_t key
        for key in keys:
            if self._holds(key):
                return False
        return True

    def clear(self):
        self._start_over()
        self._interned.clear()

    def __iter__(self):
        return self.keys()

    def keys(self):
        return self._walk(_KEYS)

    def values(self):
        return self._walk(_VALUES)

    def items(self):
        return self._walk(_ITEMS)

    cdef _Arrays *_part(self, int part, Py_ssize_t *start, Py_ssize_t *end) noexcept:
        """The entries in order are three parts, each a range of arrays: those moved, those still to move,
        those inserted meanwhile; outside a move, the first alone (the others are empty)."""
        if part == 0:
            start[0], end[0] = self._first, (self._moved if self._in_move() else self._now.used)
            return &self._now
        if part == 1:
            start[0], end[0] = self._old_at, self._old.used
            return &self._old
        start[0], end[0] = self._reserved, (self._now.used if self._in_move() else self._reserved)
        return &self._now

    def _walk(self, int what):
        """The live entries' keys, values or items, oldest first."""
        cdef Py_ssize_t layout = self._layout, live = len(self), position, end
        cdef _Arrays *arrays
        cdef int part
        for part in range(3):
            arrays = self._part(part, &position, &end)
            while position < end:
                if arrays.state[position] != _HOLE:
                    if what == _KEYS:
                        yield arrays.keys[position]
                    elif what == _VALUES:
                        yield _value(arrays, position)
                    else:
                        yield arrays.keys[position], _value(arrays, position)
                    if self._layout != layout or len(self) != live:
                        raise RuntimeError("U64Map changed during iteration")
                position += 1

    def oldest(self, Py_ssize_t count):
        """The keys of the count oldest entries (the bound's next victims), oldest first."""
        cdef list found = []
        cdef Py_ssize_t position, end
        cdef _Arrays *arrays
        cdef int part
        for part in range(3):
            arrays = self._part(part, &position, &end)
            while position < end and len(found) < count:
                if arrays.state[position] != _HOLE:
                    found.append(arrays.keys[position])
                elif part == 0 and len(found) == 0:
                    self._first = position + 1  # holes at the front: never scanned again
                position += 1
        return found

    def masks_of(self, chain, dict pending=None):
        """Each key's value, 0 when absent, or'ed with its value in pending when there is one: matching's probe
        of a prompt's blocks, the speculative entries' included (a second pass over an 80K-token prompt's 5,000
        blocks in Python cost about as much as the probe). The probes are pipelined: a key's home slot is
        loaded _PROBE_AHEAD keys before its probe, and the entry that slot names half as many before, so a
        table of millions misses the cache for many keys at once, not for one after another."""
        cdef Py_ssize_t n = len(chain), index
        cdef uint64_t *keys = <uint64_t *>PyMem_Malloc((n if n > 0 else 1) * sizeof(uint64_t))
        cdef list out = [0] * n
        cdef bint speculated = bool(pending)
        if keys == NULL:
            raise MemoryError()
        try:
            index = 0
            for key in chain:
                if index == n:
                    raise ValueError("chain gave more keys than its length")
                keys[index] = _key(key)
                index += 1
            if index != n:
                raise ValueError("chain gave fewer keys than its length")
            for index in range(n):
                if index + _PROBE_AHEAD < n:
                    self._prefetch(keys[index + _PROBE_AHEAD])
                if index + _PROBE_AHEAD // 2 < n:
                    self._prefetch_entry(keys[index + _PROBE_AHEAD // 2])
                value = self._get(keys[index], 0)
                if speculated:
                    extra = pending.get(chain[index])
                    if extra is not None:
                        value = value | extra
                out[index] = value
        finally:
            PyMem_Free(keys)
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
        """Its arrays, tables and wide values (those interned now, a sample of the rest), a move's both: what
        sys.getsizeof reports of the index."""
        wide = sum(v.__sizeof__() for v in self._interned.values())
        return object.__sizeof__(self) + _footprint(&self._now) + _footprint(&self._old) + wide


cdef Py_ssize_t _footprint(const _Arrays *arrays) noexcept:
    cdef Py_ssize_t entry = 2 * sizeof(uint64_t) + sizeof(uint16_t) + sizeof(uint8_t)
    if arrays.keys == NULL:
        return 0
    if arrays.objects != NULL:
        entry += sizeof(PyObject *)
    return arrays.capacity * entry + arrays.size * sizeof(int32_t)


cdef inline uint64_t _key(object key) except? 0:
    """key as a C integer: OverflowError outside [0, 2^64). Special methods take their key as an object, as
    Cython would otherwise pass a typed one through the sequence protocol's ssize_t."""
    return key


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


cdef enum:
    _ON_STACK = 64  # stores of at most this many blocks keep their blocks' C copies on the stack


def enter_new(U64Map holders, U64Map blocks, list own, list keys, object bit):
    """An owner's store of blocks no one holds, under keys it does not use (router/index/holdings.py): in
    holders each of own (kvroute hashes) -> bit, in blocks each of keys -> its own hash << COUNT_BITS | 1 (a
    reference count of 1), both the last block first. False, with nothing entered, when any of own is held
    or any of keys used, or either names one twice: those take the per-block path."""
    if len(keys) != len(own):
        raise ValueError(f"{len(own)} hashes for {len(keys)} keys")
    return _enter_lists(holders, blocks, own, keys, False, bit) == 1


def store_along(
    U64Map holders, U64Map blocks, tuple tables, U64Map pool_table, object event, Py_ssize_t block_size,
    object bit
):
    """The store every engine step sends, in one call: a BlockStored event's blocks, one block_size's worth of
    tokens each (no adapter, no extra keys but None), hashed along their parent's kvroute chain (the parent
    looked for in tables, an owner's by tier, then in pool_table) and entered as enter_new enters them. How
    many were entered; 0, with nothing changed, for any other store (a parent held nowhere, a block held or a
    key used already, a token id past 32 bits), which the caller's general path takes and counts."""
    hashes, tokens, extra = event.block_hashes, event.token_ids, event.extra_keys
    cdef Py_ssize_t count = len(hashes)
    cdef uint64_t parent = 0, key  # parent 0: block_hashing.ROOT, the root of a chain under no adapter
    if (
        count == 0
        or event.block_size != block_size
        or len(tokens) != count * block_size
        or event.lora_name is not None
        or (extra is not None and (len(extra) != count or extra.count(None) != count))
    ):
        return 0
    cdef int found = _ABSENT_HERE
    parent_hash = event.parent_block_hash
    if parent_hash is not None:
        key = _hash_key(parent_hash)
        for table in tables:
            found = (<U64Map?>table)._own_hash(key, &parent)
            if found != _ABSENT_HERE:
                break
        else:
            found = pool_table._own_hash(key, &parent)
        if found != _FOUND:
            return 0
    try:
        own = chain_hashes(tokens, block_size, parent)
    except OverflowError:
        return 0
    return count if _enter_lists(holders, blocks, own, hashes, True, bit) == 1 else 0


cdef int _enter_lists(
    U64Map holders, U64Map blocks, object own, object keys, bint vllm_hashes, object bit
) except -1:
    """_enter of own (kvroute hashes) and keys, each made a C integer once: keys as they are (OverflowError
    outside [0, 2^64), as own), or with vllm_hashes, vLLM's block hashes keyed as u64_key keys them. Their
    copies are kept on the stack up to _ON_STACK blocks."""
    cdef Py_ssize_t count = len(own), index
    cdef uint64_t on_stack[4 * _ON_STACK]
    cdef uint64_t *values = on_stack
    if count > _ON_STACK:
        values = <uint64_t *>PyMem_Malloc(4 * count * sizeof(uint64_t))
        if values == NULL:
            raise MemoryError()
    try:
        for index in range(count):
            values[index] = own[index]
            values[count + index] = _hash_key(keys[index]) if vllm_hashes else keys[index]
        return _enter(holders, blocks, values, count, bit)
    finally:
        if values != on_stack:
            PyMem_Free(values)


cdef int _enter(U64Map holders, U64Map blocks, uint64_t *values, Py_ssize_t count, object bit) except -1:
    """enter_new of values: count kvroute hashes, then as many keys, then room for twice as many. 1 when
    entered, 0 when not."""
    cdef uint64_t *own = values
    cdef uint64_t *keys = values + count
    cdef Py_ssize_t index
    cdef uint64_t own_hash, bit_low
    cdef uint16_t high, bit_high
    cdef bint narrow
    if not 0 <= bit:
        raise ValueError(f"U64Map holds non-negative ints, not {bit}")
    for index in range(count):
        holders._prefetch(own[index])
        blocks._prefetch(keys[index])
    for index in range(count):
        if holders._holds(own[index]):
            return 0
    for index in range(count):
        if blocks._holds(keys[index]):
            return 0
    if _repeats(own, count, values + 2 * count) or _repeats(keys, count, values + 3 * count):
        return 0
    narrow = bit < _INLINE
    bit_low = <uint64_t>(bit & 0xFFFFFFFFFFFFFFFF) if narrow else 0
    bit_high = <uint16_t>(bit >> 64) if narrow else 0
    # Each is known absent now: entered without a second probe for it.
    for index in range(count - 1, -1, -1):
        if narrow:
            holders._insert_inline(own[index], bit_low, bit_high)
        else:
            holders._insert(own[index], bit)
    for index in range(count - 1, -1, -1):
        own_hash = own[index]
        high = <uint16_t>(own_hash >> (64 - _COUNT_BITS))
        blocks._insert_inline(keys[index], (own_hash << _COUNT_BITS) | 1, high)
    return 1


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


def match_lengths(list runs):
    """Each owner in a prompt's runs (and_runs): the blocks before it leaves, by its bit's position, lowest
    position first (the order owners are credited in). An owner leaves where its bit is in a run's value and
    not in the next's; the set bits of 1,000-bit masks are found a byte at a time in C."""
    cdef Py_ssize_t count = len(runs), index, position, at
    cdef dict ends = {}
    if count == 0:
        return ends
    cdef Py_ssize_t width = (<object>runs[0][1]).bit_length()  # every later run's value is within the first's
    cdef long long* end_at = <long long*>PyMem_Malloc(max(width, 1) * sizeof(long long))
    if end_at == NULL:
        raise MemoryError()
    cdef const uint8_t* data
    cdef uint8_t byte
    cdef bytes left_bytes
    try:
        for position in range(width):
            end_at[position] = -1
        for index in range(count):
            end, value = runs[index]
            following = runs[index + 1][1] if index + 1 < count else 0
            left = value ^ following
            left_bytes = left.to_bytes((left.bit_length() + 7) // 8, "little")
            data = <const uint8_t*>PyBytes_AS_STRING(left_bytes)
            for at in range(PyBytes_GET_SIZE(left_bytes)):
                byte = data[at]
                while byte:
                    position = at * 8 + __builtin_ctz(byte)
                    if position < width:
                        end_at[position] = end
                    byte &= byte - 1
        for position in range(width):
            if end_at[position] >= 0:
                ends[position] = end_at[position]
    finally:
        PyMem_Free(end_at)
    return ends


def matches_on_gpu(dict ends, dict owner_at, object tier_match):
    """Each owner's match (ends: its length by the owner's bit position, lowest first) credited as GPU blocks
    to its instance (owner_at: the owner by position, its instance's name first), the longest of an
    instance's owners kept: {name: tier_match(gpu=length)}, one match object per length, which most owners
    of a large fleet share."""
    cdef dict matches = {}, by_length = {}
    for at, end in ends.items():
        found = by_length.get(end)
        if found is None:
            found = by_length[end] = tier_match(gpu=end)
        name = owner_at[at][0]
        known = matches.get(name)
        if known is None or end > known.gpu + known.cpu + known.pool:
            matches[name] = found
    return matches
