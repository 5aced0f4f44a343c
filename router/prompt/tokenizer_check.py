"""Whether the router's token ids are the engines': checked at start and by the tokenization audit, loudly.

A router tokenizing with another tokenizer than the engine's still routes every request, but hashes its
prompts to blocks no instance holds: cache-aware routing goes blind with no error anywhere. So at start each
model with a tokenizer here has a text and a chat tokenized by every instance serving it (``POST
/tokenize``), and the audit (router/prompt/tokenization_audit.py) checks chats now and then after that. A
mismatch is an error log naming the model and the instance, ``kvroute_tokenizer_mismatch`` at 1 for them
(until the router restarts or the instance leaves), a warning on /health and an alarm on /dashboard.

A chat that differs where the text matched is the chat's rendering (a template or tool layout of the
engine's own), not the tokenizer: the audit hands those chats to the engine, and the difference is a warning
and a line on /dashboard, not an alarm.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from router.metrics import RouterMetrics
from router.prompt.remote_tokenizer import RemoteTokenizer, TokenizeFailed

log = logging.getLogger(__name__)

# Accents, CJK, digits, runs of spaces and a tab: where two tokenizers of one family part ways first.
PROBE_TEXT = "kvroute checks its tokenizer: naïve café, 東京タワー, ☃ 12345 + 678 = 13023.\n\tTwo  spaces."
TEXT_CHECK = "start_text"  # the plain text's: the tokenizer alone, no template
PROBE_CHAT = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Grüße aus Köln! What is 12 + 30?"},
]


class ProbedTokenizer(Protocol):
    def completion_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[int]: ...

    def chat_ids(self, messages: Sequence[Any]) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Mismatch:
    check: str  # start_text, start_chat, or the audit's kind: plain, with_inputs
    router_tokens: int
    engine_tokens: int
    first_different: int

    def __str__(self) -> str:
        return (
            f"{self.check}: {self.router_tokens} ids here, {self.engine_tokens} there, first different at "
            f"{self.first_different}"
        )


class TokenizerWatch:
    """Each comparison of the router's ids with an instance's, and what each model is tokenized with."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self.origins: dict[str, str] = {}  # model -> its tokenizer and how it was found, set at start
        self._matched: dict[str, set[str]] = {}  # model -> instances whose ids matched
        self._text_matched: dict[str, set[str]] = {}  # model -> instances whose ids of the plain text matched
        self._mismatches: dict[str, dict[str, Mismatch]] = {}  # model -> instance -> the first alarm
        self._renderings: dict[str, dict[str, Mismatch]] = {}  # model -> instance -> a chat's, text matched

    def compared(self, model: str, instance: str, check: str, ids: list[int], engine_ids: list[int]) -> bool:
        """Record one comparison (check: its kind, a label of kvroute_tokenization_audits); whether the ids
        were the same."""
        if engine_ids == ids:
            self._metrics.tokenization_audits(model, check, "match").inc()
            self._matched.setdefault(model, set()).add(instance)
            if check == TEXT_CHECK:
                self._text_matched.setdefault(model, set()).add(instance)
            if instance not in self._mismatches.get(model, {}):
                self._metrics.tokenizer_mismatch(model, instance).set(0)
            return True
        self._metrics.tokenization_audits(model, check, "mismatch").inc()
        differ = next(
            (i for i, (a, b) in enumerate(zip(ids, engine_ids, strict=False)) if a != b),
            min(len(ids), len(engine_ids)),
        )
        mismatch = Mismatch(check, len(ids), len(engine_ids), differ)
        if check != TEXT_CHECK and instance in self._text_matched.get(model, ()):
            self._renderings.setdefault(model, {}).setdefault(instance, mismatch)
            log.warning(
                "model %s, instance %s: a chat renders to other token ids there (%s) though plain text "
                "tokenizes alike: the engine's chat template or tool layout differs, and such chats are "
                "tokenized by the engine",
                model,
                instance,
                mismatch,
            )
            return False
        self._metrics.tokenizer_mismatch(model, instance).set(1)
        self._mismatches.setdefault(model, {}).setdefault(instance, mismatch)
        log.error(
            "tokenizer mismatch: model %s, instance %s: the router's token ids differ from the engine's "
            "/tokenize (%s), so its prompts hash to blocks no instance holds. The router tokenizes %s with "
            "%s; set models[].tokenizer to the engine's tokenizer (its --tokenizer, else its --model), or to "
            "remote",
            model,
            instance,
            mismatch,
            model,
            self.origins.get(model, "its tokenizer"),
        )
        return False

    def forget(self, instance: str) -> None:
        """instance left the fleet: its comparisons go with it (its metric series are dropped apart)."""
        for table in (self._matched, self._text_matched):
            for instances in table.values():
                instances.discard(instance)
        for found in (*self._mismatches.values(), *self._renderings.values()):
            found.pop(instance, None)

    def failed(self, model: str, instance: str, check: str, reason: TokenizeFailed) -> None:
        log.debug("%s: %s could not be asked for token ids (%s): %s", model, instance, check, reason)
        self._metrics.tokenization_audits(model, check, "failed").inc()

    def alarms(self) -> list[str]:
        return [
            f"tokenizer mismatch: model {model} on instance {instance} ({mismatch.check})"
            for model, found in self._mismatches.items()
            for instance, mismatch in found.items()
        ]

    def state(self) -> list[dict[str, Any]]:
        """Each model: its tokenizer, the instances that matched, and the mismatches (the dashboard's)."""
        return [
            {
                "model": model,
                "tokenizer": origin,
                "matched": sorted(self._matched.get(model, ())),
                "mismatches": [
                    {"instance": instance, **asdict(mismatch)}
                    for instance, mismatch in self._mismatches.get(model, {}).items()
                ],
                "renderings": [
                    {"instance": instance, **asdict(mismatch)}
                    for instance, mismatch in self._renderings.get(model, {}).items()
                ],
            }
            for model, origin in self.origins.items()
        ]


