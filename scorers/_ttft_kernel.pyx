# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A request's TTFT cost on each candidate, in C: the features (scorers/ttft_features.py), the prediction
(scorers/ttft_model.py) and the wait it causes (scorers/ttft_cost.py), one implementation for one candidate
and for a fleet of them.

Python spent about 7 µs a candidate here, ten function calls and a named tuple each: over 1,000 instances
most of a decision. A candidate's figures are read from its C fields (scorers/_candidate_state.pyx), not
through Python's attribute lookup. The arithmetic is Python's, operation for operation and in the same order
(the build turns off fused multiply-adds), so the costs are the same floats to the last bit, and so is the
routing.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc

from scorers._buffers cimport doubles
from scorers._candidate_state cimport CandidateState, current_rates, state_of
from scorers.request import NO_MATCH

cdef struct Reused:
    long long gpu
    long long cpu
    long long pool


cdef struct Features:
    long long uncached
    long long loaded  # tokens loaded from the CPU tier or the pool
    long long kept  # tokens reused, on the GPU or loaded
    double memory_wait_s


cdef inline long long _min(long long a, long long b):
    return b if b < a else a


cdef int _reused(object match, long long reusable, Reused* out) except -1:
    """The blocks a match lets a request reuse: whole blocks only, never the last prompt token's."""
    cdef long long gpu = match.gpu, cpu = match.cpu, pool = match.pool
    if gpu + cpu + pool > reusable:
        gpu = _min(gpu, reusable)
        cpu = _min(cpu, reusable - gpu)
        pool = _min(pool, reusable - gpu - cpu)
    out.gpu, out.cpu, out.pool = gpu, cpu, pool
    return 0


cdef long long _reusable(long long prompt_tokens, long long block_size) except -1:
    if block_size <= 0:  # C's division would not raise
        raise ValueError(f"a block size of {block_size}")
    return (prompt_tokens - 1 if prompt_tokens > 1 else 0) // block_size


def reused(object match, long long prompt_tokens, long long block_size):
    """(gpu, cpu, pool) of match, capped to the prompt's reusable blocks."""
    cdef Reused r
    _reused(match, _reusable(prompt_tokens, block_size), &r)
    return r.gpu, r.cpu, r.pool


def memory_wait_s(object candidate, long long prompt_tokens, object chain):
    """How long a prompt would wait there for KV memory (scorers/ttft_features.py says how)."""
    return _memory_wait_s(state_of(candidate), candidate, prompt_tokens, chain)


cdef double _memory_wait_s(
    CandidateState state, object candidate, long long prompt_tokens, object chain
) except? -1.0:
    """memory_wait_s of candidate, whose figures are state."""
    capacity = state.kv_capacity_tokens
    if not capacity:
        return 0.0
    hold_s = state.context_hold_s
    if hold_s is None:
        return 0.0
    cdef double held = state.active_tokens
    cdef double capacity_tokens = capacity
    load = state.load
    cdef double used
    if load is not None:
        used = <double>load.kv_usage * capacity_tokens
        if used > held:
            held = used
    cdef double excess = held + <double>prompt_tokens - capacity_tokens
    if excess > 0:
        excess -= <double>candidate.shared_tokens(chain)
    if excess <= 0 or held <= 0:
        return 0.0
    cdef double share = excess / held
    if 1.0 < share:
        share = 1.0
    return <double>hold_s * share


cdef struct Prompt:
    long long tokens
    long long block_size
    long long reusable  # whole blocks, never the last token's


cdef inline Prompt _prompt(object request):
    cdef Prompt p
    p.tokens, p.block_size = request.prompt_tokens, request.block_size
    p.reusable = _reusable(p.tokens, p.block_size)
    return p


cdef int _features(
    Prompt* prompt, object matches, object chain, CandidateState state, object candidate, Features* out
) except -1:
    cdef Reused r
    match = matches.get(state.name, NO_MATCH)
    if match is NO_MATCH:  # most of a large fleet's instances
        r.gpu = r.cpu = r.pool = 0
    else:
        _reused(match, prompt.reusable, &r)
    out.loaded = (r.cpu + r.pool) * prompt.block_size
    out.kept = (r.gpu + r.cpu + r.pool) * prompt.block_size
    out.uncached = prompt.tokens - out.kept
    out.memory_wait_s = _memory_wait_s(state, candidate, prompt.tokens, chain)
    return 0


cdef inline double _attention_pairs(double start, double tokens):
    return tokens * (start + (tokens + 1.0) / 2.0)  # Python's floats for token counts below 2^53


def attention_pairs(double start, double tokens):
    """The (token, earlier or same token) pairs of computing `tokens` prompt tokens after `start` cached."""
    return _attention_pairs(start, tokens)


def features(object request, object candidate):
    """The TTFT model's features of the request there, as TTFTFeatures' fields up to attention_pairs."""
    cdef Features f
    cdef Prompt prompt = _prompt(request)
    cdef CandidateState state = state_of(candidate)
    _features(&prompt, request.matches, request.chain, state, candidate, &f)
    return (
        state.pending_prefill_tokens,
        f.uncached,
        f.loaded,
        f.memory_wait_s,
        0,
        _attention_pairs(f.kept, f.uncached),
    )


