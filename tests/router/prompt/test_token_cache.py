"""The cached chat tokenizer equals a full tokenization every time, reuses what it has seen, stays bounded."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from router.prompt.chat_conversation import InvalidPrompt
from router.prompt.template_inputs import TemplateInputs
from router.prompt.token_cache import WHOLE_TEXT_MAX_BYTES, CachedChatTokenizer, cut_tokens, special_affixes
from router.prompt.tokenization import PromptTokenizer
from tinymodel.builder import CHAT_TEMPLATE

CAPTURE = Path(__file__).parents[2] / "fixtures" / "vllm" / "capture_int.json"
Messages = list[dict[str, Any]]

WORDS = "the cache router token block prefix engine worker def return self import error test".split()
PIECES = [
    "hello",
    " world",
    "\n",
    "\n\n",
    "  ",
    "\t",
    "\r\n",
    "é",
    "e\u0301",
    "n\u0303\u0323",
    "🙂",
    "👍🏽",
    "👨\u200d👩\u200d👧",
    "日本語",
    "שלום",
    "\u200b",
    "ﬁ",
    "</s>",
    "<s>",
    "<pad>",
    "</s",
    "s>",
    "<",
    ">",
    "<|user|>\n",
    "def f(x):\n    return x",
    " </s> ",
    "</s></s>",
    "<</s>>",
]


def random_content(rng: random.Random) -> Any:
    shape = rng.random()
    if shape < 0.05:
        return None
    if shape < 0.1:
        return ""
    if shape < 0.13:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2000, 4000)))  # very long
    text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
    if shape < 0.25:
        return [{"type": "text", "text": text}, {"type": "text", "text": rng.choice(PIECES)}]
    return text


def reference(tokenizer: PromptTokenizer, messages: Messages, **flags: bool) -> list[int] | type[Exception]:
    try:
        return tokenizer.chat_ids(messages, **flags)
    except (InvalidPrompt, ValueError) as exc:  # transformers rejects some continue_final_message chats
        return type(exc)


def check(cached: CachedChatTokenizer, messages: Messages, **flags: bool) -> None:
    expected = reference(cached.tokenizer, messages, **flags)
    if isinstance(expected, list):
        assert cached.chat_ids(messages, **flags) == expected, (messages, flags)
    else:
        with pytest.raises(expected):
            cached.chat_ids(messages, **flags)


def play_session(cached: CachedChatTokenizer, rng: random.Random, turns: int, system: str | None) -> Messages:
    """An agent loop: every turn resends the history plus one message, checked against a full tokenization."""
    messages: Messages = [] if system is None else [{"role": "system", "content": system}]
    for _ in range(turns):
        messages.append({"role": rng.choice(["user", "user", "tool"]), "content": random_content(rng)})
        mode = rng.random()
        if mode < 0.15:
            check(cached, messages, add_generation_prompt=False)
        elif mode < 0.3:
            messages.append({"role": "assistant", "content": random_content(rng)})
            check(cached, messages, add_generation_prompt=False, continue_final_message=True)
            continue
        else:
            check(cached, messages)
        messages.append({"role": "assistant", "content": random_content(rng)})
    return messages


def with_template(model_dir: Path, directory: Path, template: str) -> PromptTokenizer:
    """The tiny model's tokenizer, copied into directory with another chat template."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((model_dir / name).read_bytes())
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return PromptTokenizer(directory)


@pytest.fixture
def cached(tokenizer: PromptTokenizer) -> CachedChatTokenizer:
    return CachedChatTokenizer(tokenizer)


def test_the_tiny_tokenizer_cuts_after_each_special_token(cached: CachedChatTokenizer) -> None:
    assert cached.cut_tokens == {"<s>", "</s>", "<pad>"}


