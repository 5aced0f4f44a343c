"""The KV memory the requests in flight on an engine hold: a shared prefix once, as vLLM's prefix cache holds
it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.upstreams.inflight_blocks import InflightBlocks
from router.upstreams.instances import Instance, InstanceSetup

BLOCK = 512  # one block a grain: every block counts on its own
SYSTEM = [1, 2, 3]  # chained hashes: a later block's hash stands for its whole prefix
TURN_1 = [*SYSTEM, 10, 11]
TURN_2 = [*TURN_1, 12]  # the same conversation, one turn on, sent before turn 1 ended
OTHER = [*SYSTEM, 20]


def test_requests_in_flight_hold_a_shared_prefix_once() -> None:
    held = InflightBlocks(BLOCK)
    held.add(TURN_1, 5 * BLOCK + 7)
    held.add(TURN_2, 6 * BLOCK + 3)
    held.add(OTHER, 4 * BLOCK)
    assert held.tokens == 7 * BLOCK + 7 + 3  # blocks 1-3, 10-12 and 20; each request's partial last block
    held.remove(TURN_2, 6 * BLOCK + 3)
    assert held.tokens == 6 * BLOCK + 7  # block 12 went with turn 2; what turn 1 and OTHER hold stays
    held.remove(TURN_1, 5 * BLOCK + 7)
    held.remove(OTHER, 4 * BLOCK)
    assert held.tokens == 0


def test_the_held_part_of_a_prompt_is_its_longest_held_prefix() -> None:
    held = InflightBlocks(BLOCK)
    held.add(TURN_1, 5 * BLOCK)
    assert held.shared_tokens([*TURN_1, 12, 13]) == 5 * BLOCK
    assert held.shared_tokens([*SYSTEM, 30, 31]) == 3 * BLOCK
    assert held.shared_tokens(OTHER) == 3 * BLOCK
    assert held.shared_tokens([40, 41]) == 0
    assert held.shared_tokens([]) == 0


def test_small_blocks_count_in_grains_of_512_tokens() -> None:
    """A prompt of 100 16-token blocks is three whole grains (96 blocks) and 64 loose tokens."""
    held = InflightBlocks(16)
    prompt = list(range(100))
    held.add(prompt, 1_605)
    held.add(prompt[:70], 70 * 16)  # shares the first two grains, then 6 blocks of its own
    assert held.tokens == 3 * 512 + (1_605 - 3 * 512) + 6 * 16
    assert held.shared_tokens([*prompt[:80], 999]) == 2 * 512  # the third grain ends at block 95
    assert held.shared_tokens(prompt) == 3 * 512


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 16, 64, 1024]), st.lists(st.integers(0, 80), max_size=4), st.integers(0, 80))
def test_the_held_part_is_the_longest_prefix_of_whole_grains_held(
    block_size: int, held_lengths: list[int], asked: int
) -> None:
    """A grain is known by its last block: the prompt's grains are every stride-th block of its chain."""
    held = InflightBlocks(block_size)
    chain = list(range(100))
    for length in held_lengths:
        held.add(chain[:length], length * block_size)
    stride = max(1, 512 // block_size)
    grains = chain[: asked // stride * stride][stride - 1 :: stride]
    held_grains = {
        g for length in held_lengths for g in chain[: length // stride * stride][stride - 1 :: stride]
    }
    expected = 0
    while expected < len(grains) and grains[expected] in held_grains:
        expected += 1
    assert held.shared_tokens(chain[:asked]) == expected * stride * block_size


def test_an_instance_counts_what_its_requests_hold_and_lets_go_when_they_end() -> None:
    instance = Instance("a", "http://a", frozenset({"m"}), setup=InstanceSetup(block_size=BLOCK))
    instance.start(5 * BLOCK, 2 * BLOCK, TURN_1)
    instance.start(6 * BLOCK, BLOCK, TURN_2)
    assert (instance.active_tokens, instance.shared_tokens(TURN_2)) == (6 * BLOCK, 6 * BLOCK)
    instance.end(6 * BLOCK, BLOCK, admitted=False, chain=TURN_2)  # refused: it held nothing
    assert instance.active_tokens == 5 * BLOCK
    instance.end(5 * BLOCK, 2 * BLOCK, chain=TURN_1)
    assert (instance.active_tokens, instance.in_flight, instance.pending_prefill_tokens) == (0, 0, 0)
