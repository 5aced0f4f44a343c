"""The TTFT model (prediction, online calibration towards the truth, priors kept where data says nothing)
and the ttft-cost scorer built on it."""

from __future__ import annotations

import math
import random

import pytest

from scorers.candidate import EngineLoad
from scorers.request import RoutingRequest, TierMatch
from scorers.ttft_cost import TTFTCostParams, TTFTCostScorer
from scorers.ttft_features import features_for, memory_wait_s
from scorers.ttft_model import TTFTFeatures, TTFTModel, TTFTPriors
from tests.scorers.candidates import Fake

TRUE_RATES = {"overhead": 0.012, "queue": 3e-4, "prefill": 2.5e-4, "load": 6e-5, "decode": 0.02}


def true_seconds(f: TTFTFeatures) -> float:
    r = TRUE_RATES
    return (
        r["overhead"]
        + r["queue"] * f.queued_tokens
        + r["prefill"] * f.uncached_tokens
        + r["load"] * f.loaded_tokens
        + r["decode"] * f.decoded_tokens
    )


def random_features(rng: random.Random, load: bool = True, whole_answers: bool = True) -> TTFTFeatures:
    return TTFTFeatures(
        queued_tokens=rng.choice([0, 0, rng.randrange(4096)]),
        uncached_tokens=rng.randrange(1, 4096),
        loaded_tokens=rng.randrange(8192) if load and rng.random() < 0.5 else 0,
        decoded_tokens=rng.randrange(1, 64) if whole_answers and rng.random() < 0.3 else 0,
    )


def prediction_error(model: TTFTModel, slowdown: float = 1.0) -> float:
    """Mean relative error of predicted TTFTs over fresh requests."""
    rng = random.Random(99)
    fresh = [random_features(rng, whole_answers=False) for _ in range(200)]
    return sum(abs(model.predict(f) / (slowdown * true_seconds(f)) - 1) for f in fresh) / len(fresh)


def test_calibration_finds_an_instances_rates_from_noisy_ttfts() -> None:
    rng = random.Random(1)
    model = TTFTModel(TTFTPriors())
    for _ in range(300):
        features = random_features(rng)
        model.observe(features, true_seconds(features) * rng.uniform(0.95, 1.05))
    # The overhead is small beside the noise, and decoding only shows in the few whole answers.
    for term, truth in TRUE_RATES.items():
        assert model.rates[term] == pytest.approx(
            truth, rel=0.25 if term in ("overhead", "decode") else 0.1
        ), term
    assert prediction_error(model) < 0.03


def test_a_term_the_traffic_never_exercises_keeps_its_prior() -> None:
    rng = random.Random(2)
    priors = TTFTPriors()
    model = TTFTModel(priors)
    for _ in range(200):
        features = random_features(rng, load=False)
        model.observe(features, true_seconds(features))
    assert model.rates["load"] == pytest.approx(priors.load_s_per_token, rel=0.01)
    assert model.rates["prefill"] == pytest.approx(TRUE_RATES["prefill"], rel=0.05)


def test_a_term_the_traffic_never_exercises_follows_a_fleet_faster_than_the_priors() -> None:
    """Prompts prefill 4x faster than the prior says, and no request loads from the pool: the load rate goes
    down with the prefill rate (one too high would keep every request off the pool, so never be corrected);
    the decode rate, no work a prompt token, stays."""
    rng = random.Random(2)
    priors = TTFTPriors(prefill_s_per_token=1e-3, queue_s_per_token=1e-3, load_s_per_token=4e-4)
    model = TTFTModel(priors)
    for _ in range(200):
        features = random_features(rng, load=False, whole_answers=False)
        model.observe(features, true_seconds(features))
    speed = model.rates["prefill"] / priors.prefill_s_per_token
    assert speed < 0.3  # about the truth's 0.25
    assert model.rates["load"] == pytest.approx(priors.load_s_per_token * speed, rel=0.05)
    assert model.rates["decode"] == pytest.approx(priors.decode_s_per_token, rel=0.01)


def test_calibration_follows_an_instance_that_slows_down() -> None:
    rng = random.Random(3)
    model = TTFTModel(TTFTPriors(memory=30))
    for slowdown in (1.0, 3.0):
        for _ in range(150):
            features = random_features(rng, whole_answers=False)
            model.observe(features, slowdown * true_seconds(features))
        assert prediction_error(model, slowdown) < 0.1
    assert model.rates["prefill"] == pytest.approx(3 * TRUE_RATES["prefill"], rel=0.1)


