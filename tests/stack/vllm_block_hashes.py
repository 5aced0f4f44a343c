"""Run by the stack's Python (tests/stack/test_block_hashes.py): the block hashes the installed vLLM computes
for each case on stdin ({"block_size", "cases": [{"algorithm", "tokens", "lora": [name, path] | null,
"salt"}]}), through its own Request and request block hasher, as hex, one list per case, on stdout."""

import json
import sys

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

spec = json.loads(sys.stdin.read())
hashes = []
for case in spec["cases"]:
    hash_fn = get_hash_fn_by_name(case["algorithm"])
    kv_cache_utils.init_none_hash(hash_fn)  # from PYTHONHASHSEED, as an engine does at start
    lora = LoRARequest(case["lora"][0], 1, case["lora"][1]) if case["lora"] else None
    request = Request(
        "r",
        case["tokens"],
        SamplingParams(max_tokens=1),
        None,
        lora_request=lora,
        cache_salt=case["salt"],
        block_hasher=kv_cache_utils.get_request_block_hasher(spec["block_size"], hash_fn),
    )
    hashes.append([bytes(h).hex() for h in request.block_hashes])
print(json.dumps(hashes))
