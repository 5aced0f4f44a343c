"""Run by the stack's Python (tests/stack/test_scheduler_fidelity.py): the installed vLLM's V1 scheduler
serves a few requests, with no model (each request that completes its tokens samples one), and prints what
it scheduled. stdin: {"model": a local model directory (only its config is read), "kv_blocks",
"block_size", "max_num_seqs", "max_batched_tokens", "policy" (fcfs or priority, vLLM's --scheduling-policy),
"requests": [[prompt tokens, answer tokens, priority], ...]}, all sent before the first step, request n arriving
at time n. stdout, one JSON line: {"steps": [{request number: tokens scheduled}, ...],
"preempted": [request numbers, in the order vLLM preempted them], "finished": [request numbers, in order],
"stored_blocks": the blocks its KV events announced}.
"""

import json
import sys

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

spec = json.loads(sys.stdin.read())
BS = spec["block_size"]
config = VllmConfig(
    model_config=ModelConfig(model=spec["model"], max_model_len=4096, dtype="float32"),
    scheduler_config=SchedulerConfig(
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_batched_tokens"],
        max_model_len=4096,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        policy=spec["policy"],
    ),
    cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
    kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
)
blocks = spec["kv_blocks"] + 1  # block 0 is vLLM's null block
config.cache_config.num_gpu_blocks = blocks
attention = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
kv = KVCacheConfig(
    num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], attention)]
)
scheduler = Scheduler(config, kv, StructuredOutputManager(config), block_size=BS, log_stats=True)
init_none_hash(sha256)


class Published:
    """The scheduler's KV event publisher: keeps what it is given."""

    def __init__(self) -> None:
        self.stored = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.stored += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))

    def shutdown(self) -> None:
        pass


published = Published()
scheduler.kv_event_publisher = published
hasher = get_request_block_hasher(BS, sha256)
for number, (prompt, answer, priority) in enumerate(spec["requests"]):
    tokens = [1000 * (number + 1) + position for position in range(prompt)]  # no two share a block
    params = SamplingParams(max_tokens=answer, ignore_eos=True)
    scheduler.add_request(
        Request(
            str(number), tokens, params, None, arrival_time=number, priority=priority, block_hasher=hasher
        )
    )

steps: list[dict[int, int]] = []
preempted: list[int] = []
finished: list[int] = []
while scheduler.has_requests() and len(steps) < 10_000:
    output = scheduler.schedule()
    scheduled = output.num_scheduled_tokens
    steps.append({int(r): n for r, n in scheduled.items()})
    preempted += sorted(int(r) for r in output.preempted_req_ids or ())
    ids = list(scheduled)
    sampled = []
    for request_id in ids:
        request = scheduler.requests[request_id]
        done = request.num_computed_tokens >= request.num_tokens  # computed at schedule time
        sampled.append([7 + len(steps) % 50] if done else [])
    runner = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    outputs = scheduler.update_from_output(output, runner)
    for client in outputs.values():
        finished += [int(o.request_id) for o in client.outputs if o.finished]
print(
    json.dumps(
        {"steps": steps, "preempted": preempted, "finished": finished, "stored_blocks": published.stored}
    )
)
