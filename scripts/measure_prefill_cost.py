"""What a real vLLM's prefill costs as the context before the new tokens grows.

Starts the real stack (configs/stack-cpu.yaml, `make stack-env model`) and asks its first instance, directly,
for one token after prompts of token ids: a prefix of C tokens first (which the engine then holds), then
the same prefix followed by N new tokens, timing the first streamed chunk. Then fits the TTFTs two ways, on
relative error as kvroute's TTFT model does: flat (overhead + rate x N) and with attention (+ rate x the
pairs each new token reads: N x (C + (N + 1) / 2)), on even samples, and reports both fits' errors on the
odd ones; then replays the samples in order through kvroute's own TTFT model (online calibration from its
default priors, the attention term off and on) and reports its errors, predicted before each observation,
over the second half.

    .venv/bin/python scripts/measure_prefill_cost.py --repeats 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvroute.processes import free_port_block  # noqa: E402
from kvroute.stack.config import load_stack_config  # noqa: E402
from kvroute.stack.run import running_stack  # noqa: E402
from scorers.ttft_model import TTFTFeatures, TTFTModel, TTFTPriors, attention_pairs  # noqa: E402
from tinymodel.builder import MODEL_NAME, VOCAB_SIZE, ensure_model  # noqa: E402

CACHED = (0, 1024, 2048, 3072)
NEW = (64, 256, 512, 896)
MAX_MODEL_LEN = 4096  # configs/stack-cpu.yaml's --max-model-len
PAUSE_S = 0.2  # between requests: each finds the engine idle, its writes to the pool done


async def ttft_s(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for _ in response.content.iter_any():
            return time.perf_counter() - started
    raise RuntimeError("the stream ended without a chunk")


async def measure(url: str, repeats: int, seed: int) -> list[tuple[int, int, float]]:
    """(cached, new, seconds) samples, the grid in a shuffled order per repeat."""
    rng = random.Random(seed)
    grid = [(c, n) for c in CACHED for n in NEW if c + n < MAX_MODEL_LEN]
    samples = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for _ in range(3):  # warm-up: the first requests compile and allocate
            await ttft_s(session, url, [rng.randrange(3, VOCAB_SIZE) for _ in range(256)])
        for repeat in range(repeats):
            rng.shuffle(grid)
            for cached, new in grid:
                prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(cached)]
                if prefix:
                    await ttft_s(session, url, prefix)
                    await asyncio.sleep(PAUSE_S)
                seconds = await ttft_s(
                    session, url, prefix + [rng.randrange(3, VOCAB_SIZE) for _ in range(new)]
                )
                samples.append((cached, new, seconds))
                await asyncio.sleep(PAUSE_S)
                print(
                    json.dumps({"repeat": repeat, "cached": cached, "new": new, "ttft_s": round(seconds, 4)})
                )
    return samples


def fit_errors(samples: list[tuple[int, int, float]]) -> dict[str, dict[str, object]]:
    """Each model's rates, fitted on the even samples by least squares on relative error, and its mean,
    median and worst relative error on the odd ones."""
    x = np.array([[1.0, new, attention_pairs(cached, new)] for cached, new, _ in samples])
    y = np.array([seconds for *_, seconds in samples])
    train, test = slice(0, None, 2), slice(1, None, 2)
    results: dict[str, dict[str, object]] = {}
    for name, columns in (("flat", [0, 1]), ("attention", [0, 1, 2])):
        a = x[:, columns] / y[:, None]
        rates, *_ = np.linalg.lstsq(a[train], np.ones(len(y))[train], rcond=None)
        error = np.abs(x[test][:, columns] @ rates / y[test] - 1)
        results[name] = {
            "rates": dict(
                zip(("overhead_s", "per_token_s", "per_pair_s")[: len(columns)], rates.tolist(), strict=True)
            ),
            "mean_relative_error": float(error.mean()),
            "median_relative_error": float(np.median(error)),
            "max_relative_error": float(error.max()),
        }
    return results


def online_errors(samples: list[tuple[int, int, float]], attention_prior: float) -> dict[str, float]:
    """kvroute's TTFT model as the router runs it: predict, then observe, sample by sample."""
    model = TTFTModel(TTFTPriors(attention_s_per_pair=attention_prior))
    errors = []
    for cached, new, seconds in samples:
        features = TTFTFeatures(0, new, 0, attention_pairs=attention_pairs(cached, new))
        errors.append(abs(model.predict(features) / seconds - 1))
        model.observe(features, seconds)
    late = np.array(errors[len(errors) // 2 :])
    return {"median_relative_error": float(np.median(late)), "mean_relative_error": float(late.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ensure_model()
    config = load_stack_config(REPO / "configs" / "stack-cpu.yaml")
    config = config.with_ports(free_port_block(config.port_count()))
    with running_stack(config, Path(tempfile.mkdtemp(prefix="prefill-cost-")), base_dir=REPO) as stack:
        samples = asyncio.run(measure(stack.instances[0].url, args.repeats, args.seed))
    by_cell: dict[tuple[int, int], list[float]] = {}
    for cached, new, seconds in samples:
        by_cell.setdefault((cached, new), []).append(seconds)
    for (cached, new), cell in sorted(by_cell.items()):
        print(f"cached {cached:5d}  new {new:4d}  TTFT median {1000 * float(np.median(cell)):7.1f} ms")
    print(json.dumps(fit_errors(samples), indent=2))
    online = {f"attention prior {prior:g}": online_errors(samples, prior) for prior in (0.0, 1e-9, 1e-8)}
    print(json.dumps({"kvroute TTFT model, online": online}, indent=2))


if __name__ == "__main__":
    main()
