"""The simulated hardware: one instance's engine, the shared pool, the prefill-to-decode link, and the
fleet's signal delays.

The reference setup (docs/bench-simulate.md): an 8B model on H100-class GPUs, 16-token blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.request_queue import SchedulingPolicy
from router.config import Role
from scorers.ttft_model import attention_pairs

# Seconds per token loaded from the pool into an instance's GPU. An 8B Llama's KV is 128 KiB a token
# (32 layers x 8 KV heads x 128 x 2 x fp16): RDMA at ~200 Gb/s moves ~25 GB/s, TCP at ~25 Gb/s ~3 GB/s.
POOL_PRESETS: dict[str, float] = {"rdma": 5e-6, "tcp": 4e-5}
# A decode instance fetching a prompt's KV from the prefill instance (NixlConnector's transfer): the same
# NICs, so the same presets.
LINK_PRESETS = POOL_PRESETS

# What a token's context costs the engine, for the same model on an H100 (`--attention-cost on`; the
# reference runs leave it out). A prompt token attends to every token before it: 4 x 32 layers x 4096
# FLOPs a pair, ~1e-9 s at ~520 TFLOP/s (about half the dense BF16 peak, what FlashAttention reaches on
# long sequences), so at 80K tokens of context a prefilled token costs 2.6x the flat 50 us. A decode step
# reads every running context's KV: 128 KiB a token at ~3 TB/s of HBM, ~4.4e-8 s, so 400K tokens in flight
# add ~18 ms to a 12 ms step.
ATTENTION_S_PER_PAIR = 1e-9
DECODE_S_PER_CONTEXT_TOKEN = 4.4e-8


@dataclass(frozen=True)
class EngineSpec:
    prefill_tokens_per_s: float = 20_000.0
    decode_step_s: float = 0.012  # any step's fixed cost: one decode step of a small batch
    decode_step_s_per_seq: float = 5e-5  # each decoding request's share of a step
    decode_s_per_context_token: float = 0.0  # and with the contexts it reads (0: the flat reference)
    attention_s_per_pair: float = 0.0  # prefill: per (token, itself or an earlier token) pair (0: flat)
    kv_blocks: int = 25_000  # 400K tokens
    block_size: int = 16
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192  # chunked prefill: prompt tokens an engine step takes at most
    # With a limit, a request arriving at a longer waiting queue is refused (HTTP 503); vLLM has none.
    max_waiting: int | None = None
    # vLLM's --scheduling-policy: its waiting queue's order and whom it preempts (fleet/request_queue.py)
    scheduling_policy: SchedulingPolicy = "fcfs"
    # From a request's send to the engine's queue: HTTP, parsing, the API server; and for each prompt token.
    frontend_s: float = 0.0
    frontend_s_per_token: float = 0.0

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def prefill_s(self, start: int, tokens: int) -> float:
        """Computing `tokens` prompt tokens after `start` already in the cache, alone on the instance, from
        its send: the frontend's time, then its chunks' steps, each with a step's fixed cost."""
        steps = max(-(-tokens // self.max_batched_tokens), 1)
        return (
            self.frontend_s
            + self.frontend_s_per_token * (start + tokens)
            + steps * self.decode_step_s
            + tokens / self.prefill_tokens_per_s
            + self.attention_s(start, tokens)
        )

    def attention_s(self, start: int, tokens: int) -> float:
        """Their attention beyond the flat rate: each attends to itself and every token before it."""
        return self.attention_s_per_pair * attention_pairs(start, tokens)


@dataclass(frozen=True)
class PoolSpec:
    tokens_per_instance: int = 4_000_000
    load_s_per_token: float = POOL_PRESETS["rdma"]


@dataclass(frozen=True)
class PDSpec:
    """A disaggregated fleet: `prefill` instances that compute prompts, then `decode` ones that fetch their
    KV and answer (instances 0 .. prefill - 1 are the prefill ones)."""

    prefill: int = 4
    decode: int = 4
    transfer_s_per_token: float = LINK_PRESETS["rdma"]


@dataclass(frozen=True)
class FleetSpec:
    instances: int = 8
    engine: EngineSpec = EngineSpec()
    pool: PoolSpec | None = PoolSpec()
    event_delay_s: float = 0.05  # KV events reach the router's index this long after the engine step
    model: str = "llama-8b"
    pd: PDSpec | None = None  # None: every instance serves whole requests

    def __post_init__(self) -> None:
        if self.pd is not None and self.pd.prefill + self.pd.decode != self.instances:
            raise ValueError(
                f"{self.pd.prefill} prefill and {self.pd.decode} decode instances are not {self.instances}"
            )

    def role(self, number: int) -> Role:
        if self.pd is None:
            return "both"
        return "prefill" if number < self.pd.prefill else "decode"

    def pool_blocks(self) -> int:
        return (
            0
            if self.pool is None
            else self.pool.tokens_per_instance * self.instances // self.engine.block_size
        )
