"""The simulated engine fitted to what was measured.

A step of the simulated engine lasts its fixed cost, plus each decoding request's share, plus its prefill
tokens at the prefill rate (kvroute/simulate/engine.py), and a request reaches the engine's queue the
frontend's time after it was sent: a fixed part and a part a prompt token (the server parses, checks and
hashes every token, cached or not). So a prompt of L tokens alone, all but its last cached, takes frontend(L)
+ one fixed cost to its first token; fresh, frontend(L) + ceil(L / budget) fixed costs + L / rate; and a
decode step with b requests fixed + b x share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kvroute.simulate.hardware import EngineSpec


@dataclass(frozen=True)
class Measured:
    prefill_ttft_s: dict[int, float]  # median time to first token by fresh prompt length
    cached_ttft_s: dict[int, float]  # the same prompts sent again, all but their last token cached
    decode_step_s: dict[int, float]  # median gap between tokens by requests decoding together
    kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_batched_tokens: int


def fit(measured: Measured) -> EngineSpec:
    """The engine spec whose lone prompts and decode steps take what was measured."""
    batches = sorted(measured.decode_step_s)
    steps = [measured.decode_step_s[b] for b in batches]
    share = max(float(np.polyfit(batches, steps, 1)[0]), 0.0) if len(batches) > 1 else 0.0
    fixed = max(steps[0] - share * batches[0], 0.0)
    lengths = sorted(measured.prefill_ttft_s)
    budget = measured.max_batched_tokens
    cached = [measured.cached_ttft_s[n] - fixed for n in lengths]
    per_token, frontend = (max(float(x), 0.0) for x in np.polyfit(lengths, cached, 1))
    # What is left of each fresh prompt's TTFT after the frontend's and its steps' fixed costs: L / rate.
    rest = [
        measured.prefill_ttft_s[n] - frontend - per_token * n - math.ceil(n / budget) * fixed for n in lengths
    ]
    slope = max(float(np.polyfit(lengths, rest, 1)[0]), 1e-12)
    return replace(
        EngineSpec(),
        prefill_tokens_per_s=1.0 / slope,
        decode_step_s=fixed,
        decode_step_s_per_seq=share,
        frontend_s=max(frontend - slope, 0.0),  # a cached prompt's last token is computed
        frontend_s_per_token=per_token,
        kv_blocks=measured.kv_blocks,
        block_size=measured.block_size,
        max_num_seqs=measured.max_num_seqs,
        max_batched_tokens=budget,
    )
