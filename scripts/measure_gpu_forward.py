"""What Llama-3.1-8B's forward pass costs on one GPU, beside what a simulator profile predicts for it.

The profile configs/profiles/h100-llama-3.1-8b.json prices vLLM on an H100 from published figures: a prompt of
L tokens alone takes ceil(L / max_batched_tokens) x decode_step_s + L / prefill_tokens_per_s +
attention_s_per_pair x L(L+1)/2, and a decode step of b requests reading C context tokens in all takes
decode_step_s + b x decode_step_s_per_seq + C x decode_s_per_context_token. This script measures the same
quantities independently, without vLLM (its wheel cannot travel to the GPU machine): the model is built from
Llama-3.1-8B's config in code, with random bf16 weights, and run with transformers on the GPU.

- Prefill: one prompt of L random token ids, chunked as vLLM's chunked prefill does (chunks of at most
  max_batched_tokens, each a forward pass over a DynamicCache holding the chunks before it), only the last
  position's logits computed; median of 3 runs after a warm-up; then a least-squares fit of the profile's
  TTFT formula (the step cost free, and fixed at the profile's).
- Batched prefill: 16 prompts of 512 tokens in one forward pass; tokens a second.
- Decode: one token for each of b sequences of C cached tokens (a StaticCache sized C + 1), eager and replayed
  from a CUDA graph (what vLLM runs, so the figure comparable to decode_step_s).

Attention is PyTorch's scaled_dot_product_attention behind a small wrapper: GQA without repeating the KV
heads, and a chunk's causal mask aligned lower-right (its queries are the last positions) without
materializing it, so the flash kernel serves every shape. The stock "sdpa" path would materialize a mask and
repeat the KV heads four times for any chunk after the first and for every decode step.

    python3 scripts/measure_gpu_forward.py --profile configs/profiles/h100-llama-3.1-8b.json \\
        --budget-s 330 --out "$OUT/gpu_forward.json"
    python3 scripts/measure_gpu_forward.py --tiny  # a quick check on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

ATTENTION = "lower_right_sdpa"
PREFILL_LENGTHS = (1000, 2000, 4000, 8000, 16000, 32000, 64000)
TINY_PREFILL_LENGTHS = (100, 200, 400)
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXTS = (1000, 8000)
TINY_DECODE_CONTEXTS = (50, 300)
BATCHED_PROMPTS, BATCHED_PROMPT_TOKENS = 16, 512
RUNS = 3
DECODE_EAGER_STEPS, DECODE_GRAPH_STEPS = 20, 100
RESERVE_S = 90.0  # of the budget kept for batched prefill and decode while prefilling
# Set when the device's SDPA cannot take a lower-right causal mask with fewer KV heads than query heads:
# then a chunk after the first reads KV heads repeated to the query heads' count (check_attention decides).
REPEAT_KV_FOR_LATER_CHUNKS = {"on": False}


@dataclass(frozen=True)
class Engine:
    """The profile's engine constants."""

    prefill_tokens_per_s: float
    decode_step_s: float
    decode_step_s_per_seq: float
    decode_s_per_context_token: float
    attention_s_per_pair: float
    max_batched_tokens: int

    @classmethod
    def load(cls, path: Path) -> Engine:
        engine = json.loads(path.read_text())["engine"]
        return cls(**{name: engine[name] for name in cls.__dataclass_fields__})

    def prefill_s(self, prompts: int, tokens_each: int) -> float:
        """One step (or chunked steps, for one prompt) computing whole prompts that nothing is cached for."""
        tokens = prompts * tokens_each
        steps = max(-(-tokens // self.max_batched_tokens), 1)
        pairs = prompts * tokens_each * (tokens_each + 1) / 2
        return (
            steps * self.decode_step_s
            + tokens / self.prefill_tokens_per_s
            + self.attention_s_per_pair * pairs
        )

    def decode_s(self, batch: int, context_each: int) -> float:
        """A decode step of `batch` requests, each reading `context_each` tokens (its new one included)."""
        return (
            self.decode_step_s
            + self.decode_step_s_per_seq * batch
            + self.decode_s_per_context_token * batch * context_each
        )


@dataclass
class Report:
    """Everything measured so far; written out after each point, so a cut-off run still leaves its numbers."""

    path: Path | None
    data: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data, indent=2) + "\n")
        partial.replace(self.path)


class Clock:
    """The run's budget, from the script's start."""

    def __init__(self, budget_s: float) -> None:
        self.started = time.perf_counter()
        self.budget_s = budget_s

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def left_s(self) -> float:
        return self.budget_s - self.elapsed_s()