def test_one_answer_far_faster_than_predicted_does_not_undo_the_calibration() -> None:
    """A 2 ms first byte for 8,000 uncached tokens (the engine had them cached, the index did not know): on
    plain relative error it zeroed the prefill rate, and caching stopped counting in any decision."""
    rng = random.Random(4)
    model = TTFTModel(TTFTPriors())
    for _ in range(300):
        features = random_features(rng)
        model.observe(features, true_seconds(features) * rng.uniform(0.9, 1.1))
    model.observe(TTFTFeatures(3000, 8000, 0), 0.002)
    model._solve()  # at once, not at the next 16th observation
    assert model.rates["prefill"] == pytest.approx(TRUE_RATES["prefill"], rel=0.3)
    assert prediction_error(model) < 0.15


def test_without_calibration_the_priors_stay() -> None:
    priors = TTFTPriors(calibrate=False, prefill_s_per_token=1e-3)
    model = TTFTModel(priors)
    model.observe(TTFTFeatures(0, 1000, 0), 50.0)
    assert model.rates["prefill"] == 1e-3
    assert model.observations == 0


@pytest.mark.parametrize("prior", ["overhead_s", "prefill_s_per_token", "decode_s_per_token"])
def test_priors_out_of_scale_keep_the_rates_instead_of_failing_every_request(prior: str) -> None:
    """1e300 s underflows the pull towards the priors: the system is singular. The rates stay as they were."""
    model = TTFTModel(TTFTPriors.model_validate({prior: 1e300}))
    for i in range(40):
        model.observe(TTFTFeatures(0, 100 + i, 0), 0.05)
    assert model.solved == 0 and model.rates == TTFTModel(TTFTPriors.model_validate({prior: 1e300})).rates
    assert math.isfinite(model.predict(TTFTFeatures(10, 100, 0)))


def test_features_reuse_whole_blocks_and_never_the_last_token() -> None:
    request = RoutingRequest(
        "m",
        prompt_tokens=100,
        prompt_blocks=3,
        block_size=32,
        matches={"a": TierMatch(gpu=1, pool=2), "b": TierMatch(gpu=3)},
    )
    # Computed tokens attend to the reused ones before them and to each other: n x (reused + (n + 1) / 2).
    assert features_for(request, Fake("a", pending_prefill_tokens=7)) == TTFTFeatures(
        7, 100 - 96, 64, attention_pairs=4 * (96 + 2.5)
    )
    exact = RoutingRequest("m", prompt_tokens=96, prompt_blocks=3, block_size=32, matches=request.matches)
    # the last block is computed again
    assert features_for(exact, Fake("b")) == TTFTFeatures(0, 32, 0, attention_pairs=32 * (64 + 16.5))
    assert features_for(exact, Fake("c")) == TTFTFeatures(0, 96, 0, attention_pairs=96 * 48.5)


def test_calibration_learns_what_attention_to_a_long_context_costs() -> None:
    """An engine whose prefill slows with the context before it (each computed token reads every earlier
    one): the same new tokens after a 30K-token cached prefix cost more than after none. The attention
    term, on with a prior 5x off, learns it; left out (its prior 0, the default), the prefill rate becomes an
    average that is wrong for both."""
    rng = random.Random(5)
    per_pair = 5e-9

    def observed(f: TTFTFeatures) -> float:
        return true_seconds(f) + per_pair * f.attention_pairs

    def sample() -> TTFTFeatures:
        uncached, kept = rng.randrange(1, 4096), rng.choice([0, rng.randrange(32_768)])
        return TTFTFeatures(0, uncached, 0, attention_pairs=uncached * (kept + (uncached + 1) / 2))

    model, flat = TTFTModel(TTFTPriors(attention_s_per_pair=per_pair / 5)), TTFTModel(TTFTPriors())
    for _ in range(300):
        features = sample()
        seconds = observed(features) * rng.uniform(0.95, 1.05)
        model.observe(features, seconds)
        flat.observe(features, seconds)
    assert model.rates["attention"] == pytest.approx(per_pair, rel=0.1)
    assert model.rates["prefill"] == pytest.approx(TRUE_RATES["prefill"], rel=0.1)
    after_long = TTFTFeatures(0, 2000, 0, attention_pairs=2000 * (30_000 + 1000.5))
    after_none = TTFTFeatures(0, 2000, 0, attention_pairs=2000 * 1000.5)
    for features in (after_long, after_none):
        assert model.predict(features) == pytest.approx(observed(features), rel=0.05)
    assert flat.rates["attention"] == 0.0
    assert flat.predict(after_long) < 0.8 * observed(after_long)
    assert flat.predict(after_none) > 1.05 * observed(after_none)


