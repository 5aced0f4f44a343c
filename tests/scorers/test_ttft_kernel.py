"""The compiled TTFT cost (scorers/_ttft_kernel.pyx) against its formula written out in Python: the same floats
to the last bit, for one candidate and for a fleet, so compiling it changed no routing decision."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scorers import _ttft_kernel
from scorers._candidate_state import read_rates, read_state
from scorers.candidate import EngineLoad
from scorers.request import NO_MATCH, RoutingRequest, TierMatch
from scorers.ttft_cost import TTFTCostParams, TTFTCostScorer
from scorers.ttft_features import features_for
from scorers.ttft_model import TERMS, TTFTFeatures, TTFTModel, TTFTPriors, attention_pairs
from tests.scorers.candidates import Fake, Kept

tokens = st.integers(0, 400_000)
some_seconds = st.floats(0, 60, allow_nan=False)


@st.composite
def candidates(draw: st.DrawFn, name: str) -> Fake:
    model = TTFTModel(
        TTFTPriors(
            attention_s_per_pair=draw(st.sampled_from([0.0, 1e-9])),
            memory_wait_factor=draw(st.floats(0, 4)),
        )
    )
    for _ in range(draw(st.integers(0, 3))):  # calibrated rates: floats with every bit used
        seen = TTFTFeatures(draw(tokens), draw(st.integers(1, 50_000)), draw(st.integers(0, 5_000)))
        model.observe(seen, draw(st.floats(1e-4, 5)))
    load = draw(st.none() | st.builds(EngineLoad, some_seconds, some_seconds, st.floats(0, 1)))
    return Fake(
        name,
        in_flight=draw(st.integers(0, 64)),
        pending_prefill_tokens=draw(tokens),
        active_tokens=draw(tokens),
        load=load,
        kv_capacity_tokens=draw(st.none() | st.just(0) | st.integers(1, 400_000)),
        context_hold_s=draw(st.none() | some_seconds),
        ttft_model=model,
        shared=draw(tokens),
    )


@st.composite
def requests(draw: st.DrawFn, names: Sequence[str]) -> RoutingRequest:
    block_size = draw(st.sampled_from([1, 16, 32]))
    prompt = draw(st.sampled_from([0, 1, 16, 17]) | tokens)
    blocks = st.integers(0, prompt // block_size + 2)
    matches = {
        name: TierMatch(draw(blocks), draw(blocks), draw(blocks)) for name in names if draw(st.booleans())
    }
    return RoutingRequest("m", "s", prompt, prompt // block_size, block_size, matches, range(prompt))


def memory_wait(c: Fake, prompt_tokens: int) -> float:
    if not c.kv_capacity_tokens or c.context_hold_s is None:
        return 0.0
    held = float(c.active_tokens)
    if c.load is not None:
        held = max(held, c.load.kv_usage * c.kv_capacity_tokens)
    excess = held + prompt_tokens - c.kv_capacity_tokens
    if excess > 0:
        excess -= c.shared
    if excess <= 0 or held <= 0:
        return 0.0
    return c.context_hold_s * min(excess / held, 1.0)


def formula(request: RoutingRequest, c: Fake, behind_per_s: float, cap: float) -> tuple[float, float]:
    """(predicted TTFT, wait charged) as the model's docstrings define them, in plain Python."""
    match = request.matches.get(c.name, NO_MATCH)
    reusable = max(request.prompt_tokens - 1, 0) // request.block_size
    gpu = min(match.gpu, reusable)
    cpu = min(match.cpu, reusable - gpu)
    pool = min(match.pool, reusable - gpu - cpu)
    kept = (gpu + cpu + pool) * request.block_size
    uncached = request.prompt_tokens - kept
    rates = c.ttft_model.current_rates()
    predicted = (
        rates[0]
        + rates[1] * c.pending_prefill_tokens
        + rates[2] * uncached
        + rates[3] * ((cpu + pool) * request.block_size)
        + rates[4] * memory_wait(c, request.prompt_tokens)
        + rates[6] * (uncached * (kept + (uncached + 1) / 2))
        + rates[7] * 0
    )
    return predicted, min(behind_per_s * predicted * rates[1] * uncached, cap * predicted)


@st.composite
def fleets(draw: st.DrawFn) -> tuple[RoutingRequest, list[Fake]]:
    names = [f"i{n}" for n in range(draw(st.integers(1, 6)))]
    return draw(requests(names)), [draw(candidates(name)) for name in names]