@pytest.mark.parametrize("seed", range(8))
def test_sessions_through_one_cache_equal_full_tokenization(cached: CachedChatTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    systems = [None, "", "You are a careful coding agent.\n", " 🙂 </s> <s>"]
    sessions = [play_session(cached, rng, rng.randint(3, 12), rng.choice(systems)) for _ in range(4)]
    for messages in sessions:  # come back to each: an edit early in the history, then a new turn
        edited = [dict(m) for m in messages]
        index = rng.randrange(len(edited))
        edited[index]["content"] = "edited" + (rng.choice(PIECES) if edited[index]["content"] else "")
        check(cached, edited)
        check(cached, [*messages, {"role": "user", "content": random_content(rng)}])
    assert cached.stats.hits > 0


def test_sessions_on_several_threads_through_one_cache_equal_full_tokenization(
    cached: CachedChatTokenizer,
) -> None:
    """The router tokenizes long prompts on a worker thread and short ones on the event loop, both through
    one cache: sessions played on four threads at once, sharing system prompts, each turn checked."""
    systems = ["You are a careful coding agent.\n" * 20, " 🙂 </s> <s>" * 30]
    failures: list[BaseException] = []

    def play(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(3):
                play_session(cached, rng, rng.randint(4, 10), rng.choice(systems))
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=play, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures[0]
    assert cached.stats.hits > 0
    assert 0 < cached.cached_tokens <= cached.max_tokens


def test_a_long_session_encodes_only_each_turns_tail(cached: CachedChatTokenizer) -> None:
    tokenizer = cached.tokenizer
    messages: Messages = [{"role": "system", "content": "You are a careful coding agent. " * 40}]
    previous = ""
    for turn in range(30):
        messages.append({"role": "user", "content": f"Turn {turn}: run the tests. " * 20})
        before = (cached.stats.tokens_reused, cached.stats.tokens_encoded)
        ids = cached.chat_ids(messages)
        reused, encoded = cached.stats.tokens_reused - before[0], cached.stats.tokens_encoded - before[1]
        assert ids == tokenizer.chat_ids(messages)
        # Everything up to the previous request's last </s> is reused; the rest is encoded.
        seen = previous[: previous.rfind("</s>") + len("</s>")] if previous else ""
        assert reused == len(tokenizer.text_ids(seen, add_special_tokens=False))
        assert encoded == len(ids) - reused
        previous = tokenizer.render_chat(messages)
        messages.append({"role": "assistant", "content": f"Ran them; {turn} failures left.\n" * 30})
    assert reused > 0.95 * len(ids) and len(ids) > 10_000
    assert cached.stats.requests == 30 and cached.stats.hits == 29


def test_a_chat_sent_again_is_not_encoded_again(cached: CachedChatTokenizer) -> None:
    messages = [{"role": "user", "content": "The same question. " * 30}]
    first = cached.chat_ids(messages)
    encoded = cached.stats.tokens_encoded
    again = cached.chat_ids(messages)
    assert again == first == cached.tokenizer.chat_ids(messages)
    assert cached.stats.tokens_encoded == encoded and cached.stats.tokens_reused == len(first)
    again.append(-1)  # the caller's own list
    assert cached.chat_ids(messages) == first


def test_a_chat_sent_again_is_not_rendered_again(cached: CachedChatTokenizer) -> None:
    """Keyed by its messages, tools, kwargs and flags too: each differing input is rendered, the same ones
    once; a list of messages edited in place after a request is a new chat."""
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]
    messages: Messages = [{"role": "user", "content": "Run the tests, then fix them. " * 20}]
    variants: list[dict[str, Any]] = [
        {},
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"inputs": TemplateInputs(tools=tools)},
        {"inputs": TemplateInputs(template_kwargs={"enable_thinking": True})},
        {"inputs": TemplateInputs(calls_as_given=True)},
    ]
    for flags in variants:
        first = cached.chat_ids(messages, **flags)
        assert first == cached.tokenizer.chat_ids(messages, **flags), flags
    assert cached.stats.renders_skipped == 0
    for flags in variants:
        assert cached.chat_ids(messages, **flags) == cached.tokenizer.chat_ids(messages, **flags), flags
    assert cached.stats.renders_skipped == len(variants)
    messages[0]["content"] = "Now only the failing one."
    assert cached.chat_ids(messages) == cached.tokenizer.chat_ids(messages)
    assert cached.stats.renders_skipped == len(variants)
    long = [{"role": "user", "content": "An agent's long history. " * 2_000}]  # past WHOLE_TEXT_MAX_BYTES
    assert cached.chat_ids(long) == cached.chat_ids(long) == cached.tokenizer.chat_ids(long)
    assert cached.stats.renders_skipped == len(variants)


