"""Checks, now and then, that chats the router renders itself get the engine's own token ids.

Rendering a chat locally saves an instance a whole render of a long conversation per request, but its
exactness rests on reproducing vLLM's message handling for this model's template
(router/prompt/chat_conversation.py), and on the engine running the template the router reads
(``--chat-template`` or ``--default-chat-template-kwargs`` change what an engine renders). So the first chat
of each model and kind, and one in ``every`` after it, is also sent to an instance's ``/tokenize`` in the
background (the request does not wait). A check that could not be made (no instance, or no answer from its
``/tokenize``) is owed: the next chat of that kind is checked instead. The kinds: "plain" chats, and chats
"with_inputs" (``tools`` or ``chat_template_kwargs``). One mismatch and that model's chats of that kind go
to the engine's renderer from then on, all its chats after a plain one: routing on wrong ids would credit
blocks no instance holds. Each mismatch is also an alarm (router/prompt/tokenizer_check.py): an error log, a
metric, the dashboard.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from router.prompt.chat_conversation import engine_messages
from router.prompt.remote_tokenizer import RemoteTokenizer, TokenizeFailed
from router.prompt.tokenizer_check import TokenizerWatch

log = logging.getLogger(__name__)


def _kind(with_inputs: bool) -> str:
    return "with_inputs" if with_inputs else "plain"


class TokenizationAudit:
    def __init__(
        self, every: int, watch: TokenizerWatch, remote: Callable[[str], RemoteTokenizer | None]
    ) -> None:
        """every: one chat in this many is checked (0: none); watch: where each comparison is told; remote:
        an instance's /tokenize for a model."""
        self._every, self._watch, self._remote = every, watch, remote
        self._seen: Counter[tuple[str, str]] = Counter()
        self._distrusted: set[tuple[str, str]] = set()
        self._owed: set[tuple[str, str]] = set()  # a check was due but not made: the next chat's is
        self._checks: set[asyncio.Task[None]] = set()

    def trusts(self, model: str, with_inputs: bool) -> bool:
        """Whether the model's chats of this kind may still be rendered here."""
        distrusted = self._distrusted
        return (model, _kind(with_inputs)) not in distrusted and (model, "plain") not in distrusted

    def consider(
        self,
        model: str,
        messages: Sequence[Any],
        flags: Mapping[str, bool],
        template_inputs: Mapping[str, Any],
        ids: list[int],
    ) -> None:
        """A chat was tokenized locally into ``ids``; check it if its turn has come. template_inputs: tools
        and chat_template_kwargs, as the request sent them."""
        key = (model, _kind(bool(template_inputs)))
        seen = self._seen[key]
        self._seen[key] += 1
        due = seen % self._every == 0 or key in self._owed if self._every else False
        if not due or key in self._distrusted:
            return
        remote = self._remote(model)
        if remote is None:
            self._owed.add(key)
            return
        self._owed.discard(key)
        check = asyncio.create_task(
            self._check(remote, key, engine_messages(messages), flags, dict(template_inputs), ids)
        )
        self._checks.add(check)
        check.add_done_callback(self._checks.discard)

    async def _check(
        self,
        remote: RemoteTokenizer,
        key: tuple[str, str],
        messages: list[Any],
        flags: Mapping[str, bool],
        template_inputs: dict[str, Any],
        ids: list[int],
    ) -> None:
        model, kind = key
        try:
            engine_ids = await remote.chat_ids(messages, **flags, template_inputs=template_inputs)
        except TokenizeFailed as exc:
            self._watch.failed(model, remote.instance, kind, exc)
            self._owed.add(key)
            return
        if self._watch.compared(model, remote.instance, kind, ids, engine_ids) or key in self._distrusted:
            return
        self._distrusted.add(key)
        log.warning(
            "%s: from now on the engine tokenizes this model's %s",
            model,
            "chats" if kind == "plain" else "chats with tools or chat_template_kwargs",
        )

    def close(self) -> None:
        for check in self._checks:
            check.cancel()