@settings(max_examples=300, deadline=None)
@given(fleets(), st.sampled_from([0.0, 0.5, 4.0]), st.floats(0, 2), st.sampled_from([0.0, 1.0, 2.5]))
def test_the_compiled_costs_are_the_formulas_floats(
    fleet: tuple[RoutingRequest, list[Fake]], wait_caused: float, cap: float, exponent: float
) -> None:
    request, fleet_candidates = fleet
    now = [0.0]
    scorer = TTFTCostScorer(
        TTFTCostParams(wait_caused=wait_caused, wait_caused_cap=cap, in_flight_exponent=exponent),
        clock=lambda: now[0],
    )
    for _ in range(3):  # arrivals, so that the wait caused counts when wait_caused is on
        now[0] += 0.25
        scorer.observe(request, fleet_candidates[0])
    behind_per_s = scorer.behind_per_s(len(fleet_candidates))
    expected = [formula(request, c, behind_per_s, cap) for c in fleet_candidates]

    assert scorer.predict(request, fleet_candidates) == [predicted for predicted, _ in expected]
    costs = [predicted + (charged if behind_per_s else 0.0) for predicted, charged in expected]
    assert scorer.costs(request, fleet_candidates) == costs
    shifted = [
        (cost + 0.05) * (c.in_flight + 1) ** exponent if exponent else cost + 0.05
        for cost, c in zip(costs, fleet_candidates, strict=True)
    ]
    assert scorer.score(request, fleet_candidates) == [
        min(1.0, min(shifted) / cost) if cost > 0 else 1.0 for cost in shifted
    ]
    for c, (predicted, charged) in zip(fleet_candidates, expected, strict=True):
        assert c.ttft_model.predict(features_for(request, c)) == predicted
        explained = scorer.explain(request, len(fleet_candidates), c)  # alone: the last costs are spent
        assert explained["wait_caused_s"] == (charged if behind_per_s else 0.0)


@settings(max_examples=300, deadline=None)
@given(fleets(), st.sampled_from([0.0, 0.5, 4.0]), st.floats(0, 2))
def test_a_candidate_kept_in_c_fields_costs_what_one_of_attributes_does(
    fleet: tuple[RoutingRequest, list[Fake]], behind_per_s: float, cap: float
) -> None:
    """The kernel reads a CandidateState's fields in C and any other candidate's attributes: the same
    figures give the same floats either way, and the formula's."""
    request, fakes = fleet
    kept = [Kept(c) for c in fakes]
    found = _ttft_kernel.costs(request, kept, behind_per_s, cap)
    assert found == _ttft_kernel.costs(request, fakes, behind_per_s, cap)
    expected = [formula(request, c, behind_per_s, cap) for c in fakes]
    assert found[0] == [predicted + charged if behind_per_s else predicted for predicted, charged in expected]
    for fake, state in zip(fakes, kept, strict=True):
        assert read_state(state) is state  # read in place, not copied
        copied = read_state(fake)
        figures = ("name", "in_flight", "pending_prefill_tokens", "active_tokens", "kv_capacity_tokens")
        more = ("context_hold_s", "load", "ttft_model")
        assert [getattr(copied, f) for f in figures + more] == [getattr(fake, f) for f in figures + more]


def test_the_kernel_reads_the_rates_in_the_models_order() -> None:
    """The kernel reads rates by position: reordering TERMS must fail here, not mispredict."""
    assert TERMS == ("overhead", "queue", "prefill", "load", "memory", "decode", "attention", "transfer")


def test_attention_pairs_take_counts_of_either_type() -> None:
    assert attention_pairs(3, 4) == 4 * (3 + 5 / 2) == attention_pairs(3.0, 4.0)


def test_a_block_size_of_zero_is_refused_not_divided_by() -> None:
    request = RoutingRequest("m", prompt_tokens=100, block_size=0, matches={"a": TierMatch(gpu=2)})
    with pytest.raises(ValueError, match="block size of 0"):
        features_for(request, Fake("a"))


_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.fma.restype, _libm.fma.argtypes = ctypes.c_double, [ctypes.c_double] * 3


def _dot(rates: Sequence[float], x: Sequence[float]) -> float:
    """The kernel's dot product: a chain of fused multiply-adds, as OpenBLAS's under 16 terms (what numpy's
    `@` ran before the calibration was compiled)."""
    total = 0.0
    for rate, value in zip(rates, x, strict=True):
        total = _libm.fma(rate, value, total)
    return float(total)


def _expected_sums(model: TTFTModel, x: np.ndarray, seconds: float) -> tuple[np.ndarray, np.ndarray, float]:
    """What folding one observation into model's sums gives, written out with numpy (the definition)."""
    calibration = model._calibration
    terms = model._terms.tolist()
    predicted = _dot([model.current_rates()[t] for t in terms], x.tolist())
    weight = 1.0
    if predicted > 0:
        seconds = min(max(seconds, predicted / 4.0), predicted * 4.0)
        error = abs(predicted - seconds) / seconds
        weight = min(1.0, 0.5 / error) if error else 1.0
    y = max(seconds, 1e-3)
    scaled, target, decay = x / y, seconds / y, calibration.decay
    gram, moment = (np.array(sums) for sums in calibration.sums())
    typical_weight = decay * calibration.typical_weight + 1.0
    typical_s = calibration.typical_s + (seconds - calibration.typical_s) / typical_weight
    return (
        decay * gram + weight * np.outer(scaled, scaled),
        decay * moment + weight * scaled * target,
        typical_s,
    )


