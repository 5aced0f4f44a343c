from scorers.candidate import Candidate, EngineLoad
from scorers.ttft_model import TTFTModel

class CandidateState:
    name: str
    in_flight: int
    pending_prefill_tokens: int
    active_tokens: int
    kv_capacity_tokens: int | None
    context_hold_s: float | None
    load: EngineLoad | None
    ttft_model: TTFTModel
    def __init__(self, name: str, /) -> None: ...

def read_state(candidate: Candidate, /) -> CandidateState: ...

class ModelRates:
    rate_values: list[float]
    fleet: ModelRates | None
    fleet_solved: int
    solved: int
    observations: int
    def __init__(self) -> None: ...

def read_rates(model: TTFTModel, /) -> list[float]: ...
