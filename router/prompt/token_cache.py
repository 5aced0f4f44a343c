"""Chat tokenization that only encodes what is new: agent sessions resend a growing history every turn.

``CachedChatTokenizer.chat_ids`` always equals ``PromptTokenizer.chat_ids``. It renders the chat (cheap), cuts
the text right after occurrences of special tokens, reuses the ids of the longest prefix up to a cut it has
seen, and encodes only the rest. The end of a text of up to WHOLE_TEXT_MAX_BYTES with a cut in it counts as
a cut too, so a chat sent again (a retry, one prompt sampled many times) is not encoded at all; a later
text finds that entry only where it has a cut at the same place, which an earlier text that did not end with
a cut token cannot give. Such a chat is keyed by what it renders from too (its messages, tools, template
kwargs and flags), so the same chat sent again is not rendered again either, unless its template can render
it otherwise the next time (it reads the date or draws random text).

Why such a cut is exact. HF tokenizers encode in this order: split the text on added tokens whose
``normalized`` flag is false (literal, leftmost-longest matches); then normalize, pre-tokenize and run the
model on each remaining piece separately; then, with add_special_tokens=False, the post-processor adds
nothing. So where the whole text's split has a boundary, the ids of the whole are those of both sides
concatenated, unless some step looks beyond its own piece. We cut only after a token T where that is known:

- T is matched literally and keeps its own edges (normalized, lstrip, rstrip, single_word all false); it
  neither starts nor ends with whitespace nor ends with a word character, so no neighbour's lstrip, rstrip
  or single_word can reach across it;
- T overlaps no added token (neither contains the other, no suffix of one is a prefix of the other, T with
  itself included), so every literal occurrence of T is matched as T and ends a piece;
- every normalizer and pre-tokenizer is a kind known to work piece by piece. Metaspace with
  prepend_scheme "first" is not (it prepends "▁" only at offset 0 of the whole text), nor is anything unknown;
- special tokens are split out at all (split_special_tokens off) and BPE dropout is off.

A probe at start-up encodes a few strings both ways and drops any token for which it still fails. Without
any cut token, with add_special_tokens=True, or without a cut in the text, the whole text is encoded.

``RemoteTokenizer``, the fallback without a local tokenizer, is in router/prompt/remote_tokenizer.py.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, NamedTuple

import msgspec
import xxhash

from router.prompt.multimodal.block_keys import Placed
from router.prompt.multimodal.layouts import Idefics3Layout
from router.prompt.template_inputs import NO_INPUTS, TemplateInputs
from router.prompt.tokenization import PromptTokenizer

log = logging.getLogger(__name__)

# Kinds that transform each piece on its own, whatever precedes it in the text (tokenizers 0.19 - 0.23).
_PIECEWISE_NORMALIZERS = frozenset(
    {
        "BertNormalizer",
        "ByteLevel",
        "Lowercase",
        "NFC",
        "NFD",
        "NFKC",
        "NFKD",
        "Nmt",
        "Precompiled",
        "Prepend",
        "Replace",
        "Sequence",
        "Strip",
        "StripAccents",
    }
)
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {
        "BertPreTokenizer",
        "ByteLevel",
        "CharDelimiterSplit",
        "Digits",
        "FixedLength",
        "Metaspace",
        "Punctuation",
        "Sequence",
        "Split",
        "UnicodeScripts",
        "Whitespace",
        "WhitespaceSplit",
    }
)
_PROBE_LEFT = ("", "a b", "\n")
_PROBE_RIGHT = ("", "x", " x", "  x", "\n", "\n\n y", "é🙂", "<|user|>\n")


def _piecewise(component: Mapping[str, Any] | None, kinds: frozenset[str]) -> bool:
    if component is None:
        return True
    kind = component.get("type")
    if kind not in kinds or (kind == "Metaspace" and component.get("prepend_scheme") == "first"):
        return False
    children = component.get("normalizers", component.get("pretokenizers", []))
    return all(_piecewise(child, kinds) for child in children)


def cut_tokens(config: Mapping[str, Any], splits_special_tokens: bool = False) -> dict[str, int]:
    """Added tokens (content -> id) right after which a text can be cut exactly, from tokenizer.json alone."""
    if (
        splits_special_tokens
        or config.get("model", {}).get("dropout")
        or not _piecewise(config.get("normalizer"), _PIECEWISE_NORMALIZERS)
        or not _piecewise(config.get("pre_tokenizer"), _PIECEWISE_PRE_TOKENIZERS)
    ):
        return {}
    added = config.get("added_tokens", [])
    contents = {token["content"] for token in added}
    prefixes = {text[:i] for text in contents for i in range(1, len(text) + 1)}
    suffixes = {text[i:] for text in contents for i in range(len(text))}
    joined = "\0".join(contents)

    def isolated(text: str) -> bool:
        inner = (text[i:j] for i in range(len(text)) for j in range(i + 1, len(text) + 1))
        return (
            "\0" not in text
            and joined.count(text) == 1
            and not any(text[i:] in prefixes or text[:i] in suffixes for i in range(1, len(text)))
            and not any(part in contents for part in inner if part != text)
        )

    return {
        token["content"]: token["id"]
        for token in added
        if token["content"]
        and not any(token.get(flag) for flag in ("normalized", "lstrip", "rstrip", "single_word"))
        and token["content"] == token["content"].strip()
        and not (token["content"][-1].isalnum() or token["content"][-1] == "_")  # single_word neighbours
        and isolated(token["content"])
    }


def probed_cut_tokens(tokenizer: PromptTokenizer) -> frozenset[str]:
    """``cut_tokens`` of the tokenizer, less any for which encoding a few strings in two parts differs."""
    candidates = cut_tokens(tokenizer.backend_config(), tokenizer.splits_special_tokens)
    cases = [
        (token, left + token, right) for token in candidates for left in _PROBE_LEFT for right in _PROBE_RIGHT
    ]
    texts = [text for _, left, right in cases for text in (left, right, left + right)]
    ids = tokenizer.texts_ids(texts, add_special_tokens=False)
    failed = {token for i, (token, _, _) in enumerate(cases) if ids[3 * i] + ids[3 * i + 1] != ids[3 * i + 2]}
    return frozenset(candidates.keys() - failed)


def special_affixes(tokenizer: PromptTokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the tokenizer's post-processor puts before and after a text's own when asked to add special
    tokens (a BOS, say), if it adds the same whatever the text: then a chat encoded with them is those around
    the chat encoded without, and shares its cached prefixes. None when the probes disagree."""
    texts = [text for left in _PROBE_LEFT for text in (left, left + " and more") if text]
    plain = tokenizer.texts_ids(texts, add_special_tokens=False)
    special = tokenizer.texts_ids(texts, add_special_tokens=True)
    found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for own, full in zip(plain, special, strict=True):
        start = next((i for i in range(len(full) - len(own) + 1) if full[i : i + len(own)] == own), None)
        if start is None:
            return None
        found.add((tuple(full[:start]), tuple(full[start + len(own) :])))
    if len(found) != 1:
        return None
    prefix, suffix = found.pop()
    return list(prefix), list(suffix)


