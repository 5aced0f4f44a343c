# cython: language_level=3
"""What the scorers read of a candidate, kept in an object's C fields (scorers/candidate.py says what each is).

The compiled scoring reads every candidate of every decision: through Python's attribute lookup that was
most of choosing over a large fleet, where a C field is read in a few nanoseconds. The router's instances
are CandidateStates (router/upstreams/instances.py); any other candidate is read into one first. So are a
candidate's TTFT model's rates: the models are ModelRates (scorers/ttft_model.py).
"""


cdef class CandidateState:
    """The figures, each a Python value as the Candidate protocol gives it: int, float, None or an object."""

    def __init__(self, name):
        self.name = name
        self.in_flight = self.pending_prefill_tokens = self.active_tokens = 0


cdef CandidateState state_of(object candidate):
    """candidate itself when it is a CandidateState, else its figures read into one."""
    if isinstance(candidate, CandidateState):
        return <CandidateState>candidate
    cdef CandidateState state = CandidateState.__new__(CandidateState)
    state.name = candidate.name
    state.in_flight = candidate.in_flight
    state.pending_prefill_tokens = candidate.pending_prefill_tokens
    state.active_tokens = candidate.active_tokens
    state.kv_capacity_tokens = candidate.kv_capacity_tokens
    state.context_hold_s = candidate.context_hold_s
    state.load = candidate.load
    state.ttft_model = candidate.ttft_model
    return state


def read_state(object candidate):
    """state_of, for Python (the tests): the figures the compiled scoring reads of candidate."""
    return state_of(candidate)


cdef class ModelRates:
    """A TTFT model's rates as the scoring reads them (scorers/ttft_model.py keeps them): rate_values, in
    TERMS' order, solved from `solved` observations of `observations`; fleet, the model they are pulled
    towards (None: none), whose `solved` they were last solved against is fleet_solved. A subclass solves
    them again in `_solve()`."""

    def __init__(self):
        self.rate_values = []


cdef list current_rates(object model):
    """A model's rates, solved again first when its fleet's have moved since (at most once per solve of
    theirs): the check every candidate of every decision takes, in C, calling Python only to solve. A model
    that is no ModelRates is asked for its current_rates()."""
    cdef ModelRates rates
    cdef ModelRates fleet
    if not isinstance(model, ModelRates):
        return model.current_rates()
    rates = <ModelRates>model
    fleet = rates.fleet
    if fleet is not None and fleet.solved != rates.fleet_solved and fleet.observations:
        model._solve()
    return rates.rate_values


def read_rates(object model):
    """current_rates, for Python: TTFTModel.current_rates, and the tests."""
    return current_rates(model)
