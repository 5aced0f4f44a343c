"""The simulated fleet's block hashes against the installed vLLM's own, for both of its cryptographic hash
algorithms, with and without a LoRA adapter and a cache_salt (tests/fleet/test_block_hashes.py checks the
default one against captured events; this reaches what no capture holds)."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from fleet.block_pool import HASH_ALGORITHMS, Adapter, BlockHasher
from kvroute.stack.config import load_stack_config
from tests.stack.conftest import CONFIG, REPO

pytestmark = pytest.mark.stack

BLOCK = 16
SEED = "0"


def test_the_fleet_hashes_blocks_as_the_installed_vllm_does() -> None:
    rng = random.Random(7)
    cases = [
        {
            "algorithm": algorithm,
            "tokens": [rng.randrange(32_000) for _ in range(length)],
            "lora": lora,
            "salt": salt,
        }
        for algorithm in HASH_ALGORITHMS
        for length, lora, salt in [
            (80, None, None),
            (70, ["sql", "/adapters/sql"], None),
            (65, None, "tenant-a"),
            (48, ["sql", "/adapters/sql"], "tenant-b"),
        ]
    ]
    answer = subprocess.run(
        [
            str(load_stack_config(CONFIG).python_path(REPO)),
            str(Path(__file__).with_name("vllm_block_hashes.py")),
        ],
        input=json.dumps({"block_size": BLOCK, "cases": cases}),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": SEED},
    )
    expected: list[list[str]] = json.loads(answer.stdout.strip().splitlines()[-1])
    for case, vllm_hashes in zip(cases, expected, strict=True):
        lora = Adapter(case["lora"][0], 1, case["lora"][1]) if case["lora"] else None
        ours = BlockHasher(SEED, case["algorithm"]).chain(case["tokens"], BLOCK, salt=case["salt"], lora=lora)
        assert len(vllm_hashes) == len(case["tokens"]) // BLOCK
        assert [h.hex() for h in ours] == vllm_hashes, case