@pytest.mark.parametrize("call", ["strftime_now('%d %b %Y')", "[1, 2, 3] | random", "lipsum(1)"])
def test_a_template_that_may_render_a_chat_otherwise_renders_it_every_time(
    model_dir: Path, tmp_path: Path, call: str
) -> None:
    template = "{{ " + call + " }}</s>{% for m in messages %}{{ m.content }}</s>{% endfor %}"
    cached = CachedChatTokenizer(with_template(model_dir, tmp_path, template))
    messages = [{"role": "user", "content": "hi"}]
    cached.chat_ids(messages)
    cached.chat_ids(messages)
    assert cached.stats.renders_skipped == 0 and cached.stats.requests == 2


def test_a_chat_of_other_than_plain_data_is_rendered_every_time(cached: CachedChatTokenizer) -> None:
    class Text:
        def __str__(self) -> str:
            return "an object the template prints"

    messages = [{"role": "user", "content": "hi", "name": Text()}]
    assert cached.chat_ids(messages) == cached.chat_ids(messages) == cached.tokenizer.chat_ids(messages)
    assert cached.stats.renders_skipped == 0


def test_a_chat_too_deep_to_key_is_rendered_every_time(cached: CachedChatTokenizer) -> None:
    """A field the template never reads may nest deeper than the key's encoding goes: the chat is rendered."""
    deep: Any = []
    for _ in range(995):
        deep = [deep]
    messages = [{"role": "user", "content": "hi", "metadata": deep}]
    assert cached.chat_ids(messages) == cached.chat_ids(messages) == cached.tokenizer.chat_ids(messages)
    assert cached.stats.renders_skipped == 0


def test_a_long_sessions_earlier_turns_are_freed_as_it_grows(cached: CachedChatTokenizer) -> None:
    """Past WHOLE_TEXT_MAX_BYTES a chat's whole text is no key of its own: each turn takes over the earlier
    turn's prefixes, whose ids are then freed, and the session holds one turn's ids at a time."""
    messages: Messages = [{"role": "system", "content": "Long instructions. " * 2_000}]
    assert len(cached.tokenizer.render_chat(messages).encode()) > WHOLE_TEXT_MAX_BYTES
    for turn in range(5):
        messages.append({"role": "user", "content": f"Turn {turn}: fix the next test."})
        ids = cached.chat_ids(messages)
        assert ids == cached.tokenizer.chat_ids(messages)
        assert cached.cached_tokens == len(ids)
        messages.append({"role": "assistant", "content": f"Fixed test {turn}."})
    sent_again = cached.stats.tokens_encoded
    assert cached.chat_ids(messages[:-1]) == ids and cached.stats.tokens_encoded > sent_again  # its tail


