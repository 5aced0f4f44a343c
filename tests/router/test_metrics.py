"""Labelled metric families: a removed instance's series leave /metrics and stay out until it is back. A gauge
that means nothing until it is set has no sample until then."""

from __future__ import annotations

from router.metrics import RouterMetrics


def _series_of(metrics: RouterMetrics, instance: str) -> list[str]:
    label = f'vllm_instance="{instance}"'
    return [line for line in metrics.render().decode().splitlines() if label in line]


def test_a_forgotten_instance_stays_out_when_requests_it_was_serving_end() -> None:
    metrics = RouterMetrics()
    metrics.requests("kvroute", "gone", "200", "m", "chat").inc()
    metrics.in_flight("gone").set(1)
    metrics.requests("kvroute", "kept", "200", "m", "chat").inc()
    metrics.forget_instance("gone")
    assert _series_of(metrics, "gone") == []
    # a stream it was serving ends after the reload
    metrics.requests("kvroute", "gone", "200", "m", "chat").inc()
    metrics.in_flight("gone").set(0)
    metrics.ttft_observed("gone").observe(0.2)
    assert _series_of(metrics, "gone") == []
    assert any("kvroute_requests_total" in line for line in _series_of(metrics, "kept"))


def test_an_instance_added_back_is_exported_afresh() -> None:
    metrics = RouterMetrics()
    metrics.requests("kvroute", "back", "200", "m", "chat").inc()
    metrics.forget_instance("back")
    metrics.requests("kvroute", "back", "200", "m", "chat").inc()  # counted nowhere
    metrics.restore_instance("back")
    metrics.requests("kvroute", "back", "200", "m", "chat").inc()
    lines = [line for line in _series_of(metrics, "back") if line.startswith("kvroute_requests_total")]
    assert lines and lines[0].endswith(" 1.0")


def test_the_pool_masters_gauge_has_no_sample_until_a_lookup_sets_it() -> None:
    """Without a pool there is never a lookup: a 0 would page someone about a master that does not exist."""
    metrics = RouterMetrics()
    assert metrics.registry.get_sample_value("kvroute_pool_master_up") is None
    assert "# TYPE kvroute_pool_master_up gauge" in metrics.render().decode()  # the family, for dashboards
    metrics.pool_master_up.set(0)
    assert metrics.registry.get_sample_value("kvroute_pool_master_up") == 0
    metrics.pool_master_up.set(1)
    assert metrics.registry.get_sample_value("kvroute_pool_master_up") == 1
