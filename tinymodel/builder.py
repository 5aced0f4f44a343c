"""A tiny random-weight Llama, built locally because nothing can be downloaded.

Its token counts, prefill work and KV events are real; its output text is gibberish. The same directory
serves the simulated fleet, the router's tokenizer and real vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

MODEL_NAME = "tiny-llama"
VOCAB_SIZE = 512
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 64  # the CPU attention backend is known to work with 64
MAX_POSITIONS = 32768
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")

# Rendered by transformers exactly as vLLM renders it; BOS comes from the template, so vLLM tokenizes the
# rendered chat with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|tools|>\\n' }}{% for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}"
    "{{ eos_token + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['reasoning'] is defined %}"
    "{{ '<think>' + message['reasoning'] + '</think>\\n' }}"
    "{% endif %}"
    "{% if message['tool_call_id'] %}{{ '[' + message['tool_call_id'] + '] ' }}{% endif %}"
    "{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}{{ '\\n<call>' + call | tojson + '</call>' }}{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>\\n' }}{% endif %}"
    "{% endif %}"
)

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}

_CORPUS = """\
You are a careful coding agent. Read the repository, run the tests, and fix the failing function.
The user asks for a patch; the assistant answers with a plan, a diff and the test output.
def route(request, instances): return min(instances, key=lambda i: i.queue_depth)
Traceback (most recent call last): File "app.py", line 42, in handler: KeyError: 'model'
The quick brown fox jumps over the lazy dog while the cache keeps every block it has computed.
{"role": "tool", "content": "exit code 0, 128 passed, 3 skipped in 4.21s"}
SELECT id, name FROM users WHERE created_at > now() - interval '1 day' ORDER BY id;
0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ !?.,;:-_+=*/()[]{}<>'"#@$%&|~^`\\
"""


def default_home() -> Path:
    return Path(os.environ.get("KVROUTE_HOME", Path.home() / ".cache" / "kvroute"))


def model_dir(home: Path | None = None) -> Path:
    return (home or default_home()) / "models" / MODEL_NAME


def ensure_model(home: Path | None = None) -> Path:
    """Return the tiny model's directory, building it first if it is missing."""
    target = model_dir(home)
    if (target / "config.json").exists():
        _refresh_chat_template(target)
        return target
    return built_once(target, "config.json", build_model)


def built_once(target: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """target, built by build in a staging directory beside it and renamed into place, so that a reader
    never sees half of it and concurrent builders leave one; marker: a file the whole build holds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build(staging)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not (target / marker).exists():  # not a concurrent builder winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _refresh_chat_template(directory: Path) -> None:
    """A model built by an older kvroute gets this one's template (tools were added later), atomically, as
    a vLLM serving it may be reading the file."""
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.get("chat_template") == CHAT_TEMPLATE:
        return
    config["chat_template"] = CHAT_TEMPLATE
    staging = config_path.with_name(f".tokenizer_config.{os.getpid()}.json")
    staging.write_text(json.dumps(config, indent=2))
    staging.replace(config_path)


def build_model(directory: Path) -> None:
    build_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    )
    _build_weights(directory)


def build_tokenizer(directory: Path, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> None:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # torch is not needed here
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(str(directory))
    # Written by hand so that transformers 4.x (vLLM's) and 5.x read the same class and template.
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2))


def _build_weights(directory: Path) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    q_dim, kv_dim = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": dense(VOCAB_SIZE, HIDDEN),
        "model.norm.weight": np.ones(HIDDEN, dtype=np.float32),
        "lm_head.weight": dense(VOCAB_SIZE, HIDDEN),
    }
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "self_attn.q_proj.weight"] = dense(q_dim, HIDDEN)
        tensors[prefix + "self_attn.k_proj.weight"] = dense(kv_dim, HIDDEN)
        tensors[prefix + "self_attn.v_proj.weight"] = dense(kv_dim, HIDDEN)
        tensors[prefix + "self_attn.o_proj.weight"] = dense(HIDDEN, q_dim)
        tensors[prefix + "mlp.gate_proj.weight"] = dense(INTERMEDIATE, HIDDEN)
        tensors[prefix + "mlp.up_proj.weight"] = dense(INTERMEDIATE, HIDDEN)
        tensors[prefix + "mlp.down_proj.weight"] = dense(HIDDEN, INTERMEDIATE)
        tensors[prefix + "input_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        tensors[prefix + "post_attention_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
