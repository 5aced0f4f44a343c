"""Each instance's TTFT model pulled towards its fleet's: a few observations cannot zero a rate, and an
instance that truly differs still finds its own rates."""

from __future__ import annotations

import random

import pytest

from router.config import RouterConfig
from router.upstreams.instances import Upstreams
from scorers.ttft_model import TTFTFeatures, TTFTModel, TTFTPriors
from tests.scorers.test_ttft_cost import TRUE_RATES, random_features, true_seconds

QUEUED_BUT_BATCHED = TTFTFeatures(queued_tokens=2000, uncached_tokens=300, loaded_tokens=0)


def _fleet(priors: TTFTPriors, instances: int = 8) -> tuple[TTFTModel, list[TTFTModel]]:
    fleet = TTFTModel(priors)
    return fleet, [TTFTModel(priors, fleet) for _ in range(instances)]


def _four_answers_that_ignore_the_queue(model: TTFTModel) -> None:
    """An engine batching the queued prompts with this one: the queue did not delay these four."""
    seconds = TRUE_RATES["overhead"] + TRUE_RATES["prefill"] * QUEUED_BUT_BATCHED.uncached_tokens
    for _ in range(4):
        model.observe(QUEUED_BUT_BATCHED, seconds)


@pytest.mark.parametrize("fleet_weight", [16.0, 0.0])
def test_four_answers_do_not_zero_a_rate_the_fleet_has_measured(fleet_weight: float) -> None:
    rng = random.Random(3)
    _, models = _fleet(TTFTPriors(fleet_weight=fleet_weight))
    for _ in range(40):
        for model in models[1:]:
            features = random_features(rng, whole_answers=False)
            model.observe(features, true_seconds(features))
    _four_answers_that_ignore_the_queue(models[0])
    queue = models[0].rates["queue"]
    if fleet_weight:  # pulled towards what the other seven measured
        assert queue > 0.5 * TRUE_RATES["queue"]
    else:  # on its own, four answers decide: the instance looks free of queueing, and would take everything
        assert queue < 0.2 * TRUE_RATES["queue"]


def test_an_instance_on_other_hardware_still_finds_its_own_rates() -> None:
    rng = random.Random(4)
    _, models = _fleet(TTFTPriors())
    slow = models[0]
    for _ in range(300):
        for number, model in enumerate(models):
            features = random_features(rng, whole_answers=False)
            model.observe(features, true_seconds(features) * (2.0 if number == 0 else 1.0))
    assert slow.slowdown == pytest.approx(2.0, rel=0.1)
    assert models[1].slowdown == pytest.approx(1.0, rel=0.1)
    for term in ("queue", "prefill"):
        assert slow.rates[term] == pytest.approx(2 * TRUE_RATES[term], rel=0.15), term
        assert models[1].rates[term] == pytest.approx(TRUE_RATES[term], rel=0.15), term


def test_a_new_instance_predicts_with_the_fleets_rates() -> None:
    rng = random.Random(5)
    fleet, models = _fleet(TTFTPriors(), instances=4)
    for _ in range(100):
        for model in models:
            features = random_features(rng, whole_answers=False)
            model.observe(features, true_seconds(features))
    newcomer = TTFTModel(TTFTPriors(), fleet)
    probe = TTFTFeatures(queued_tokens=1000, uncached_tokens=2000, loaded_tokens=0)
    assert newcomer.predict(probe) == pytest.approx(true_seconds(probe), rel=0.1)
    assert TTFTModel(TTFTPriors()).predict(probe) == pytest.approx(0.305, rel=0.01)  # the priors' guess


def test_the_routers_instances_share_a_fleet_model_per_role() -> None:
    config = RouterConfig.model_validate(
        {
            "models": [{"name": "m"}],
            "instances": [
                {"name": "p1", "url": "http://127.0.0.1:1", "role": "prefill"},
                {"name": "p2", "url": "http://127.0.0.1:2", "role": "prefill"},
                {"name": "d1", "url": "http://127.0.0.1:3", "role": "decode"},
            ],
        }
    )
    upstreams = Upstreams(config)
    p1, p2, d1 = upstreams.instances
    features = TTFTFeatures(queued_tokens=0, uncached_tokens=1000, loaded_tokens=0)
    for _ in range(40):
        p1.ttft_model.observe(features, 1.0)  # ten times the priors' prefill rate
    assert p2.ttft_model.predict(features) > 0.5  # learned from its fellow prefill instance
    assert d1.ttft_model.predict(features) < 0.2  # decode instances calibrate apart


def test_a_whole_answer_decoding_faster_than_its_prior_does_not_zero_the_prefill_rate() -> None:
    """A non-streamed answer's time includes its decoding; at 10 ms a token, the decode prior was 20x too slow
    for a fleet that decoded 16 tokens in 8 ms, and one cached turn solved the prefill rate to 0: a prompt
    computed anew then cost nothing."""
    fleet, (model,) = _fleet(TTFTPriors(prefill_s_per_token=5e-5, queue_s_per_token=5e-5), instances=1)
    cached_turn = TTFTFeatures(queued_tokens=0, uncached_tokens=254, loaded_tokens=0, decoded_tokens=16)
    model.observe(cached_turn, 0.0216)
    for rates in (model.rates, fleet.rates):
        assert rates["prefill"] > 1e-5
    recompute = TTFTFeatures(queued_tokens=0, uncached_tokens=9_000, loaded_tokens=0)
    assert model.predict(recompute) > 0.1
