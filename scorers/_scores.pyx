# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""What a policy does with its scorers' lists of scores, in C: normalizing, weighing and summing them, and
finding the best; and what the scorers read of every candidate, from its C fields
(scorers/_candidate_state.pyx): its load, its name, its share of KV memory in use. Each was a pass of Python
over every candidate; over 1,000 candidates and four scorers they took a fifth of a decision. The arithmetic
is Python's, operation for operation, so the scores are the same floats (integers below 2^53, token counts,
convert exactly, as Python converts them).
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.math cimport INFINITY, isfinite

from scorers._buffers cimport doubles
from scorers._candidate_state cimport CandidateState, state_of


def weighted_sum(list score_lists, list weights):
    """Each candidate's sum of weights[k] * score_lists[k][i], added in k's order from 0.0 (as a policy adds
    its scorers' lists): one list of totals, not one per scorer."""
    cdef Py_ssize_t count = len(score_lists), n = len(score_lists[0]) if score_lists else 0, k, i
    cdef list scores
    cdef double weight
    if len(weights) != count:
        raise ValueError(f"{len(weights)} weights for {count} lists of scores")
    cdef double *totals = doubles(n)
    try:
        for i in range(n):
            totals[i] = 0.0
        for k in range(count):
            scores, weight = score_lists[k], weights[k]
            if len(scores) != n:
                raise ValueError(f"{len(scores)} scores for {n} candidates")
            for i in range(n):
                totals[i] = totals[i] + weight * <double>scores[i]
        return [totals[i] for i in range(n)]
    finally:
        PyMem_Free(totals)


def lower_is_better(list values):
    """llm-d's normalization: (max - v) / (max - min) over the known values; equal ones all score 1; an
    unknown value (None) scores 0."""
    cdef Py_ssize_t n = len(values), i
    cdef double *room = doubles(2 * n)
    cdef char *known = <char *>PyMem_Malloc(n if n > 0 else 1)
    try:
        if known == NULL:
            raise MemoryError()
        for i in range(n):
            item = values[i]
            known[i] = item is not None
            room[i] = 0.0
            if known[i]:
                room[i] = item
        _lower_is_better(room, known, n, room + n)
        return [room[n + i] for i in range(n)]
    finally:
        PyMem_Free(room)
        PyMem_Free(known)


def spread_scores(object candidates, dict counts, double now):
    """The spread scorer's scores (scorers/spread.py): halfway between lower_is_better of each candidate's
    placements (its DecayingCount in counts, by name, at now; 0.0 for one with none) and lower_is_better of
    its share of KV memory in use (memory_share), computed in C with one list made: the four lists between
    them were a tenth of choosing over 1,000 candidates."""
    cdef Py_ssize_t n = len(candidates), i = 0
    cdef CandidateState state
    cdef double *room = doubles(4 * n)
    cdef double *placed = room
    cdef double *shares = room + n
    cdef char *known = <char *>PyMem_Malloc(2 * n if n > 0 else 1)
    try:
        if known == NULL:
            raise MemoryError()
        for candidate in candidates:
            if i == n:
                raise ValueError("candidates gave more than their length")
            state = state_of(candidate)
            count = counts.get(state.name)
            placed[i] = 0.0 if count is None else count.at(now)
            known[i] = True
            known[n + i] = _memory_share(state, &shares[i])
            i += 1
        if i != n:
            raise ValueError("candidates gave fewer than their length")
        _lower_is_better(placed, known, n, room + 2 * n)
        _lower_is_better(shares, known + n, n, room + 3 * n)
        return [(room[2 * n + i] + room[3 * n + i]) / 2 for i in range(n)]
    finally:
        PyMem_Free(room)
        PyMem_Free(known)


cdef void _lower_is_better(const double *values, const char *known, Py_ssize_t n, double *out) noexcept:
    """lower_is_better of values into out; known[i] false: values[i] is unknown."""
    cdef Py_ssize_t i
    cdef double low = 0.0, high = 0.0, value, span
    cdef bint any_known = False
    for i in range(n):
        if not known[i]:
            continue
        value = values[i]
        if not any_known:
            low = high = value
            any_known = True
        elif value < low:
            low = value
        elif value > high:
            high = value
    span = high - low
    for i in range(n):
        if not any_known or not known[i]:
            out[i] = 0.0
        else:
            out[i] = 1.0 if span == 0 else (high - values[i]) / span


cdef bint _memory_share(CandidateState state, double *share) except -1:
    """A candidate's share of its KV memory in use, into share: the contexts in flight there over its
    capacity, or the engine's reported usage when that is more. False while both are unknown."""
    cdef double held, usage
    capacity, load = state.kv_capacity_tokens, state.load
    if capacity:
        held = <double>state.active_tokens / <double>capacity
        if load is not None:
            usage = load.kv_usage
            if usage > held:
                held = usage
        share[0] = held
        return True
    if load is not None:
        share[0] = load.kv_usage
        return True
    return False


def tied_for_best(list scores):
    """The indexes of the highest scores, within 1e-12 of the best; a score that is not finite (a scorer's
    overflow) counts as the lowest of all, as pickers.ranked makes it."""
    cdef Py_ssize_t n = len(scores), i
    cdef double best = -INFINITY, score
    for i in range(n):
        score = scores[i]
        if isfinite(score) and score > best:
            best = score
    cdef double bar = best - 1e-12
    cdef list tied = []
    for i in range(n):
        score = scores[i]
        if not isfinite(score):
            score = -INFINITY
        if score >= bar:
            tied.append(i)
    return tied


def loads(object candidates, bint context_tokens):
    """Each candidate's requests in flight, or with context_tokens the KV tokens they hold."""
    cdef list found = []
    cdef CandidateState state
    for candidate in candidates:
        state = state_of(candidate)
        found.append(state.active_tokens if context_tokens else state.in_flight)
    return found


def named(object candidates, object name):
    """1.0 for each candidate called name, 0.0 for the others."""
    cdef list found = []
    cdef CandidateState state
    for candidate in candidates:
        state = state_of(candidate)
        found.append(1.0 if state.name == name else 0.0)
    return found
