"""A hybrid model's prefix hits, as the installed vLLM's KV cache manager finds them, against what the index
credits from the same manager's KV events: a sliding-window group and a Mamba group beside full attention,
under memory pressure that evicts the groups' blocks apart (tests/router/index/test_kv_groups.py has the cases)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvroute.stack.config import load_stack_config
from router.index.block_index import BlockIndex
from router.index.events import EventDecoder
from router.prompt import block_hashing
from tests.stack.conftest import CONFIG, REPO

pytestmark = pytest.mark.stack

BLOCK = 16


def vllm_run(second_group: str, seed: int) -> list[dict[str, object]]:
    spec = {"second_group": second_group, "block_size": BLOCK, "num_blocks": 120, "seed": seed}
    answer = subprocess.run(
        [
            str(load_stack_config(CONFIG).python_path(REPO)),
            str(Path(__file__).with_name("vllm_hybrid_hits.py")),
        ],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    return json.loads(answer.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("second_group", ["sliding_window", "mamba"])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_index_credits_the_hits_the_engine_finds(second_group: str, seed: int) -> None:
    index, decoder = BlockIndex(BLOCK), EventDecoder()
    compared = 0
    for step in vllm_run(second_group, seed):
        if step["batch"] is not None:
            index.apply(("engine", 0), decoder.decode(bytes.fromhex(str(step["batch"]))).events)
        for tokens, hit_tokens in step["probes"]:  # type: ignore[attr-defined]
            reusable = (
                len(tokens) - 1
            ) // BLOCK  # as the router asks: vLLM's lookup stops before the last token
            matched = index.match(block_hashing.chain(tokens, BLOCK), reusable=reusable).get("engine")
            credited = 0 if matched is None else matched.gpu * BLOCK
            assert credited == hit_tokens, (step, tokens[:8])
            compared += 1
    assert compared == 140