# A longer chat is an agent session's history, which grows every turn: its whole text is seldom sent again,
# and its entry would keep the turn's ids alive after the next turn took over its prefixes (one block each).
WHOLE_TEXT_MAX_BYTES = 32 * 1024

# Template names whose output can change from one render of the same chat to the next: the day's date
# (transformers' strftime_now), jinja's random filter and lorem ipsum generator.
_UNSTABLE_TEMPLATE = re.compile(r"strftime_now|random|lipsum")
_INPUTS_ENCODER = msgspec.json.Encoder()
_INPUTS_SEED = 1  # keys of a chat's inputs, apart from those of its text


@dataclass
class TokenCacheStats:
    requests: int = 0
    hits: int = 0  # requests that reused a cached prefix
    tokens_reused: int = 0
    tokens_encoded: int = 0
    evictions: int = 0
    renders_skipped: int = 0  # requests whose chat was known by its inputs: not rendered


@dataclass
class _Block:
    """The ids of one rendered chat, shared by the entries of its prefixes."""

    ids: list[int]
    refs: int = 0


class _Entry(NamedTuple):
    block: _Block
    tokens: int  # the prefix's ids are block.ids[:tokens]
    nbytes: int  # the prefix's UTF-8 length, a cheap second check beside its 64-bit hash; -1 - n for inputs


