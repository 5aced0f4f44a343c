# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A request's TTFT cost on each candidate, in C: the features (scorers/ttft_features.py), the prediction
(scorers/ttft_model.py) and the wait it causes (scorers/ttft_cost.py), one implementation for one candidate
and for a fleet of them; and the TTFT models' calibration from each answer (Calibration, observe).

Python spent about 7 µs a candidate here, ten function calls and a named tuple each: over 1,000 instances
most of a decision. A candidate's figures are read from its C fields (scorers/_candidate_state.pyx), not
through Python's attribute lookup. The arithmetic is Python's, operation for operation and in the same order
(the build turns off fused multiply-adds), so the costs are the same floats to the last bit, and so is the
routing.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc

from libc.math cimport fabs, fma, log

from scorers._buffers cimport doubles
from scorers._candidate_state cimport CandidateState, ModelRates, current_rates, state_of
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


# An observed TTFT counts as at most this many times off the prediction; relative errors beyond the Huber
# delta weigh less and less; faster observations are weighed as if they took the shortest time (ttft_model.py
# says why). The rates are solved from the sums on each of the first observations, then every _SOLVE_EVERY.
cdef double _MAX_SURPRISE = 4.0
cdef double _HUBER_DELTA = 0.5
cdef double _SHORTEST_S = 1e-3
cdef long long _SOLVE_EVERY = 16
cdef long long _SOLVE_EACH_UNTIL = 32
cdef Py_ssize_t _TERM_COUNT = 8  # TTFTModel's TERMS


cdef class Calibration:
    """What a TTFT model (scorers/ttft_model.py) learns its rates from, in C: the decayed sums of its
    observations on its calibrated terms (x x^T and x y, each divided by the TTFT: relative error), the
    typical TTFT lately (the priors' scale), and, an instance's, its slowdown against its fleet (log, and the
    observations it averages). `observe` folds an answer in; the model solves its rates from `sums()`."""

    cdef readonly Py_ssize_t count  # terms calibrated
    cdef Py_ssize_t terms[8]  # their places in TERMS
    cdef double gram[64]  # count x count, row by row
    cdef double moment[8]
    cdef public double decay, typical_s, typical_weight, log_speed, speed_weight

    def __init__(
        self, list terms, double decay, double typical_s, double typical_weight, double speed_weight
    ):
        if not 0 < len(terms) <= _TERM_COUNT or any(not 0 <= t < _TERM_COUNT for t in terms):
            raise ValueError(f"terms must be up to {_TERM_COUNT} places in TERMS")
        cdef Py_ssize_t i
        self.count = len(terms)
        for i in range(self.count):
            self.terms[i] = terms[i]
        for i in range(64):
            self.gram[i] = 0.0
        for i in range(8):
            self.moment[i] = 0.0
        self.decay, self.typical_s, self.typical_weight = decay, typical_s, typical_weight
        self.log_speed, self.speed_weight = 0.0, speed_weight

    def sums(self):
        """(gram as a list of rows, moment): the sums the rates are solved from, as Python floats."""
        cdef Py_ssize_t n = self.count
        rows = [[self.gram[i * n + j] for j in range(n)] for i in range(n)]
        return rows, [self.moment[i] for i in range(n)]


def observe(ModelRates model, Calibration own, object features, double seconds):
    """One answer's TTFT (seconds, > 0) for TTFTFeatures features, learnt by model (a TTFTModel, own its
    Calibration) and by its fleet's model: the instance's slowdown against the fleet, then the fleet's sums,
    then its own, each solved again when due (model._solve()). What the Python before it did (numpy on
    7-vectors, a dozen calls twice an answer) operation for operation: its dot products were OpenBLAS's, a
    chain of fused multiply-adds under 16 terms on x86-64, and are that here (fma), so the rates are the same
    floats to the bit where numpy's are those."""
    cdef double full[8]
    cdef double x[8]
    cdef Py_ssize_t i
    cdef Calibration of_fleet
    full[0] = 1.0
    full[1] = features.queued_tokens
    full[2] = features.uncached_tokens
    full[3] = features.loaded_tokens
    full[4] = features.memory_wait_s
    full[5] = features.decoded_tokens
    full[6] = features.attention_pairs
    full[7] = features.transferred_tokens
    for i in range(own.count):
        x[i] = full[own.terms[i]]
    fleet = model.fleet
    if fleet is not None:
        of_fleet = fleet._calibration
        _learn_speed(fleet, own, x, seconds)
        _fold_in(fleet, of_fleet, x, seconds)
    _fold_in(model, own, x, seconds)


cdef double _dot(list rates, Calibration sums, const double *x) except? -1.0:
    """The prediction on the calibrated terms: rates (in TERMS' order) at them, times x."""
    cdef double total = 0.0
    cdef Py_ssize_t i
    if len(rates) != _TERM_COUNT:
        raise ValueError("the TTFT model has 8 rates")
    for i in range(sums.count):
        total = fma(<double>rates[sums.terms[i]], x[i], total)
    return total


cdef inline double _clamped(double value, double low, double high):
    """Python's min(max(value, low), high), ties included."""
    if low > value:
        value = low
    if high < value:
        value = high
    return value


cdef int _learn_speed(ModelRates fleet, Calibration own, const double *x, double seconds) except -1:
    """Instances differ mostly by one factor (a slower GPU, less parallelism): its log, averaged as the sums
    forget, which the instance's rates are pulled towards its fleet's by."""
    cdef double expected = _dot(fleet.rate_values, own, x)
    if expected <= 0:
        return 0
    cdef double ratio = _clamped(seconds / expected, 1 / _MAX_SURPRISE, _MAX_SURPRISE)
    own.speed_weight = own.decay * own.speed_weight + 1.0
    own.log_speed += (log(ratio) - own.log_speed) / own.speed_weight
    return 0


cdef int _fold_in(ModelRates model, Calibration sums, const double *x, double seconds) except -1:
    """One observation into model's sums, robustly: one far off the prediction counts as at most
    _MAX_SURPRISE times off, and past _HUBER_DELTA of relative error it weighs less as the error grows."""
    cdef double weight = 1.0, error, y, target, decay = sums.decay
    cdef double scaled[8]
    cdef Py_ssize_t n = sums.count, i, j
    cdef double predicted = _dot(current_rates(model), sums, x)  # with the decoding a whole answer includes
    if predicted > 0:
        seconds = _clamped(seconds, predicted / _MAX_SURPRISE, predicted * _MAX_SURPRISE)
        error = fabs(predicted - seconds) / seconds
        if error != 0.0:
            weight = _HUBER_DELTA / error
            if not weight < 1.0:
                weight = 1.0
    y = _SHORTEST_S if _SHORTEST_S > seconds else seconds
    target = seconds / y
    for i in range(n):
        scaled[i] = x[i] / y
    # numpy's `decay * gram + weight * np.outer(x, x)` and `decay * moment + weight * x * target`, element by
    # element in its order
    for i in range(n):
        for j in range(n):
            sums.gram[i * n + j] = decay * sums.gram[i * n + j] + weight * (scaled[i] * scaled[j])
        sums.moment[i] = decay * sums.moment[i] + (weight * scaled[i]) * target
    sums.typical_weight = decay * sums.typical_weight + 1.0
    sums.typical_s += (seconds - sums.typical_s) / sums.typical_weight
    model.observations += 1
    if model.observations <= _SOLVE_EACH_UNTIL or model.observations % _SOLVE_EVERY == 0:
        model._solve()
    return 0
