"""The Responses API's requests as the router reads them: the chat vLLM renders for a Responses body, with the
conversation behind its previous_response_id (router/apis/responses/history.py), and the id the router gives
each response, which names its instance and its owner (router/apis/responses/ids.py); and a stored response's
retrieval or cancellation, pinned to the instance that holds it. What the router cannot render as vLLM does
is routed by load, and the engine answers it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec

from router.apis.openai_body import (
    BOM,
    ChatRequest,
    CompletionRequest,
    ResponsesChatRequest,
    json_object,
    served_model,
)
from router.apis.read import AgentRead, convert
from router.apis.responses.chat import responses_chat
from router.apis.responses.history import ResponseHistory
from router.apis.responses.ids import ResponseIds
from router.apis.responses.owners import UNSCOPED
from router.errors import OpenAIError
from router.prompt.chat_conversation import InvalidPrompt
from router.shared.conversations import SharedConversations
from router.upstreams.instances import Instance


class _ResponsesHead(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    request_id: str | None = None  # vLLM's: the response's id, a client's own choice
    prompt_cache_key: str | None = None  # Codex sends its session's id
    cache_salt: str | None = None
    tool_choice: Any = None
    priority: Any = None


class _PreviousOnly(msgspec.Struct):
    previous_response_id: str | None = None


class StoredResponses:
    """The Responses API's requests: ids naming their instance and owner, the conversations behind them.

    owner, in each call: the tag of the client's key (router/apis/responses/owners.py), or None
    where no client keys are configured and every stored response is anyone's."""

    def __init__(self, ids: ResponseIds, history: ResponseHistory) -> None:
        self.ids, self.history = ids, history
        self.shared: SharedConversations | None = None

    def share(self, shared: SharedConversations) -> None:
        """Replicas share their stored responses' conversations and chosen ids through the store."""
        self.shared = shared
        self.history.on_started, self.history.on_kept = shared.pending, shared.kept
        self.ids.on_chosen = shared.chosen

    async def recall(self, raw: bytes, stored: str | None) -> None:
        """Before a follow-up (raw naming previous_response_id) or a stored response's retrieval (stored: its
        id) is read: what this replica does not know of that response, read from the shared store."""
        shared = self.shared
        if shared is None:
            return
        response_id = stored
        if response_id is None:
            try:
                response_id = msgspec.json.decode(raw, type=_PreviousOnly).previous_response_id
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                return  # its read says what is wrong with it
        if response_id is None:
            return
        ids, history = self.ids, self.history
        key = ids.history_key(response_id)
        if ids.knows(response_id) and (stored is not None or history.conversation(key) is not None):
            return
        chosen, conversation = await shared.recall(response_id, key)
        if chosen is not None and not ids.knows(response_id):
            ids.adopt(response_id, chosen.url, chosen.owner)
            key = ids.history_key(response_id)
        if conversation is not None and history.conversation(key) is None:
            history.adopt(key, conversation.messages, conversation.output, len(raw))

    def read(self, raw: bytes, only_model: str | None, owner: str | None) -> AgentRead:
        fields = json_object(raw)
        head = convert(fields, _ResponsesHead)
        model = served_model(head.model, only_model)
        previous = head.previous_response_id
        pinned = None if previous is None else self.stored(previous, owner)
        session = head.prompt_cache_key or head.user
        body, messages = self._chat(fields, head, model)
        key = head.request_id or ResponseIds.nonce()
        watch: Callable[[bytes], None] | None = None
        if head.store and messages is not None:  # kept, as the instance keeps it, for a follow-up's prompt
            self.history.started(key, messages, len(raw))
            watch = partial(self.history.completed, key)
        stamped = self._stamped(raw, key, head.request_id, UNSCOPED if owner is None else owner)
        return AgentRead(body, session, messages is not None, pinned, previous, stamped, watch)

    def read_stored(
        self, response_id: str, query: str, only_model: str | None, owner: str | None
    ) -> AgentRead:
        """A retrieval or cancellation of a stored response (query: a retrieval's), for its instance."""
        holder = self.stored(response_id, owner)
        streamed = "stream=true" in query.lower()
        model = min(holder.models, default=only_model or "")
        body = CompletionRequest(model=model, stream=streamed)
        return AgentRead(body, tokenize=False, pinned=holder, pinned_by=response_id)

    def stored(self, response_id: str, owner: str | None) -> Instance:
        """The instance holding a stored response, or vLLM's answer for an id no instance holds: one the
        fleet no longer has, one down (its connection failing is told the same way, routing.send), or one
        another client key created."""
        holder = self.ids.holder(response_id)
        if holder is None or not holder.healthy:
            raise response_not_found(response_id)
        if owner is not None and self.ids.owner(response_id) != owner:
            raise response_not_found(response_id)
        return holder

    def _chat(
        self, fields: dict[str, Any], head: _ResponsesHead, model: str
    ) -> tuple[ChatRequest, list[Any] | None]:
        """The chat the request renders as, and its messages (None: not rendered here, routed by load)."""
        previous_messages: Any = ()
        previous_output: Any = ()
        try:
            if head.previous_response_id is not None:
                known = self.history.conversation(self.ids.history_key(head.previous_response_id))
                if known is None:
                    raise InvalidPrompt("the previous response's conversation is not known here")
                previous_messages, previous_output = known.messages, known.output
            chat = responses_chat(fields, previous_messages, previous_output)
        except InvalidPrompt:
            return ResponsesChatRequest(
                messages=[], model=model, stream=head.stream, priority=head.priority
            ), None
        body = ResponsesChatRequest(
            messages=chat.messages,
            model=model,
            stream=head.stream,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            add_special_tokens=True,  # vLLM's Responses code leaves the tokenizer's default on
            cache_salt=head.cache_salt,
            tools=chat.tools,
            tool_choice=head.tool_choice,
            chat_template_kwargs=chat.template_kwargs,
            priority=head.priority,  # the client's, for the router to replace
        )
        return body, chat.messages

    def _stamped(self, raw: bytes, key: str, chosen: str | None, owner: str) -> Callable[[Instance], bytes]:
        ids = self.ids

        def body_for(instance: Instance) -> bytes:
            if chosen is not None:  # the client's id: remembered here with its instance and owner
                ids.chosen(chosen, instance, owner)
                return raw
            return with_request_id(raw, ResponseIds.made(instance, owner, key))

        return body_for


def response_not_found(response_id: str) -> OpenAIError:
    """vLLM's answer for a stored response it does not hold."""
    return OpenAIError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", 404, "response_id"
    )


def with_request_id(raw: bytes, response_id: str) -> bytes:
    """The body (a JSON object without a request_id) with vLLM's request_id field set first."""
    rest = raw.removeprefix(BOM).lstrip()[1:]
    field = b'{"request_id":' + msgspec.json.encode(response_id)
    return field + (b"," + rest if rest.lstrip()[:1] != b"}" else rest)
