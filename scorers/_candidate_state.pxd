# The fields of CandidateState (scorers/_candidate_state.pyx), for the compiled scoring to read as C.
cdef class CandidateState:
    cdef public object name
    cdef public object in_flight
    cdef public object pending_prefill_tokens
    cdef public object active_tokens
    cdef public object kv_capacity_tokens
    cdef public object context_hold_s
    cdef public object load
    cdef public object ttft_model


cdef CandidateState state_of(object candidate)


# The fields of ModelRates (scorers/_candidate_state.pyx), which scorers/ttft_model.py's models are.
cdef class ModelRates:
    cdef public list rate_values
    cdef public ModelRates fleet
    cdef public long long fleet_solved
    cdef public long long solved
    cdef public long long observations


cdef list current_rates(object model)
