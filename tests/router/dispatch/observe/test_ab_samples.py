"""What counts as a latency sample: answers only, each once; and the A/B report is computed off the loop."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvroute.processes import running_router
from router.dispatch.observe.ab import ABStats, Ended
from tests.conftest import metric, sample
from tests.support.fake_upstreams import healthy, only_instance, serving
from tests.support.http import post


def test_error_answers_are_no_latency_samples_and_streams_count_once(tmp_path: Path) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if body["prompt"] == "bad":
            return web.json_response(
                {"error": {"message": "no", "type": "x", "param": None, "code": 400}}, status=400
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "ok"}]}\n\ndata: [DONE]\n\n')
        return response

    with serving(healthy, answer) as port:
        config = only_instance("a", port)
        with running_router(config, tmp_path) as url:
            for prompt in ("bad", "bad", "bad", "good", "good"):
                body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "stream": True})
                status, _, payload = post(url + "/v1/completions", body.encode())
                assert status == (400 if prompt == "bad" else 200), payload
            policy = "kvroute"
            assert metric(url, "kvroute_requests_total", policy=policy, vllm_instance="a", status="400") == 3
            assert metric(url, "kvroute_time_to_first_byte_seconds_count", policy=policy) == 2
            assert metric(url, "kvroute_request_duration_seconds_count", policy=policy) == 2
            assert sample(url, "kvroute_requests_total", policy=policy, vllm_instance="a", status="200") == 2


def test_an_error_adds_no_end_to_end_sample() -> None:
    stats = ABStats()
    stats.finished("p", Ended("a", 200, 0.5, 100, 50))
    stats.finished("p", Ended("a", 400, None, 100, 0))
    summary = stats.report({"p": 1})["policies"]["p"]
    assert summary["requests"] == 2
    assert summary["e2e_ms"]["p50"] == 500.0


def test_the_report_is_computed_on_a_worker_thread_and_shared_for_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stats = ABStats()
    for i in range(100):
        stats.first_byte("a", 0.1 + i / 1000)
        stats.first_byte("b", 0.2 + i / 1000)
    threads: list[str] = []
    report = ABStats.report

    def recording(self: ABStats, split: dict[str, float]) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return report(self, split)

    monkeypatch.setattr(ABStats, "report", recording)

    async def look() -> list[dict[str, Any]]:
        first, second = await asyncio.gather(*(stats.report_off_loop({"a": 1, "b": 1}) for _ in range(2)))
        stats.first_byte("a", 9.0)  # a sample after the copy: the shared report does not move
        third = await stats.report_off_loop({"a": 1, "b": 1})
        stats.reset()
        fourth = await stats.report_off_loop({"a": 1, "b": 1})
        return [first, second, third, fourth]

    first, second, third, fourth = asyncio.run(look())
    assert first is second is third
    assert first["comparisons"][0]["verdict"].startswith("a is faster")
    assert fourth["comparisons"][0]["samples"] == [0, 0]
    assert len(threads) == 2 and threading.current_thread().name not in threads


def test_a_report_merged_with_peers_counts_theirs_and_weighs_each_replicas_recent_samples_alike() -> None:
    async def report() -> dict[str, Any]:
        mine, theirs = ABStats(), ABStats()
        for number in range(3000):  # more than a replica tells its peers
            mine.first_byte("a", 0.1, f"mine-{number % 40}")
            mine.finished("a", Ended("x", 200, 0.2, 100, 50))
        for number in range(40):
            theirs.first_byte("a", 0.3, f"theirs-{number}")
            theirs.finished("a", Ended("y", 200, 0.4, 100, 0))
        exported = theirs.export()
        mine.peers_results = lambda: asyncio.sleep(0, [exported])
        return await mine.report_off_loop({"a": 1.0})

    results = asyncio.run(report())["policies"]["a"]
    assert results["requests"] == 3040
    assert results["requests_per_instance"] == {"x": 3000, "y": 40}
    assert results["predicted_cached_tokens"] == 3000 * 50
    # 2,000 of this replica's recent TTFTs beside the peer's 40: the peer's are the top 2%
    assert results["ttft_ms"]["p50"] == 100.0 and results["ttft_ms"]["p99"] == 300.0