def test_a_chat_extending_one_that_ended_between_cuts_reuses_only_up_to_its_last_cut(
    cached: CachedChatTokenizer,
) -> None:
    """The earlier chat's whole text is cached, but it ends in the middle of what the longer one encodes
    (its end is no cut of the longer one): only what precedes its last cut token (<s>) is reused."""
    tokenizer = cached.tokenizer
    short = [{"role": "user", "content": "Look at main.py"}]
    cached.chat_ids(short, add_generation_prompt=False, continue_final_message=True)
    longer = [{"role": "user", "content": "Look at main.py and then at the tests"}]
    before = cached.stats.tokens_reused
    ids = cached.chat_ids(longer, add_generation_prompt=False, continue_final_message=True)
    assert ids == tokenizer.chat_ids(longer, add_generation_prompt=False, continue_final_message=True)
    text = tokenizer.render_chat(short, add_generation_prompt=False, continue_final_message=True)
    assert text.startswith("<s>") and "<s>" not in text[1:] and "</s>" not in text
    assert cached.stats.tokens_reused - before == len(tokenizer.text_ids("<s>", add_special_tokens=False))


def test_sessions_sharing_a_system_prompt_reuse_only_that(cached: CachedChatTokenizer) -> None:
    system = {"role": "system", "content": "Shared instructions. " * 50}
    cached.chat_ids([system, {"role": "user", "content": "first session"}])
    before = cached.stats.tokens_reused
    other = [system, {"role": "user", "content": "second session"}]
    assert cached.chat_ids(other) == cached.tokenizer.chat_ids(other)
    shared = cached.tokenizer.render_chat([system], add_generation_prompt=False).removesuffix("\n")
    assert cached.stats.tokens_reused - before == len(cached.tokenizer.text_ids(shared, False))


def test_with_special_tokens_a_chat_is_the_bos_and_its_cached_ids(cached: CachedChatTokenizer) -> None:
    """A Responses prompt (add_special_tokens on): the post-processor's BOS before the chat's own ids, which
    share the cache with chats'."""
    assert special_affixes(cached.tokenizer) == ([0], [])
    messages = [{"role": "user", "content": "hi"}]
    cached.chat_ids(messages)
    ids = cached.chat_ids(messages, add_special_tokens=True)
    assert ids == cached.tokenizer.chat_ids(messages, add_special_tokens=True) and ids[:2] == [0, 0]
    assert cached.stats.hits == 1


def test_completions_are_encoded_whole(cached: CachedChatTokenizer) -> None:
    assert cached.completion_ids("def f():") == cached.tokenizer.completion_ids("def f():")
    assert cached.completion_ids([[5, 6]]) == [5, 6]


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_text_completions_take_the_batch_path_to_the_same_ids(
    cached: CachedChatTokenizer, add_special_tokens: bool
) -> None:
    texts = ["", "</s> <s>x</s>", "def f(x):\n    return x\n" * 300, " ".join(["cache block"] * 3000)]
    for prompt in [*texts, *([text] for text in texts)]:
        expected = cached.tokenizer.completion_ids(prompt, add_special_tokens)
        assert cached.completion_ids(prompt, add_special_tokens) == expected
    with pytest.raises(InvalidPrompt):
        cached.completion_ids([cached.tokenizer.vocab_size])
    with pytest.raises(InvalidPrompt):
        cached.completion_ids(["a", "b"])


def test_callers_may_change_the_ids_they_get(cached: CachedChatTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    cached.chat_ids(messages).clear()
    assert cached.chat_ids(messages) == cached.tokenizer.chat_ids(messages) and cached.stats.hits == 1


def test_a_template_that_rejects_the_start_up_render_still_serves(model_dir: Path, tmp_path: Path) -> None:
    template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}</s>{% endfor %}"
    )
    cached = CachedChatTokenizer(with_template(model_dir, tmp_path, template))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert cached.chat_ids(messages) == cached.tokenizer.chat_ids(messages)