def say(message: str) -> None:
    print(message, flush=True)


def lower_right_causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA for a causal decoder whose keys are exactly the cached tokens then the queries' own: a query at
    position i of q attends to the first kv - q + i + 1 keys. `attention_mask` is None (no mask function is
    registered for this implementation, so transformers builds none)."""
    q_length, kv_length = query.shape[2], key.shape[2]
    if q_length == 1:  # decode: the one new token reads everything
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    elif q_length == kv_length:  # a first chunk
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
    else:  # a later chunk
        mask = causal_lower_right(q_length, kv_length)
        if REPEAT_KV_FOR_LATER_CHUNKS["on"]:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous(), None


def llama_config(tiny: bool) -> LlamaConfig:
    """Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B-Instruct's config.json), or a tiny one (a CPU check)."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    shape: dict[str, int] = (
        {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}
        if tiny
        else {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    )  # fmt: skip
    config = LlamaConfig(
        **shape,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None if tiny else 128000,
        eos_token_id=None if tiny else 128009,
    )
    config._attn_implementation = ATTENTION
    return config


def build_model(config: LlamaConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Random weights, allocated on the device directly (no CPU copy), normal(0, 0.02) as Llama's init."""
    AttentionInterface.register(ATTENTION, lower_right_causal_attention)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:  # RMSNorm weights
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02)
    if model.config._attn_implementation != ATTENTION:
        raise RuntimeError(f"the model runs {model.config._attn_implementation!r}, not {ATTENTION!r}")
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_s(device: torch.device, run: Callable[[], object]) -> float:
    sync(device)
    started = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - started


def random_ids(
    generator: torch.Generator, vocab: int, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=generator).to(device)