cdef double _predict(
    list rates, double queued, double uncached, double loaded, double memory_wait_s, double attention,
    double transferred,
) except? -1.0:
    if len(rates) != 8:
        raise ValueError("the TTFT model has 8 rates")
    return (
        <double>rates[0]
        + <double>rates[1] * queued
        + <double>rates[2] * uncached
        + <double>rates[3] * loaded
        + <double>rates[4] * memory_wait_s
        + <double>rates[6] * attention
        + <double>rates[7] * transferred
    )


def predict(list rates, object features):
    """TTFT in seconds under rates (TTFTModel's, in TERMS' order) for TTFTFeatures; decoding left out."""
    return _predict(
        rates,
        features.queued_tokens,
        features.uncached_tokens,
        features.loaded_tokens,
        features.memory_wait_s,
        features.attention_pairs,
        features.transferred_tokens,
    )


def costs(object request, object candidates, double behind_per_s, double cap):
    """Each candidate's predicted TTFT, plus the wait it causes the requests behind it when behind_per_s
    is nonzero (at most cap x the prediction): (costs, those charges, or None when behind_per_s is 0)."""
    cdef Py_ssize_t n = len(candidates), i
    cdef list charges = [] if behind_per_s else None
    cdef double *found = doubles(n)
    try:
        _costs(request, candidates, behind_per_s, cap, found, charges)
        return [found[i] for i in range(n)], charges
    finally:
        PyMem_Free(found)


def speed_scores(
    object request, object candidates, double behind_per_s, double cap, double resolution, list factors
):
    """The TTFT cost scorer's scores (_relative_speeds) of costs(request, candidates, behind_per_s, cap), the
    costs kept in C: (scores, the charges or None). Over 1,000 candidates a list of the costs between the two
    was a tenth of choosing."""
    cdef Py_ssize_t n = len(candidates)
    cdef list charges = [] if behind_per_s else None
    cdef double *found = doubles(n)
    try:
        _costs(request, candidates, behind_per_s, cap, found, charges)
        return _relative_speeds(found, n, resolution, factors), charges
    finally:
        PyMem_Free(found)


cdef int _costs(
    object request, object candidates, double behind_per_s, double cap, double *found, list charges
) except -1:
    """costs into found (room for len(candidates)), the charges appended to charges unless it is None."""
    cdef Features f
    cdef double queued, predicted, caused, capped
    cdef list rates
    cdef CandidateState state
    cdef Prompt prompt = _prompt(request)
    cdef Py_ssize_t i = 0, n = len(candidates)
    matches, chain = request.matches, request.chain
    for candidate in candidates:
        if i == n:  # found holds len(candidates)
            raise ValueError("candidates gave more than their length")
        state = state_of(candidate)
        _features(&prompt, matches, chain, state, candidate, &f)
        queued = state.pending_prefill_tokens
        rates = current_rates(state.ttft_model)
        predicted = _predict(
            rates, queued, f.uncached, f.loaded, f.memory_wait_s, _attention_pairs(f.kept, f.uncached), 0.0
        )
        if charges is not None:
            caused = behind_per_s * predicted * <double>rates[1] * <double>f.uncached
            capped = cap * predicted
            if capped < caused:
                caused = capped
            charges.append(caused)
            predicted = predicted + caused
        found[i] = predicted
        i += 1
    if i != n:
        raise ValueError("candidates gave fewer than their length")
    return 0


cdef list _relative_speeds(double *costs, Py_ssize_t n, double resolution, list factors):
    """The TTFT cost scorer's scores of n costs in seconds: (fastest + resolution) / (cost + resolution),
    each cost plus resolution first multiplied by its factor when factors is not None; costs is overwritten
    with those shifted costs."""
    cdef Py_ssize_t i
    cdef double cost, lowest = 0.0, ratio
    if factors is not None and len(factors) != n:
        raise ValueError(f"{len(factors)} factors for {n} costs")
    for i in range(n):
        cost = costs[i] + resolution
        if factors is not None:
            cost = cost * <double>factors[i]
        costs[i] = cost
        if i == 0 or cost < lowest:
            lowest = cost
    cdef list scores = [None] * n
    for i in range(n):
        cost = costs[i]
        ratio = 1.0
        if cost > 0:
            ratio = lowest / cost
            if not ratio < 1.0:
                ratio = 1.0
        scores[i] = ratio
    return scores


def fold(
    double[:, ::1] gram, double[::1] moment, const double[::1] x, double decay, double weight, double target
):
    """One observation into a TTFT model's decayed sums, in place: gram = decay gram + weight x x^T and
    moment = decay moment + weight x target, each element by numpy's operations in numpy's order (its
    `decay * gram + weight * np.outer(x, x)` and `decay * moment + weight * x * target`): the same floats."""
    cdef Py_ssize_t count = x.shape[0], i, j
    if gram.shape[0] != count or gram.shape[1] != count or moment.shape[0] != count:
        raise ValueError("the sums and the observation differ in size")
    for i in range(count):
        for j in range(count):
            gram[i, j] = decay * gram[i, j] + weight * (x[i] * x[j])
        moment[i] = decay * moment[i] + (weight * x[i]) * target
