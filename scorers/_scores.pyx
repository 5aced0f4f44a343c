# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""What a policy does with its scorers' lists of scores, in C: normalizing, weighing and summing them, and
finding the best; and what the scorers read of every candidate, from its C fields
(scorers/_candidate_state.pyx): its load, its name, its share of KV memory in use. Each was a pass of Python
over every candidate; over 1,000 candidates and four scorers they took a fifth of a decision. The arithmetic
is Python's, operation for operation, so the scores are the same floats (integers below 2^53, token counts,
convert exactly, as Python converts them).
"""

from libc.math cimport INFINITY, isfinite

from scorers._candidate_state cimport CandidateState, state_of


def add_weighted(list totals, list scores, double weight):
    """totals[i] += weight * scores[i], in place; the lists are of one length."""
    cdef Py_ssize_t n = len(totals), i
    if len(scores) != n:
        raise ValueError(f"{len(scores)} scores for {n} candidates")
    for i in range(n):
        totals[i] = <double>totals[i] + weight * <double>scores[i]


def lower_is_better(list values):
    """llm-d's normalization: (max - v) / (max - min) over the known values; equal ones all score 1; an
    unknown value (None) scores 0."""
    cdef Py_ssize_t n = len(values), i
    cdef double low = 0.0, high = 0.0, value, span
    cdef bint known = False
    for i in range(n):
        item = values[i]
        if item is None:
            continue
        value = item
        if not known:
            low = high = value
            known = True
        elif value < low:
            low = value
        elif value > high:
            high = value
    cdef list scores = [0.0] * n
    if not known:
        return scores
    span = high - low
    for i in range(n):
        item = values[i]
        if item is None:
            continue
        scores[i] = 1.0 if span == 0 else (high - <double>item) / span
    return scores


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


def halfway(list first, list second):
    """(first[i] + second[i]) / 2 of two lists of one length."""
    cdef Py_ssize_t n = len(first), i
    if len(second) != n:
        raise ValueError(f"{len(second)} scores beside {n}")
    cdef list means = [None] * n
    for i in range(n):
        means[i] = (<double>first[i] + <double>second[i]) / 2
    return means


def memory_shares(object candidates):
    """Each candidate's share of its KV memory in use: the contexts in flight there over its capacity, or the
    engine's reported usage when that is more; None while both are unknown."""
    cdef list shares = []
    cdef double held, usage
    cdef CandidateState state
    for candidate in candidates:
        state = state_of(candidate)
        capacity, load = state.kv_capacity_tokens, state.load
        if capacity:
            held = <double>state.active_tokens / <double>capacity
            if load is not None:
                usage = load.kv_usage
                if usage > held:
                    held = usage
            shares.append(held)
        elif load is not None:
            shares.append(load.kv_usage)
        else:
            shares.append(None)
    return shares


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


def counts_at(object candidates, dict counts, double now):
    """Each candidate's DecayingCount in counts (by name) at now; 0.0 for one it has none of."""
    cdef list found = []
    cdef CandidateState state
    for candidate in candidates:
        state = state_of(candidate)
        count = counts.get(state.name)
        found.append(0.0 if count is None else count.at(now))
    return found