def chunked_prefill(model: LlamaForCausalLM, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """The prompt in chunks of at most `chunk` tokens over one DynamicCache; the last position's logits."""
    cache = DynamicCache(config=model.config)
    logits = torch.empty(0)
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        positions = torch.arange(start, start + piece.shape[1], device=ids.device).unsqueeze(0)
        logits = model(
            input_ids=piece, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
        ).logits
    return logits


def time_prefill(
    model: LlamaForCausalLM, ids: torch.Tensor, engine: Engine, device: torch.device, runs: int = RUNS
) -> list[float]:
    """A warm-up, then `runs` timed chunked prefills of the same prompt."""

    def run() -> torch.Tensor:
        return chunked_prefill(model, ids, engine.max_batched_tokens)

    timed_s(device, run)
    return [timed_s(device, run) for _ in range(runs)]


def check_attention(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The wrapper against a materialized lower-right causal mask with repeated KV heads, and which SDPA
    kernels PyTorch can use for its shapes."""
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, q_length, kv_length = 8, 2, 128, 64, 192
    query = torch.randn(2, heads, q_length, dim, generator=generator).to(device, dtype)
    key = torch.randn(2, kv_heads, kv_length, dim, generator=generator).to(device, dtype)
    value = torch.randn(2, kv_heads, kv_length, dim, generator=generator).to(device, dtype)
    allowed = torch.ones(q_length, kv_length, dtype=torch.bool, device=device).tril(kv_length - q_length)
    reference = F.scaled_dot_product_attention(
        query.float(),
        key.float().repeat_interleave(heads // kv_heads, 1),
        value.float().repeat_interleave(heads // kv_heads, 1),
        attn_mask=allowed,
    ).transpose(1, 2)
    result: dict[str, Any] = {}
    try:
        lower_right_causal_attention(torch.nn.Module(), query, key, value, None)
    except Exception as error:
        result["chunk_gqa_error"] = f"{type(error).__name__}: {error}"
        REPEAT_KV_FOR_LATER_CHUNKS["on"] = True
    result["repeat_kv_for_later_chunks"] = REPEAT_KV_FOR_LATER_CHUNKS["on"]
    for label, q in (("chunk", query), ("decode", query[:, :, -1:])):
        ours, _ = lower_right_causal_attention(torch.nn.Module(), q, key, value, None)
        want = reference if label == "chunk" else reference[:, -1:]
        result[f"{label}_max_abs_error"] = float((ours.float() - want).abs().max())
    if device.type == "cuda":
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

        for label, q in (("chunk", query), ("decode", query[:, :, -1:])):
            # as CausalBias dispatches a lower-right mask: no mask, not is_causal (the kernel's own causal
            # flag is lower-right)
            params = SDPAParams(q, key, value, None, 0.0, False, True)
            result[f"{label}_flash_usable"] = bool(can_use_flash_attention(params, False))
            result[f"{label}_efficient_usable"] = bool(can_use_efficient_attention(params, False))
    return result


def measure_prefill(
    model: LlamaForCausalLM, engine: Engine, lengths: tuple[int, ...], device: torch.device, clock: Clock,
    report: Report,
) -> list[dict[str, Any]]:  # fmt: skip
    points: list[dict[str, Any]] = report.data.setdefault("prefill", [])
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    time_prefill(model, random_ids(generator, vocab, (1, engine.max_batched_tokens + 100), device), engine,
                 device, runs=0)  # fmt: skip
    last_s: tuple[int, float] | None = None
    for length in lengths:
        predicted = engine.prefill_s(1, length)
        # a guess of this point's time (warm-up + runs), from the last point, growing at most quadratically
        guess = (RUNS + 1) * (last_s[1] * (length / last_s[0]) ** 2 if last_s else predicted * 3)
        if clock.left_s() - RESERVE_S < guess:
            say(f"prefill L={length}: skipped, {clock.left_s():.0f} s of budget left, ~{guess:.0f} s needed")
            report.data.setdefault("skipped", []).append(f"prefill L={length}: budget")
            break
        try:
            runs = time_prefill(model, random_ids(generator, vocab, (1, length), device), engine, device)
        except torch.OutOfMemoryError as error:
            say(f"prefill L={length}: out of memory: {error}")
            report.data.setdefault("skipped", []).append(f"prefill L={length}: out of memory: {error}")
            break
        median = statistics.median(runs)
        last_s = (length, median)
        point = {
            "prompt_tokens": length,
            "chunks": math.ceil(length / engine.max_batched_tokens),
            "runs_s": runs,
            "ttft_s": median,
            "profile_ttft_s": predicted,
            "measured_over_profile": median / predicted,
            "tokens_per_s": length / median,
        }
        points.append(point)
        report.write()
        say(f"prefill L={length}: {median * 1000:.1f} ms (profile {predicted * 1000:.1f} ms), runs "
            + ", ".join(f"{r * 1000:.1f}" for r in runs))  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return points


def fit_ttft(points: list[dict[str, Any]], engine: Engine) -> dict[str, Any]:
    """Least squares (absolute seconds) of TTFT = a x chunks + L / rate + p x L(L+1)/2: a free, and a fixed at
    the profile's decode_step_s."""
    if len(points) < 3:
        return {"error": f"{len(points)} points: too few to fit"}
    lengths = np.array([p["prompt_tokens"] for p in points], dtype=float)
    chunks = np.array([p["chunks"] for p in points], dtype=float)
    ttft = np.array([p["ttft_s"] for p in points], dtype=float)
    pairs = lengths * (lengths + 1) / 2
    free, *_ = np.linalg.lstsq(np.stack([chunks, lengths, pairs], axis=1), ttft, rcond=None)
    fixed, *_ = np.linalg.lstsq(
        np.stack([lengths, pairs], axis=1), ttft - engine.decode_step_s * chunks, rcond=None
    )

    def described(a: float, per_token: float, p: float) -> dict[str, Any]:
        fitted = a * chunks + per_token * lengths + p * pairs
        return {
            "a_s_per_chunk": a,
            "rate_tokens_per_s": 1.0 / per_token if per_token > 0 else None,
            "p_s_per_pair": p,
            "relative_errors": [float(e) for e in (fitted - ttft) / ttft],
        }

    return {
        "formula": "TTFT = a x ceil(L / max_batched_tokens) + L / rate + p x L(L+1)/2, least squares (s)",
        "a_free": described(float(free[0]), float(free[1]), float(free[2])),
        "a_fixed_at_profile": described(engine.decode_step_s, float(fixed[0]), float(fixed[1])),
        "profile": {
            "a_s_per_chunk": engine.decode_step_s,
            "rate_tokens_per_s": engine.prefill_tokens_per_s,
            "p_s_per_pair": engine.attention_s_per_pair,
        },
    }


def measure_batched_prefill(
    model: LlamaForCausalLM, engine: Engine, prompts: int, tokens_each: int, device: torch.device
) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(2)
    ids = random_ids(generator, model.config.vocab_size, (prompts, tokens_each), device)

    def forward() -> torch.Tensor:
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    timed_s(device, forward)
    runs = [timed_s(device, forward) for _ in range(RUNS + 2)]
    median = statistics.median(runs)
    predicted = engine.prefill_s(prompts, tokens_each)
    tokens = prompts * tokens_each
    return {
        "prompts": prompts,
        "tokens_each": tokens_each,
        "runs_s": runs,
        "step_s": median,
        "tokens_per_s": tokens / median,
        "profile_step_s": predicted,
        "profile_tokens_per_s": tokens / predicted,
        "profile_formula": "decode_step_s + tokens / prefill_tokens_per_s + attention_s_per_pair x prompts x "
        "n(n+1)/2",
    }


def static_cache(model: LlamaForCausalLM, batch: int, length: int, device: torch.device) -> StaticCache:
    """A StaticCache of exactly `length` tokens a sequence, allocated now (its contents do not matter)."""
    config = model.config
    cache = StaticCache(config=config, max_cache_len=length)
    cache.early_initialization(
        batch_size=batch,
        num_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=model.dtype,
        device=device,
    )
    return cache


def set_cached(cache: StaticCache, tokens: int) -> None:
    """Rewinds every layer to `tokens` cached, so each step writes position `tokens` and reads tokens + 1."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(tokens)


def event_timed_s(device: torch.device, before: Callable[[], object], run: Callable[[], object]) -> float:
    """`run`'s time alone; `before` (a rewind) runs first, outside the timing."""
    before()
    if device.type != "cuda":
        return timed_s(device, run)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def capture_graph(step: Callable[[], torch.Tensor], rewind: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """The step captured in a CUDA graph, after warm-up steps on a side stream (as PyTorch requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            rewind()
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    rewind()
    with torch.cuda.graph(graph):
        step()
    return graph


def measure_decode_point(
    model: LlamaForCausalLM, engine: Engine, batch: int, context: int, device: torch.device, graphs: bool
) -> dict[str, Any]:
    """Steps of `batch` sequences, each with `context` tokens cached and one new: eager, then a CUDA graph."""
    cache = static_cache(model, batch, context + 1, device)
    generator = torch.Generator().manual_seed(3)
    ids = random_ids(generator, model.config.vocab_size, (batch, 1), device)
    positions = torch.full((batch, 1), context, dtype=torch.long, device=device)

    def step() -> torch.Tensor:
        return model(
            input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
        ).logits

    def rewind() -> None:
        set_cached(cache, context)

    for _ in range(3):
        event_timed_s(device, rewind, step)
    eager = [event_timed_s(device, rewind, step) for _ in range(DECODE_EAGER_STEPS)]
    point: dict[str, Any] = {
        "batch": batch,
        "context_each": context,
        "eager_step_s": statistics.median(eager),
        "eager_steps_s_quartiles": [float(q) for q in np.percentile(eager, [25, 75])],
        "profile_step_s": engine.decode_s(batch, context + 1),
    }
    if graphs:
        try:
            graph = capture_graph(step, rewind)
            for _ in range(3):
                event_timed_s(device, rewind, graph.replay)
            replays = [event_timed_s(device, rewind, graph.replay) for _ in range(DECODE_GRAPH_STEPS)]
            point["graph_step_s"] = statistics.median(replays)
            point["graph_steps_s_quartiles"] = [float(q) for q in np.percentile(replays, [25, 75])]
            point["graph_over_profile"] = point["graph_step_s"] / point["profile_step_s"]
        except Exception as error:  # report and go on with the eager figure
            point["graph_error"] = f"{type(error).__name__}: {error}"
    return point


def measure_decode(
    model: LlamaForCausalLM, engine: Engine, contexts: tuple[int, ...], device: torch.device, clock: Clock,
    report: Report,
) -> None:  # fmt: skip
    points: list[dict[str, Any]] = report.data.setdefault("decode", [])
    config = model.config
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    graphs = device.type == "cuda"
    for context in contexts:
        for batch in DECODE_BATCHES:
            label = f"decode b={batch} C={context}"
            if clock.left_s() < 15:
                say(f"{label}: skipped, {clock.left_s():.0f} s of budget left")
                report.data.setdefault("skipped", []).append(f"{label}: budget")
                continue
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                need = batch * (context + 1) * kv_bytes_per_token
                if need > 0.8 * free:
                    say(f"{label}: skipped, KV {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
                    report.data.setdefault("skipped", []).append(f"{label}: memory")
                    continue
            try:
                point = measure_decode_point(model, engine, batch, context, device, graphs)
            except torch.OutOfMemoryError as error:
                say(f"{label}: out of memory: {error}")
                report.data.setdefault("skipped", []).append(f"{label}: out of memory")
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            points.append(point)
            report.write()
            graphs = graphs and "graph_error" not in point  # one failed capture: eager only from then on
            graph = (
                f"graph {point['graph_step_s'] * 1000:.2f} ms"
                if "graph_step_s" in point
                else f"graph: {point.get('graph_error', 'none')}"
            )
            say(f"{label}: eager {point['eager_step_s'] * 1000:.2f} ms, {graph} "
                f"(profile {point['profile_step_s'] * 1000:.2f} ms)")  # fmt: skip


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import importlib.util

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": str(device),
        "dtype": str(dtype),
        "flash_attn_package": importlib.util.find_spec("flash_attn") is not None,
        "attention": f"{ATTENTION}: torch scaled_dot_product_attention, enable_gqa, lower-right causal "
        "(torch.nn.attention.bias.causal_lower_right) for chunks after the first, no mask for decode",
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        facts["gpu"] = properties.name
        facts["gpu_memory_gib"] = properties.total_memory / 2**30
    return facts


def section(report: Report, device: torch.device, name: str, run: Callable[[], None]) -> None:
    """One part of the measurements; a failure is reported and the next part runs."""
    try:
        run()
    except Exception as error:
        say(f"{name} failed: {type(error).__name__}: {error}")
        report.data.setdefault("errors", {})[name] = traceback.format_exc()
    finally:
        report.write()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def prefill_section(
    model: LlamaForCausalLM, engine: Engine, lengths: tuple[int, ...], device: torch.device, clock: Clock,
    report: Report,
) -> None:  # fmt: skip
    points = measure_prefill(model, engine, lengths, device, clock, report)
    report.data["prefill_fit"] = fit_ttft(points, engine)
    say(f"prefill fit: {json.dumps(report.data['prefill_fit'])}")


def batched_section(
    model: LlamaForCausalLM, engine: Engine, shape: tuple[int, int], device: torch.device, clock: Clock,
    report: Report,
) -> None:  # fmt: skip
    if clock.left_s() < 20:
        report.data.setdefault("skipped", []).append("batched prefill: budget")
        return
    prompts, tokens_each = shape
    batched = measure_batched_prefill(model, engine, prompts, tokens_each, device)
    report.data["batched_prefill"] = batched
    say(f"batched prefill {prompts} x {tokens_each}: {batched['tokens_per_s']:,.0f} tokens/s "
        f"(profile {batched['profile_tokens_per_s']:,.0f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=Path("configs/profiles/h100-llama-3.1-8b.json"))
    default_out = Path(os.environ["OUT"]) / "gpu_forward.json" if os.environ.get("OUT") else None
    parser.add_argument(
        "--out", type=Path, default=default_out, help="the JSON results ($OUT/gpu_forward.json)"
    )
    parser.add_argument("--budget-s", type=float, default=360.0, help="no new point starts after this")
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer model and short prompts: a quick check"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    clock = Clock(args.budget_s)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    engine = Engine.load(args.profile)
    report = Report(args.out, {"profile": str(args.profile), "engine": engine.__dict__, "tiny": args.tiny})
    report.data["environment"] = environment(device, dtype)
    say(json.dumps(report.data["environment"]))

    try:
        report.data["attention_check"] = check_attention(device, dtype)
    except Exception as error:  # a check only: the timings do not depend on it
        report.data["attention_check"] = {"error": f"{type(error).__name__}: {error}"}
    say(f"attention check: {report.data['attention_check']}")

    config = llama_config(args.tiny)
    started = time.perf_counter()
    model = build_model(config, device, dtype)
    sync(device)
    build_s = time.perf_counter() - started
    parameters = sum(p.numel() for p in model.parameters())
    report.data.update(model_parameters=parameters, model_build_s=build_s, config=config.to_dict())
    say(f"model: {parameters:,} parameters, built in {build_s:.1f} s")
    report.write()

    lengths = TINY_PREFILL_LENGTHS if args.tiny else PREFILL_LENGTHS
    prefill_engine = Engine(**{**engine.__dict__, "max_batched_tokens": 128}) if args.tiny else engine
    batched_shape = (4, 32) if args.tiny else (BATCHED_PROMPTS, BATCHED_PROMPT_TOKENS)
    contexts = TINY_DECODE_CONTEXTS if args.tiny else DECODE_CONTEXTS
    with torch.inference_mode():
        section(
            report,
            device,
            "prefill",
            lambda: prefill_section(model, prefill_engine, lengths, device, clock, report),
        )
        section(
            report,
            device,
            "batched prefill",
            lambda: batched_section(model, engine, batched_shape, device, clock, report),
        )
        section(
            report, device, "decode", lambda: measure_decode(model, engine, contexts, device, clock, report)
        )

    if device.type == "cuda":
        report.data["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    report.data["elapsed_s"] = clock.elapsed_s()
    report.write()
    say(f"done in {clock.elapsed_s():.0f} s" + (f"; results in {args.out}" if args.out else ""))


if __name__ == "__main__":
    sys.exit(main())