class CachedChatTokenizer:
    """``PromptTokenizer.chat_ids``, reusing the ids of the longest prefix seen before. Thread-safe: the
    cache is read and updated under a lock, rendering and encoding run outside it (the encode releases the
    GIL), so a long prompt tokenized on a worker thread does not hold up the event loop's short ones.

    Bounded by ``max_entries`` prefixes and ``max_tokens`` ids held (a list of ids costs 8 to 36 bytes
    each); the least recently used prefixes go first. A chat longer than ``max_tokens`` is not cached.
    """

    def __init__(
        self, tokenizer: PromptTokenizer, max_entries: int = 65_536, max_tokens: int = 2_000_000
    ) -> None:
        if max_entries < 1 or max_tokens < 1:
            raise ValueError("max_entries and max_tokens must be positive")
        self.tokenizer, self.max_entries, self.max_tokens = tokenizer, max_entries, max_tokens
        self.cut_tokens = probed_cut_tokens(tokenizer)
        self._affixes = special_affixes(tokenizer)
        alternatives = sorted((re.escape(token.encode()) for token in self.cut_tokens), key=len, reverse=True)
        self._cut_pattern = re.compile(b"|".join(alternatives)) if alternatives else None
        self._stable_renders = not any(_UNSTABLE_TEMPLATE.search(t) for t in tokenizer.chat_templates())
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()  # over _entries, _cached_tokens and stats
        self.stats = TokenCacheStats()
        self._compile_template()

    def _compile_template(self) -> None:
        """Render once now: transformers compiles the chat template on first use, ~4 ms a first request
        would otherwise wait for."""
        try:
            self.tokenizer.render_chat([{"role": "user", "content": "hi"}])
        except Exception as exc:  # a template that wants another chat: it compiled, or requests will say why
            log.debug("rendering a one-message chat at start-up failed: %r", exc)

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        """Ids held in memory, each counted once however many prefixes share it."""
        return self._cached_tokens

    @property
    def image_layout(self) -> Idefics3Layout | None:
        return self.tokenizer.image_layout

    def chat_with_images(
        self,
        model_id: str,
        messages: Sequence[Any],
        flags: tuple[bool, bool, bool],
        inputs: TemplateInputs,
        fetched: Mapping[str, bytes] | None = None,
    ) -> tuple[list[int], list[Placed]]:
        """PromptTokenizer.chat_with_images, not cached: an image's tokens are not its text's."""
        return self.tokenizer.chat_with_images(model_id, messages, flags, inputs, fetched)

    def completion_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        """The ids PromptTokenizer.completion_ids gives, a text prompt through the batch path (no offsets:
        half the time of a long prompt)."""
        text_or_ids = self.tokenizer.completion_prompt(prompt)
        if isinstance(text_or_ids, str):
            return self.tokenizer.texts_ids([text_or_ids], add_special_tokens)[0]
        return text_or_ids

    def chat_ids(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        inputs: TemplateInputs = NO_INPUTS,
    ) -> list[int]:
        if add_special_tokens and self._affixes is not None:  # a Responses prompt: a BOS, the chat's ids
            prefix, suffix = self._affixes
            flags = (add_generation_prompt, continue_final_message, False)
            plain = self.chat_ids(messages, *flags, inputs)
            return [*prefix, *plain, *suffix]
        tools, template_kwargs, calls_as_given = inputs.tools, inputs.template_kwargs, inputs.calls_as_given
        rendered_from = (messages, tools, template_kwargs, add_generation_prompt, continue_final_message)
        inputs_key = None if add_special_tokens else self._inputs_key((*rendered_from, calls_as_given))
        known = None if inputs_key is None else self._rendered_before(*inputs_key)
        if known is not None:
            return known
        text = self.tokenizer.render_chat(messages, add_generation_prompt, continue_final_message, inputs)
        data = text.encode()
        pattern = None if add_special_tokens else self._cut_pattern
        cuts = [match.end() for match in pattern.finditer(data)] if pattern is not None else []
        if not cuts:
            ids = self.tokenizer.texts_ids([text], add_special_tokens)[0]
            with self._lock:
                self.stats.requests += 1
                self.stats.tokens_encoded += len(ids)
            return ids
        if cuts[-1] != len(data) and len(data) <= WHOLE_TEXT_MAX_BYTES:
            cuts.append(len(data))  # the whole text is a key too: a prompt sent again is not encoded again
        keys = _prefix_keys(data, cuts)
        with self._lock:
            self.stats.requests += 1
            hit = self._longest_cached(keys, cuts)
            if hit < 0:
                start, ids = 0, []
            else:
                entry = self._entries[keys[hit]]
                start, ids = cuts[hit], entry.block.ids[: entry.tokens]
                self.stats.hits += 1
                self.stats.tokens_reused += entry.tokens
                if start == len(data):  # the whole text
                    self._entries.move_to_end(keys[hit])
                    if inputs_key is not None:
                        self._attach(inputs_key, entry.block, entry.tokens)
                    return ids
            ends = [
                self._known_tokens(key, nbytes)
                for key, nbytes in zip(keys[: hit + 1], cuts[: hit + 1], strict=True)
            ]
        reused = len(ids)
        bounds = [start, *cuts[hit + 1 :]]
        if bounds[-1] != len(data):  # past the last cut, a text too long for a key of its own
            bounds.append(len(data))
        segments = [data[a:b].decode() for a, b in pairwise(bounds)]
        for part in self.tokenizer.texts_ids(segments, add_special_tokens=False):
            ids += part
            ends.append(len(ids))
        with self._lock:
            self.stats.tokens_encoded += len(ids) - reused
            block = self._remember(keys, cuts, ends, ids)
            if block is not None and inputs_key is not None and cuts[-1] == len(data):
                self._attach(inputs_key, block, len(ids))
        return ids.copy()

    def _inputs_key(self, rendered_from: tuple[Any, ...]) -> tuple[int, int] | None:
        """The key of a chat by what it renders from, and its entry's length marker; None where its text
        would not be cached whole (no cut, a long chat) or its template may render it otherwise next time."""
        if not self._stable_renders or self._cut_pattern is None:
            return None
        if _text_beyond(rendered_from[0], WHOLE_TEXT_MAX_BYTES):  # spares encoding a long history to see it
            return None
        try:
            data = _INPUTS_ENCODER.encode(rendered_from)
        except (TypeError, ValueError, OverflowError, RecursionError):  # not plain data: rendered every time
            return None
        if len(data) > WHOLE_TEXT_MAX_BYTES:
            return None
        return xxhash.xxh3_64_intdigest(data, seed=_INPUTS_SEED), -1 - len(data)

    def _rendered_before(self, key: int, marker: int) -> list[int] | None:
        """The ids of a chat known by its inputs, counted as a request that rendered nothing."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.nbytes != marker:
                return None
            self._entries.move_to_end(key)
            self.stats.requests += 1
            self.stats.hits += 1
            self.stats.renders_skipped += 1
            self.stats.tokens_reused += entry.tokens
            return entry.block.ids[: entry.tokens]

    def _attach(self, inputs: tuple[int, int], block: _Block, tokens: int) -> None:
        """Key a chat's whole ids by its inputs too, sharing its text's block."""
        key, marker = inputs
        self._point(key, _Entry(block, tokens, marker))
        self._evict()

    def _point(self, key: int, entry: _Entry) -> None:
        """key to entry, the block it pointed to released."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._release(old.block)
        entry.block.refs += 1
        self._entries[key] = entry

    def _longest_cached(self, keys: list[int], cuts: list[int]) -> int:
        for index in range(len(keys) - 1, -1, -1):
            if self._known_tokens(keys[index], cuts[index]) is not None:
                return index
        return -1

    def _known_tokens(self, key: int, nbytes: int) -> int | None:
        entry = self._entries.get(key)
        return entry.tokens if entry is not None and entry.nbytes == nbytes else None

    def _remember(
        self, keys: list[int], cuts: list[int], ends: list[int | None], ids: list[int]
    ) -> _Block | None:
        """Point every prefix of this chat at one block, so older blocks of the same session are freed."""
        if len(ids) > self.max_tokens:
            return None
        block = _Block(ids)
        self._cached_tokens += len(ids)
        for key, nbytes, tokens in zip(keys, cuts, ends, strict=False):  # ends: one more past the last cut
            if tokens is not None:
                self._point(key, _Entry(block, tokens, nbytes))
        self._evict()
        return block

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries or self._cached_tokens > self.max_tokens:
            self._release(self._entries.popitem(last=False)[1].block)
            self.stats.evictions += 1

    def _release(self, block: _Block) -> None:
        block.refs -= 1
        if block.refs == 0:
            self._cached_tokens -= len(block.ids)


def _text_beyond(messages: Sequence[Any], limit: int) -> bool:
    """Whether the messages' string contents and text parts alone are longer than limit characters (so their
    UTF-8 too); a look at the first ones is enough for a long history."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            texts = (part.get("text") for part in content if isinstance(part, dict))
            total += sum(len(text) for text in texts if isinstance(text, str))
        if total > limit:
            return True
    return False


def _prefix_keys(data: bytes, cuts: list[int]) -> list[int]:
    """The xxh3_64 of data[:cut] for every cut, in one pass."""
    hasher, view, keys, done = xxhash.xxh3_64(), memoryview(data), [], 0
    for cut in cuts:
        hasher.update(view[done:cut])
        keys.append(hasher.intdigest())
        done = cut
    return keys