@pytest.mark.parametrize(
    ("candidate", "prompt", "expected"),
    [
        (Fake("unknown capacity", active_tokens=900_000, context_hold_s=8.0), 10_000, 0.0),
        (Fake("nothing finished yet", active_tokens=900_000, kv_capacity_tokens=400_000), 10_000, 0.0),
        (Fake("fits", active_tokens=300_000, kv_capacity_tokens=400_000, context_hold_s=8.0), 100_000, 0.0),
        # 50K of the 400K in flight must leave first; they leave at 400K per 8 s
        (Fake("full", active_tokens=400_000, kv_capacity_tokens=400_000, context_hold_s=8.0), 50_000, 1.0),
        # the engine reports more held than this router sent there (other clients)
        (
            Fake(
                "shared",
                active_tokens=100_000,
                kv_capacity_tokens=400_000,
                context_hold_s=8.0,
                load=EngineLoad(0, 4, 1.0),
            ),
            50_000,
            1.0,
        ),
        # the prompt's first 50K tokens are a prefix a request in flight holds: it takes only its other 50K
        (
            Fake(
                "sharing",
                active_tokens=350_000,
                kv_capacity_tokens=400_000,
                context_hold_s=8.0,
                shared=50_000,
            ),
            100_000,
            0.0,
        ),
        # at most every context in flight has to leave
        (
            Fake("overflowing", active_tokens=100_000, kv_capacity_tokens=120_000, context_hold_s=8.0),
            500_000,
            8.0,
        ),
    ],
    ids=lambda value: value.name if isinstance(value, Fake) else None,
)
def test_memory_wait(candidate: Fake, prompt: int, expected: float) -> None:
    assert memory_wait_s(candidate, prompt) == pytest.approx(expected)


def test_a_predicted_wait_for_memory_adds_to_the_ttft_and_does_not_calibrate() -> None:
    model = TTFTModel(TTFTPriors())
    fits, waits = TTFTFeatures(0, 1000, 0), TTFTFeatures(0, 1000, 0, memory_wait_s=2.0)
    assert model.predict(waits) == pytest.approx(model.predict(fits) + 2.0)
    model.observe(waits, 30.0)
    assert model.observations == 0 and model.rates["memory"] == 1.0


def test_a_full_instance_loses_to_loading_from_the_pool() -> None:
    scorer = TTFTCostScorer(TTFTCostParams())
    request = RoutingRequest(
        "m",
        prompt_tokens=64_000,
        prompt_blocks=2000,
        block_size=32,
        matches={"roomy": TierMatch(gpu=1999), "full": TierMatch(gpu=1999), "free": TierMatch(pool=1999)},
    )
    roomy = Fake("roomy", active_tokens=300_000, kv_capacity_tokens=400_000, context_hold_s=30.0)
    full = Fake("full", active_tokens=380_000, kv_capacity_tokens=400_000, context_hold_s=30.0)
    free = Fake("free", active_tokens=100_000, kv_capacity_tokens=400_000, context_hold_s=30.0)
    assert scorer.score(request, [roomy, free])[0] == 1.0  # a local hit beats a 64K-token load from the pool
    full_score, free_score = scorer.score(request, [full, free])  # until its memory is full: 3.5 s of wait
    assert free_score == 1.0 and full_score < 0.8


def test_the_fastest_instance_wins_local_before_pool_before_cold_until_queues_change_that() -> None:
    scorer = TTFTCostScorer(TTFTCostParams())
    request = RoutingRequest(
        "m",
        prompt_tokens=3200,
        prompt_blocks=100,
        block_size=32,
        matches={"local": TierMatch(gpu=99), "pooled": TierMatch(pool=99)},
    )
    idle = [Fake("local"), Fake("pooled"), Fake("cold")]
    seconds = scorer.predict(request, idle)
    assert seconds[0] < seconds[1] < seconds[2]
    assert scorer.score(request, idle)[0] == 1.0
    busy = [Fake("local", pending_prefill_tokens=4000), Fake("pooled"), Fake("cold")]
    scores = scorer.score(request, busy)
    assert scores.index(1.0) == 1  # the pool copy beats queueing behind 4000 tokens
    assert 0 < scores[0] < scores[2] < 1  # and even recomputing everything does