async def check_at_start(
    watch: TokenizerWatch,
    tokenizers: Mapping[str, ProbedTokenizer],
    remotes: Mapping[str, Iterable[RemoteTokenizer]],
) -> None:
    """Compare each model's ids here with every instance's serving it (remotes: by model). The ids here are
    computed once a model, not once an instance (0.12 ms a pair with builtin:tiny-llama; more with a larger
    template)."""
    checks = []
    for model, tokenizer in tokenizers.items():
        try:
            probes: list[tuple[str, list[int], Any]] = [
                (TEXT_CHECK, tokenizer.completion_ids(PROBE_TEXT), PROBE_TEXT)
            ]
        except Exception:  # the others' checks go on; the audit checks this model's chats later
            log.exception("%s: the start-up text probe does not tokenize here", model)
            continue
        try:
            probes.append(("start_chat", tokenizer.chat_ids(PROBE_CHAT), PROBE_CHAT))
        except Exception as exc:  # a template that will not render this chat: the text alone is checked
            log.debug("%s: the start-up chat probe does not render here: %r", model, exc)
        checks += [_probe(watch, model, remote, probes) for remote in remotes.get(model, ())]
    await asyncio.gather(*checks, return_exceptions=True)


async def _probe(
    watch: TokenizerWatch, model: str, remote: RemoteTokenizer, probes: list[tuple[str, list[int], Any]]
) -> None:
    for check, ids, probe in probes:
        await _compare(watch, model, remote, check, ids, probe)


async def _compare(
    watch: TokenizerWatch, model: str, remote: RemoteTokenizer, check: str, ids: list[int], probe: Any
) -> None:
    try:
        if isinstance(probe, str):
            engine_ids = await remote.completion_ids(probe)
        else:
            engine_ids = await remote.chat_ids(probe)
    except TokenizeFailed as exc:
        watch.failed(model, remote.instance, check, exc)
        return
    watch.compared(model, remote.instance, check, ids, engine_ids)
