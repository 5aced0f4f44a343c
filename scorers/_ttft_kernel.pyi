from collections.abc import Sequence

from scorers._candidate_state import ModelRates
from scorers.candidate import Candidate
from scorers.request import RoutingRequest, TierMatch
from scorers.ttft_model import TTFTFeatures

def reused(match: TierMatch, prompt_tokens: int, block_size: int, /) -> tuple[int, int, int]: ...
def memory_wait_s(candidate: Candidate, prompt_tokens: int, chain: Sequence[int], /) -> float: ...
def attention_pairs(start: float, tokens: float, /) -> float: ...
def features(request: RoutingRequest, candidate: Candidate, /) -> tuple[int, int, int, float, int, float]: ...
def predict(rates: list[float], features: TTFTFeatures, /) -> float: ...
def costs(
    request: RoutingRequest, candidates: Sequence[Candidate], behind_per_s: float, cap: float, /
) -> tuple[list[float], list[float] | None]: ...
def speed_scores(
    request: RoutingRequest,
    candidates: Sequence[Candidate],
    behind_per_s: float,
    cap: float,
    resolution: float,
    factors: list[float] | None,
    /,
) -> tuple[list[float], list[float] | None]: ...

class Calibration:
    count: int
    decay: float
    typical_s: float
    typical_weight: float
    log_speed: float
    speed_weight: float
    def __init__(
        self, terms: list[int], decay: float, typical_s: float, typical_weight: float, speed_weight: float
    ) -> None: ...
    def sums(self) -> tuple[list[list[float]], list[float]]: ...

def observe(model: ModelRates, own: Calibration, features: TTFTFeatures, seconds: float, /) -> None: ...