@pytest.mark.parametrize(
    ("max_entries", "max_tokens"),
    [(1, 1_000_000), (3, 1_000_000), (50, 1_000_000), (1_000, 400), (1_000, 3_000), (8, 2_000)],
)
def test_the_cache_stays_within_its_bounds(
    tokenizer: PromptTokenizer, max_entries: int, max_tokens: int
) -> None:
    cached = CachedChatTokenizer(tokenizer, max_entries=max_entries, max_tokens=max_tokens)
    rng = random.Random(max_entries * 7919 + max_tokens)
    sessions: list[Messages] = [[{"role": "system", "content": f"session {i}"}] for i in range(4)]
    for _ in range(40):
        messages = rng.choice(sessions)
        messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(40))})
        check(cached, messages)
        messages.append({"role": "assistant", "content": rng.choice(PIECES)})
        assert cached.entries <= max_entries and cached.cached_tokens <= max_tokens
        blocks = {id(entry.block): len(entry.block.ids) for entry in cached._entries.values()}
        assert cached.cached_tokens == sum(blocks.values())  # each block counted once, freed ones not at all
    assert cached.stats.evictions > 0


def test_an_evicted_prefix_costs_a_full_tokenization(tokenizer: PromptTokenizer) -> None:
    cached = CachedChatTokenizer(tokenizer, max_entries=2)
    first = [{"role": "user", "content": "first"}]
    second = [{"role": "user", "content": "second"}, {"role": "assistant", "content": "x"}]
    cached.chat_ids(first)
    cached.chat_ids(second)  # three cuts (<s> and two </s>): keeps the last two, drops "first"'s
    before = cached.stats.tokens_reused
    longer = [*first, {"role": "assistant", "content": "ok"}]
    assert cached.chat_ids(longer) == tokenizer.chat_ids(longer)
    assert cached.stats.tokens_reused - before == 0


def test_a_chat_longer_than_the_token_bound_is_not_cached(tokenizer: PromptTokenizer) -> None:
    cached = CachedChatTokenizer(tokenizer, max_tokens=10)
    messages = [{"role": "user", "content": "far more than ten tokens " * 5}]
    assert cached.chat_ids(messages) == tokenizer.chat_ids(messages)
    assert cached.entries == 0 and cached.cached_tokens == 0


# --- when cutting is safe: tokenizer.json alone, then real pipelines built here --------------------------

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
FIRST = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}


def config(
    *tokens: dict[str, Any], pre: Any = BYTE_LEVEL, normalizer: Any = None, **model: Any
) -> dict[str, Any]:
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    added = [{"id": i, **flags, **token} for i, token in enumerate(tokens)]
    return {
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre,
        "model": {"type": "BPE", **model},
    }


S, EOS = {"content": "<s>"}, {"content": "</s>"}


@pytest.mark.parametrize(
    ("name", "tokenizer_json", "splits_special", "expected"),
    [
        ("plain special tokens", config(S, EOS), False, {"<s>", "</s>"}),
        ("non-special added token", config({"content": "<|x|>", "special": False}), False, {"<|x|>"}),
        ("rstrip eats what follows", config(S, {"content": "</s>", "rstrip": True}), False, {"<s>"}),
        ("lstrip", config({"content": "</s>", "lstrip": True}), False, set()),
        ("single_word", config({"content": "</s>", "single_word": True}), False, set()),
        ("matched after normalization", config({"content": "</s>", "normalized": True}), False, set()),
        ("contained in another token", config(EOS, {"content": "</s>>"}), False, set()),
        ("contains another token", config({"content": "<|a|>"}, {"content": "a"}), False, set()),
        ("suffix is another's prefix", config(S, {"content": "[a|"}, {"content": "|b]"}), False, {"<s>"}),
        ("overlaps itself", config({"content": "<|<|"}), False, set()),
        ("whitespace at an edge", config({"content": "\n<x>"}, {"content": "<y> "}), False, set()),
        ("ends with a word character", config({"content": "<x>x"}), False, set()),
        ("special tokens split as text", config(S, EOS), True, set()),
        ("bpe dropout", config(S, EOS, dropout=0.1), False, set()),
        ("metaspace first", config(S, pre=FIRST), False, set()),
        (
            "metaspace first in a sequence",
            config(S, pre={"type": "Sequence", "pretokenizers": [BYTE_LEVEL, FIRST]}),
            False,
            set(),
        ),
        ("metaspace always", config(S, pre={**FIRST, "prepend_scheme": "always"}), False, {"<s>"}),
        ("unknown pre-tokenizer", config(S, pre={"type": "SomethingNew"}), False, set()),
        (
            "legacy llama normalizer",
            config(
                S,
                pre=None,
                normalizer={
                    "type": "Sequence",
                    "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "Replace"}],
                },
            ),
            False,
            {"<s>"},
        ),
        ("unknown normalizer", config(S, normalizer={"type": "SomethingNew"}), False, set()),
    ],
)
def test_cut_tokens_from_tokenizer_json(
    name: str, tokenizer_json: dict[str, Any], splits_special: bool, expected: set[str]
) -> None:
    assert set(cut_tokens(tokenizer_json, splits_special)) == expected, name