observed = st.tuples(
    st.integers(0, 200_000),
    st.integers(0, 50_000),
    st.integers(0, 5_000),
    st.integers(0, 300),
    st.floats(0, 1e9),
    st.integers(0, 9_000),
    st.floats(1e-6, 30),
)


@given(st.sampled_from([0.0, 1e-9]), st.lists(observed, min_size=1, max_size=40))
@settings(max_examples=150, deadline=None)
def test_an_observation_is_folded_into_the_sums_as_numpy_writes_it_to_the_bit(
    attention: float, answers: list[tuple[int, int, int, int, float, int, float]]
) -> None:
    """The compiled calibration against its definition in numpy: the sums the rates are solved from, and
    the typical TTFT that scales the priors, the same floats after every observation."""
    model = TTFTModel(TTFTPriors(attention_s_per_pair=attention, fleet_weight=0))
    for queued, uncached, loaded, decoded, pairs, transferred, seconds in answers:
        features = TTFTFeatures(queued, uncached, loaded, 0.0, decoded, pairs, transferred)
        x = np.array([1.0, queued, uncached, loaded, 0.0, decoded, pairs, transferred])[model._terms]
        gram, moment, typical_s = _expected_sums(model, x, seconds)
        model.observe(features, seconds)
        found_gram, found_moment = (np.array(sums) for sums in model._calibration.sums())
        assert found_gram.tobytes() == gram.tobytes() and found_moment.tobytes() == moment.tobytes()
        assert model._calibration.typical_s == typical_s


@given(st.lists(observed, min_size=1, max_size=40))
@settings(max_examples=100, deadline=None)
def test_an_instances_slowdown_against_its_fleet_is_learnt_as_python_writes_it(
    answers: list[tuple[int, int, int, int, float, int, float]],
) -> None:
    fleet = TTFTModel(TTFTPriors())
    model = TTFTModel(TTFTPriors(), fleet)
    for queued, uncached, loaded, decoded, pairs, transferred, seconds in answers:
        x = [1.0, queued, uncached, loaded, 0.0, decoded, transferred]  # attention is off: not calibrated
        expected = _dot([fleet.current_rates()[t] for t in model._terms.tolist()], x)
        log_speed, weight = model._calibration.log_speed, model._calibration.speed_weight
        if expected > 0:
            ratio = min(max(seconds / expected, 1 / 4.0), 4.0)
            weight = model._calibration.decay * weight + 1.0
            log_speed += (math.log(ratio) - log_speed) / weight
        model.observe(TTFTFeatures(queued, uncached, loaded, 0.0, decoded, pairs, transferred), seconds)
        assert model._calibration.log_speed == log_speed and model.slowdown == math.exp(log_speed)


def test_a_calibration_takes_places_in_the_terms_only() -> None:
    with pytest.raises(ValueError, match="places in TERMS"):
        _ttft_kernel.Calibration([0, 8], 0.98, 1.0, 1.0, 16.0)
    with pytest.raises(ValueError, match="places in TERMS"):
        _ttft_kernel.Calibration([], 0.98, 1.0, 1.0, 16.0)


def test_an_instance_and_its_fleet_calibrate_the_same_terms() -> None:
    """An observation is folded into both with the instance's features vector and checks."""
    with pytest.raises(ValueError, match="same terms"):
        TTFTModel(TTFTPriors(attention_s_per_pair=1e-9), TTFTModel(TTFTPriors()))
    with pytest.raises(ValueError, match="same terms"):
        TTFTModel(TTFTPriors(), TTFTModel(TTFTPriors(calibrate=False)))


def test_the_compiled_rates_are_the_models_solving_only_when_its_fleet_moved() -> None:
    """The scoring reads a model's rates in C, and asks Python to solve them only when its fleet's were
    solved again since: what current_rates gives either way."""
    fleet = TTFTModel(TTFTPriors())
    model = TTFTModel(TTFTPriors(), fleet)
    for tokens in range(1, 40):
        model.observe(TTFTFeatures(100, 50 * tokens, 0), 0.01 + 0.002 * tokens)
    current, solved = model.rate_values, model.solved
    assert read_rates(model) is current and model.solved == solved  # nothing moved: no solve
    for _ in range(16 - fleet.observations % 16):  # the fleet solves again at its next 16th observation
        fleet.observe(TTFTFeatures(100, 4_000, 0), 0.5)
    assert fleet.solved == fleet.observations != model.fleet_solved
    rates = read_rates(model)
    assert model.fleet_solved == fleet.solved and rates is model.rate_values and rates != current
    assert rates == model.current_rates()
