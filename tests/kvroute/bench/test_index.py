"""`kvroute bench index`'s end-to-end ingest, fleet decisions and routers' memory, at a small size: what they
count is right (their timings and sizes are the benchmark's, not a test's)."""

from __future__ import annotations

from kvroute.bench.index import measure_ingest
from kvroute.bench.index_decisions import SESSION_HOLDERS, measure_decisions
from kvroute.bench.index_ingest import measure_ingest_end_to_end
from kvroute.bench.index_workers import measure_router_memory, measure_serve_ingest


def test_every_block_sent_over_zmq_reaches_the_index() -> None:
    result = measure_ingest_end_to_end(blocks=2 * 50 * 32, blocks_per_message=32, publishers=2)
    assert (result.blocks, result.messages, result.index_entries) == (3_200, 100, 3_200)
    single = measure_ingest_end_to_end(blocks=300, blocks_per_message=1, publishers=3)
    assert (single.blocks, single.messages, single.index_entries) == (300, 300, 300)
    assert single.summary()["messages_per_s"] > 0


def test_the_subscriber_alone_counts_every_block_and_indexes_none() -> None:
    alone = measure_ingest_end_to_end(blocks=2 * 20 * 32, blocks_per_message=32, publishers=2, indexed=False)
    assert (alone.blocks, alone.messages, alone.index_entries) == (1_280, 40, 0)


def test_every_instance_of_a_fleet_matches_the_shared_prompt() -> None:
    fleets = measure_decisions((4, 20), prompt_tokens=4_096, repeats=1)
    assert [fleets[size]["matched_instances"] for size in ("4", "20")] == [4, 20]
    assert SESSION_HOLDERS < 20
    for fleet in fleets.values():
        parts = (fleet["hash_ms"], fleet["match_ms"], fleet["choose_ms"])
        assert min(parts) > 0 and fleet["decision_ms"] == sum(parts) and fleet["full_choose_ms"] > 0
        assert fleet["cold_match_ms"] > 0


def test_a_router_with_workers_holds_every_block_sent_once_in_its_index_host() -> None:
    """The pool, two workers and the index host; a worker's /metrics reports every block (the host's index),
    and the measure waits for it."""
    shared = measure_router_memory(blocks=2 * 8 * 32, workers=2, settle_s=0.0)
    assert (shared.processes, shared.blocks) == (4, 512)
    lone = measure_router_memory(blocks=2 * 8 * 32, workers=1, settle_s=0.0)
    assert (lone.processes, lone.blocks) == (1, 512)


def test_the_in_process_ingest_enters_every_block_and_times_its_slowest_event() -> None:
    result = measure_ingest(100 * 32)
    assert result["blocks"] == 100 * 32
    assert (
        0 < result["slowest_event_ms"] / 1e3 <= result["blocks"] / result["blocks_per_s"]
    )  # one of the whole


def test_a_lone_serve_is_measured_from_outside_with_blocks_of_either_size() -> None:
    """The whole-process ingest rows: every block sent is held (of 32 tokens too, the router configured for
    them), and the router's CPU time is read from /proc, not its own clock."""
    for block_size in (16, 32):
        run = measure_serve_ingest(
            blocks=4 * 8 * 32, blocks_per_message=32, block_size=block_size, settle_s=0.0
        )
        summary = run.summary()
        assert (run.blocks, run.block_size) == (4 * 8 * 32, block_size)
        assert (
            summary["blocks_per_cpu_s"] > 0
            and summary["messages_per_cpu_s"] * 32 == summary["blocks_per_cpu_s"]
        )