def test_an_in_flight_exponent_multiplies_each_cost_by_the_requests_there() -> None:
    request = RoutingRequest(
        "m", prompt_tokens=3200, prompt_blocks=100, block_size=32, matches={"cached": TierMatch(gpu=99)}
    )
    crowded, quiet = Fake("cached", in_flight=9), Fake("cold", in_flight=0)
    plain = TTFTCostScorer(TTFTCostParams())
    seconds = plain.predict(request, [crowded, quiet])
    assert plain.score(request, [crowded, quiet])[0] == 1.0  # the cached prefix wins on time alone
    multiplied = TTFTCostScorer(TTFTCostParams(in_flight_exponent=1.0))
    scores = multiplied.score(request, [crowded, quiet])
    assert scores[1] == 1.0  # 10 x its time costs more than the cold one's x 1
    assert scores[0] == pytest.approx((seconds[1] + 0.05) / ((seconds[0] + 0.05) * 10))
    halved = TTFTCostScorer(TTFTCostParams(in_flight_exponent=0.5)).score(request, [crowded, quiet])
    assert halved[0] == 1.0  # x 3.2 is not enough to leave the cached prefix, but the gap narrows
    assert plain.score(request, [crowded, quiet])[1] < halved[1] < 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def arrive(scorer: TTFTCostScorer, clock: Clock, per_s: float, seconds: float) -> None:
    """Requests placed at a steady per_s for seconds (the scorer's measured rate follows)."""
    for _ in range(int(per_s * seconds)):
        clock.now += 1 / per_s
        scorer.observe(RoutingRequest("m", prompt_tokens=1), Fake("any"))


def test_the_arrival_rate_is_measured_from_the_decisions_and_forgets() -> None:
    clock = Clock()
    scorer = TTFTCostScorer(TTFTCostParams(wait_caused=1.0, arrivals_half_life_s=10.0), clock)
    arrive(scorer, clock, per_s=8.0, seconds=120.0)
    assert scorer.arrivals_per_s() == pytest.approx(8.0, rel=0.05)
    clock.now += 10.0
    assert scorer.arrivals_per_s() == pytest.approx(4.0, rel=0.05)  # a half-life with no arrivals


def test_the_wait_a_recompute_causes_the_requests_behind_it_counts_only_under_load() -> None:
    # A document's instance is busy prefilling; another is idle but would compute the 8,000 tokens again,
    # and every request arriving there meanwhile waits behind them.
    request = RoutingRequest(
        "m", prompt_tokens=8192, prompt_blocks=256, block_size=32, matches={"holder": TierMatch(gpu=255)}
    )
    holder, idle = Fake("holder", pending_prefill_tokens=12_000), Fake("idle")
    clock = Clock()
    scorer = TTFTCostScorer(TTFTCostParams(wait_caused=1.0, wait_caused_cap=100.0), clock)
    assert scorer.score(request, [holder, idle])[1] == 1.0  # nothing measured arriving: the own TTFT decides
    assert scorer.costs(request, [holder, idle]) == scorer.predict(request, [holder, idle])
    arrive(scorer, clock, per_s=4.0, seconds=60.0)  # 2 a second per instance
    holder_cost, idle_cost = scorer.costs(request, [holder, idle])
    own = scorer.predict(request, [holder, idle])
    assert holder_cost == pytest.approx(own[0], rel=0.01)  # a cached prompt holds nobody up
    queue_rate = idle.ttft_model.rates["queue"]
    behind = scorer.arrivals_per_s() / 2 * own[1]  # arrivals there while it waits and prefills
    assert idle_cost == pytest.approx(own[1] + behind * queue_rate * 8192)
    assert scorer.score(request, [holder, idle])[0] == 1.0  # so the holder's queue is the cheaper choice
    # the same scorer without the term keeps choosing by the request's own TTFT
    plain = TTFTCostScorer(TTFTCostParams(), clock)
    arrive(plain, clock, per_s=4.0, seconds=60.0)
    assert plain.score(request, [holder, idle])[1] == 1.0


def test_the_wait_caused_is_charged_at_most_the_cap_times_the_requests_own_ttft() -> None:
    # A 100K-token prompt computed anew: the requests the count puts behind it grow with its length squared,
    # but the router sends later arrivals elsewhere, so the charge stops at cap x its own TTFT.
    request = RoutingRequest("m", prompt_tokens=100_000, prompt_blocks=3125, block_size=32)
    idle = Fake("idle")
    capped_clock, uncapped_clock = Clock(), Clock()
    capped = TTFTCostScorer(TTFTCostParams(wait_caused=1.0, wait_caused_cap=0.5), capped_clock)
    uncapped = TTFTCostScorer(TTFTCostParams(wait_caused=1.0, wait_caused_cap=100.0), uncapped_clock)
    arrive(capped, capped_clock, per_s=4.0, seconds=60.0)
    arrive(uncapped, uncapped_clock, per_s=4.0, seconds=60.0)
    (own,) = capped.predict(request, [idle])
    assert uncapped.costs(request, [idle])[0] > 3 * own  # what the count alone would charge
    assert capped.costs(request, [idle]) == [pytest.approx(own * 1.5)]
