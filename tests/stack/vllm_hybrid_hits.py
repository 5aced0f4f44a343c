"""Run by the stack's Python (tests/stack/test_hybrid_groups.py): the installed vLLM's KV cache manager for a
hybrid model serves a scripted agentic workload, and prints what a router needs to check its index against
it. stdin: {"second_group": "sliding_window" | "mamba", "block_size", "num_blocks", "seed"}. stdout, one JSON
line: a list of steps, each {"batch": the step's KV events as vLLM publishes them (msgpack, hex) or null,
"probes": [[prompt token ids, the prefix hit vLLM finds for it, in tokens], ...]}.

Prefill runs in chunks of two blocks, as a scheduler in Mamba's align mode cuts them (chunks end on block
boundaries); decode runs a token a step. Sessions share a system prompt and grow turn by turn.
"""

import json
import random
import sys

import msgspec
import torch
from vllm import SamplingParams
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

spec = json.loads(sys.stdin.read())
BS = spec["block_size"]
rng = random.Random(spec["seed"])
init_none_hash(sha256)
hasher = get_request_block_hasher(BS, sha256)
attention = {"block_size": BS, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
if spec["second_group"] == "mamba":
    second = MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float16,), mamba_cache_mode="align")
else:
    second = SlidingWindowSpec(sliding_window=2 * BS, **attention)
config = KVCacheConfig(
    num_blocks=spec["num_blocks"],
    kv_cache_tensors=[],
    kv_cache_groups=[
        KVCacheGroupSpec(["attention"], FullAttentionSpec(**attention)),
        KVCacheGroupSpec(["second"], second),
    ],
)
manager = KVCacheManager(
    config,
    max_model_len=8192,
    scheduler_block_size=BS,
    hash_block_size=BS,
    enable_caching=True,
    enable_kv_cache_events=True,
)
encoder = msgspec.msgpack.Encoder()
requests = 0


def request(tokens: list[int]) -> Request:
    global requests
    requests += 1
    return Request(f"r{requests}", tokens, SamplingParams(max_tokens=64), None, block_hasher=hasher)


def hit_tokens(tokens: list[int]) -> int:
    manager.new_step_starts()
    return manager.get_computed_blocks(request(tokens))[1]


def serve(tokens: list[int], output_tokens: int) -> list[int]:
    """Prefill in block-aligned chunks of two blocks, then decode, a step each; returns the answer."""
    served = request(tokens)
    manager.new_step_starts()
    blocks, computed, _ = manager.get_computed_blocks(served)
    chunk = min(2 * BS - computed % BS, len(tokens) - computed)
    assert manager.allocate_slots(served, chunk, computed, blocks) is not None
    served.num_computed_tokens = computed + chunk
    while served.num_computed_tokens < len(tokens):
        manager.new_step_starts()
        chunk = min(2 * BS, len(tokens) - served.num_computed_tokens)
        assert manager.allocate_slots(served, chunk) is not None
        served.num_computed_tokens += chunk
    answer = [rng.randrange(1, 30_000) for _ in range(output_tokens)]
    for token in answer[:-1]:  # the last sampled token is never computed
        manager.new_step_starts()
        served.append_output_token_ids(token)
        assert manager.allocate_slots(served, 1) is not None
        served.num_computed_tokens += 1
    manager.free(served)
    return answer


def words(count: int) -> list[int]:
    return [rng.randrange(1, 30_000) for _ in range(count)]


def batch() -> str | None:
    events = manager.take_events()
    return encoder.encode(KVEventBatch(ts=0.0, events=events, data_parallel_rank=0)).hex() if events else None


system = words(5 * BS + 3)
sessions = [system + words(rng.randrange(10, 60)) for _ in range(4)]
steps = []
for _turn in range(5):
    for index, context in enumerate(sessions):
        answer = serve(context, rng.randrange(5, 3 * BS))
        sessions[index] = context + answer + words(rng.randrange(5, 3 * BS))  # the next turn's prompt
        probes = [*sessions, system + words(20), system[: 3 * BS + 5] + words(30), context[:-7]]
        steps.append({"batch": batch(), "probes": [[p, hit_tokens(p)] for p in probes]})
print(json.dumps(steps))