CORPUS = [
    "hello world, this is a test of the tokenizer",
    " x  y\nz é 🙂 日本語",
    "def f(x):\n    return x",
] * 8


def build_tokenizer(directory: Path, pre_tokenizer: Any, normalizer: Any) -> PromptTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer, backend.normalizer = pre_tokenizer, normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    settings = json.loads(config_path.read_text())
    settings.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(settings))
    return PromptTokenizer(directory)


def _pipelines() -> dict[str, tuple[Callable[[], Any], Callable[[], Any], bool]]:
    from tokenizers import normalizers, pre_tokenizers

    legacy = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return {  # name: (pre-tokenizer, normalizer, cut after </s> is exact)
        "byte level with prefix space": (
            lambda: pre_tokenizers.ByteLevel(add_prefix_space=True),
            lambda: None,
            True,
        ),
        "metaspace always": (lambda: pre_tokenizers.Metaspace(prepend_scheme="always"), lambda: None, True),
        "legacy llama": (lambda: None, lambda: legacy, True),
        "whitespace, stripped, lowercased": (
            pre_tokenizers.Whitespace,
            lambda: normalizers.Sequence([normalizers.Strip(), normalizers.Lowercase()]),
            True,
        ),
        "metaspace first": (lambda: pre_tokenizers.Metaspace(prepend_scheme="first"), lambda: None, False),
    }


@pytest.mark.parametrize("name", list(_pipelines()))
def test_other_pipelines_cut_only_where_it_is_exact(tmp_path: Path, name: str) -> None:
    pre_tokenizer, normalizer, safe = _pipelines()[name]
    tokenizer = build_tokenizer(tmp_path, pre_tokenizer(), normalizer())
    split = tokenizer.text_ids("a</s>", False) + tokenizer.text_ids("x y", False)
    assert (split == tokenizer.text_ids("a</s>x y", False)) is safe  # so the refusal below matters
    cached = CachedChatTokenizer(tokenizer)
    assert ("</s>" in cached.cut_tokens) is safe
    rng = random.Random(3)
    for _ in range(3):
        play_session(cached, rng, 6, "You are a careful coding agent.")
    assert (cached.stats.hits > 0) is safe


@pytest.mark.parametrize("name", ["tokenize_chat", "tokenize_chat_gen", "tokenize_completion"])
def test_tiny_tokenizer_ids_equal_real_vllm(cached: CachedChatTokenizer, name: str) -> None:
    captured = {entry["name"]: entry for entry in json.loads(CAPTURE.read_text())["requests"]}[name]
    request, expected = captured["request"], captured["response"]["tokens"]
    if "messages" in request:
        flags = {"add_generation_prompt": request.get("add_generation_prompt", True)}
        assert cached.tokenizer.chat_ids(request["messages"], **flags) == expected
        assert cached.chat_ids(request["messages"], **flags) == expected
        assert cached.chat_ids(request["messages"], **flags) == expected and cached.stats.hits == 1
    else:
        assert cached.completion_ids(request["prompt"]) == expected
