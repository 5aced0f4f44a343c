"""The routing decision: tokenize -> hash blocks -> look up the index -> score and pick -> speculate.

The HTTP layer (router/http/proxy.py) calls prepare() once per request and decide() once per attempt, so
a retry on another instance neither re-tokenizes nor re-hashes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol, TypeVar

import msgspec
import xxhash

from router import worker_threads
from router.apis.completions.prompt_embeds import EngineDtype, embedded_prompt
from router.apis.messages.chat import TemplateProbes, template_probes
from router.apis.openai_body import ChatRequest, CompletionRequest, ResponsesChatRequest
from router.apis.responses.chat import ChatTokenizer
from router.dispatch.decide.session_placements import SessionPlacements
from router.index.block_index import BlockIndex
from router.index.pool import IndexOnlyMatches, PrefixMatches
from router.index.routing_index import RoutingIndex
from router.metrics import RouterMetrics
from router.programs.table import NO_PROGRAMS, NoPrograms, Programs
from router.prompt import block_hashing
from router.prompt.chat_conversation import InvalidPrompt, engine_messages
from router.prompt.multimodal.block_keys import Placed, multimodal_chain
from router.prompt.multimodal.chat_images import has_image_parts
from router.prompt.multimodal.fetch import ImageFetcher
from router.prompt.multimodal.layouts import Idefics3Layout
from router.prompt.multimodal.prompt import remote_image_urls
from router.prompt.remote_tokenizer import RemoteTokenizer
from router.prompt.template_inputs import TemplateInputs
from router.prompt.tokenization import PromptTokenizer, token_ids_given
from router.prompt.tokenization_audit import TokenizationAudit
from router.prompt.tokenizer_check import TokenizerWatch
from router.tracing.spans import NULL_TRACE, Trace
from router.upstreams.instances import Instance
from scorers.plugins import WAIT_CAUSED_WEIGHT
from scorers.policy import Policy
from scorers.request import NO_MATCH, RoutingRequest, TierMatch
from scorers.ttft_features import features_for, reused_blocks
from scorers.ttft_model import TTFTFeatures

T = TypeVar("T")

log = logging.getLogger(__name__)


class TruncatedPrompt(Exception):
    """truncate_prompt_tokens: what the engine computes is not the prompt's start."""


class UnreproducibleTemplate(Exception):
    """The request feeds the chat template inputs the router cannot render as the engine will."""


class UnknownEngineDtype(Exception):
    """prompt_embeds for a model whose engines' dtype is not configured: their blocks' keys cannot be told."""


class KeyedPrompt(NamedTuple):
    """The prompt's token ids as the engine will see them, and what keys its blocks besides them."""

    ids: list[int]
    images: Sequence[Placed] = ()  # placed in the ids
    embeds: Sequence[bytes] = ()  # each full block's digest of its prompt_embeds rows


class LocalTokenizer(ChatTokenizer, Protocol):
    def completion_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[int]: ...

    @property
    def image_layout(self) -> Idefics3Layout | None: ...

    def chat_with_images(
        self,
        model_id: str,
        messages: Sequence[Any],
        flags: tuple[bool, bool, bool],
        inputs: TemplateInputs,
        fetched: Mapping[str, bytes] | None = None,
    ) -> tuple[list[int], list[Placed]]: ...


@dataclass(frozen=True, slots=True)
class Prepared:
    request: RoutingRequest

    @property
    def chain(self) -> Sequence[int]:
        return self.request.chain


@dataclass(frozen=True, slots=True)
class Decision:
    instance: Instance
    prompt_tokens: int
    prompt_blocks: int
    cached_blocks: int
    uncached_tokens: int
    features: TTFTFeatures
    predicted_ttft_s: float
    explained: Mapping[str, float] = field(default_factory=dict)  # the policy's figures (scorers/plugins.py)
    speculated: Any = None  # what RoutingIndex.routed entered as pending at the instance, for withdraw
    reused: TierMatch = NO_MATCH  # the blocks the instance would reuse, by tier
    chain: Sequence[int] = ()  # the prompt's whole blocks, held there while it is in flight
    session_key: str | None = None  # the router's digest of the client's session key
    request: RoutingRequest | None = None  # what the policy chose it for (its after-response hook's)


def uncached_at_best(request: RoutingRequest) -> int:
    """The prompt tokens the instance holding most of it would still compute: the work a queue orders by."""
    best = max((m.gpu + m.cpu + m.pool for m in request.matches.values()), default=0)
    reusable = max(request.prompt_tokens - 1, 0) // request.block_size
    return request.prompt_tokens - min(best, reusable) * request.block_size


@dataclass(frozen=True)
class DeciderOptions:
    """What a decider may be given beyond its index and tokenizers."""

    # The Mooncake master to confirm pool credit with (None: pool entries are taken as they are).
    pool: PrefixMatches | None = None
    # The index's matches as they stand (None: the index's own, when it is a BlockIndex).
    index_matches: PrefixMatches | None = None
    # The models that are LoRA adapters, whose blocks the engine keys by the adapter's name.
    adapters: frozenset[str] = frozenset()
    audit_every: int = 0  # one chat in this many is checked (router/prompt/tokenization_audit.py)
    # The models whose engines leave a chat's tools out when its tool_choice is "none" (vLLM's
    # --exclude-tools-when-tool-choice-none).
    tools_out_when_none: frozenset[str] = frozenset()
    watch: TokenizerWatch | None = None  # where the audit's mismatches are raised (None: one of its own)
    # The agent programs followed: a request of none alive starts one (scorers/program_room.py)
    programs: Programs | NoPrograms = NO_PROGRAMS
    # A model's --model on its instances, as they report it: what vLLM hashes its images with.
    model_roots: Callable[[str], Sequence[str]] = lambda model: ()
    images: ImageFetcher | None = None  # fetches the images chats give by URL (None: routed by load)
    # Each model's engines' dtype, which a completion's prompt_embeds are cast to and hashed in.
    embeds_dtypes: Mapping[str, EngineDtype] = field(default_factory=dict)


class Decider:
    def __init__(
        self,
        index: RoutingIndex,
        tokenizers: dict[str, LocalTokenizer],
        block_size: int,
        metrics: RouterMetrics,
        remote: Callable[[str], RemoteTokenizer | None] = lambda model: None,
        options: DeciderOptions = DeciderOptions(),
    ) -> None:
        """remote: for models without a local tokenizer, an instance's /tokenize to ask, if one is up."""
        pool, index_matches, watch = options.pool, options.index_matches, options.watch
        if index_matches is None:
            if not isinstance(index, BlockIndex):
                raise TypeError("a remote index's matches must be given")
            index_matches = IndexOnlyMatches(index)
        self._audit = TokenizationAudit(options.audit_every, watch or TokenizerWatch(metrics), remote)
        self._index_matches = index_matches
        self._pool = self._index_matches if pool is None else pool
        self._adapters = options.adapters
        self._tools_out_when_none = options.tools_out_when_none
        self._index = index
        self._tokenizers = tokenizers
        self._block_size = block_size
        self._metrics = metrics
        self._remote = remote
        # One thread: long prompts take turns there, and the event loop keeps the other core's share.
        self._tokenize_thread = worker_threads.executor(1, "kvroute-tokenize")
        self._placements = SessionPlacements()
        self._programs = options.programs
        self._model_roots = options.model_roots
        self._images = options.images
        self._embeds_dtypes = options.embeds_dtypes

    async def prepare(
        self,
        body: ChatRequest | CompletionRequest,
        session_key: str | None,
        tokenize: bool = True,
        off_loop: bool = False,
        trace: Trace = NULL_TRACE,
    ) -> Prepared:
        """tokenize=False routes without prefix knowledge (a body too large to tokenize); off_loop: tokenize
        on the worker thread (a long prompt would hold up every other request on the event loop); trace: the
        request's, which gets a span for each step."""
        started = time.perf_counter()
        if session_key is not None:  # a client's string, kept per session: store a fixed-size digest
            session_key = xxhash.xxh3_64_hexdigest(session_key.encode())
        try:
            with trace.step("tokenize") as step:  # a failure is the span's error
                keyed = await self._prompt(body, off_loop) if tokenize else KeyedPrompt([])
                step.set("kvroute.prompt_tokens", len(keyed.ids))
        except Exception as exc:  # a template's raise_exception, a bad tool schema, a /tokenize failure...
            # The engine is the judge of what it accepts; the router routes without prefix knowledge.
            log.debug("routing without prefix knowledge: %r", exc)
            self._metrics.untokenized(type(exc).__name__).inc()
            keyed = KeyedPrompt([])
        ids = keyed.ids
        lora_name = body.model if body.model in self._adapters else None
        with trace.step("lookup") as step:
            if keyed.images or keyed.embeds:  # each block its own keys, as the engine's events give them
                extra = (keyed.images, lora_name, body.cache_salt, keyed.embeds)
                chain = multimodal_chain(ids, self._block_size, *extra)
            else:
                key = block_hashing.prompt_key(body.cache_salt, lora_name)
                chain = block_hashing.prompt_chain(ids, self._block_size, key) if ids else []
            # The engine computes the last prompt token whatever it holds, and looks up the blocks before it
            # only: a hybrid model's other groups decide its hit within those (router/index/kv_groups.py).
            reusable = max(len(ids) - 1, 0) // self._block_size
            matches = await self._pool.matches(body.model, chain, reusable) if chain else {}
            step.set("kvroute.prompt_blocks", len(chain))
        request = RoutingRequest(
            model=body.model,
            session_key=session_key,
            prompt_tokens=len(ids),
            prompt_blocks=len(chain),
            block_size=self._block_size,
            matches=matches,
            chain=chain,
            new_program=session_key is not None and self._programs.placed_anew(session_key),
            programs_come_back=self._programs.come_back,
        )
        self._metrics.decision("prepare").observe(time.perf_counter() - started)
        return Prepared(request)

    async def refresh(self, prepared: Prepared) -> Prepared:
        """prepared with its matches looked up again: what the instances and the pool hold now, after it
        waited in the router's queue (a document another request was prefilling may be there by now)."""
        request = prepared.request
        if not request.chain:
            return prepared
        reusable = max(request.prompt_tokens - 1, 0) // self._block_size
        # The index alone: a pool master's round trip would hold up the queue behind it (the pool entries are
        # taken as announced; the arrival's lookup confirmed those it had then).
        matches = await self._index_matches.matches(request.model, request.chain, reusable)
        return Prepared(replace(request, matches=matches))

    def anthropic_probes(self, model: str) -> TemplateProbes | None:
        """What vLLM's Messages server finds by trying the model's chat template
        (router/apis/messages/chat.py); None without a local tokenizer."""
        tokenizer = getattr(self._tokenizers.get(model), "tokenizer", None)
        return template_probes(tokenizer) if isinstance(tokenizer, PromptTokenizer) else None

    def decide(
        self, prepared: Prepared, policy: Policy, candidates: Sequence[Instance], trace: Trace = NULL_TRACE
    ) -> Decision:
        """policy's choice among candidates; trace: the span it is made under, which gets a child for it."""
        return self.decide_scored(prepared, policy, candidates, trace)[0]

    def decide_scored(
        self, prepared: Prepared, policy: Policy, candidates: Sequence[Instance], trace: Trace = NULL_TRACE
    ) -> tuple[Decision, Sequence[float]]:
        """decide, with each candidate's total score the choice was made by (none: one candidate), which
        the Decision does not keep: over a large fleet they would stay with every request in flight."""
        with trace.step("decide") as step:
            decision, totals = self._decide(prepared, policy, candidates)
            step.decided(decision, policy.name)
        return decision, totals

    def _decide(
        self, prepared: Prepared, policy: Policy, candidates: Sequence[Instance]
    ) -> tuple[Decision, Sequence[float]]:
        started = time.perf_counter()
        pick = policy.pick(prepared.request, candidates)
        instance = candidates[pick.index]
        self._metrics.wait_caused_weight(policy.name).set(pick.explained.get(WAIT_CAUSED_WEIGHT, 0.0))
        match = prepared.request.matches.get(instance.name, NO_MATCH)
        held = match.gpu + match.cpu + match.pool
        # One that loads part of its prompt first (the connectors load asynchronously) enters nothing it will
        # compute for the requests behind it: one admitted meanwhile loads and computes its own copy.
        entered = prepared.chain if not (match.cpu or match.pool) else prepared.chain[:held]
        speculated = self._index.routed(instance.name, entered, held)
        features = features_for(prepared.request, instance)
        self._metrics.decision("choose").observe(time.perf_counter() - started)
        tokens = prepared.request.prompt_tokens
        predicted_s = instance.ttft_model.predict(features)
        decision = Decision(
            instance,
            tokens,
            prepared.request.prompt_blocks,
            cached_blocks=(tokens - features.uncached_tokens) // self._block_size,
            uncached_tokens=features.uncached_tokens,
            features=features,
            predicted_ttft_s=predicted_s,
            explained=pick.explained,
            speculated=speculated,
            reused=reused_blocks(prepared.request, instance.name),
            chain=prepared.chain,
            session_key=prepared.request.session_key,
            request=prepared.request,
        )
        return decision, pick.totals

    def decode_leg(self, decision: Decision) -> Decision:
        """decision (a whole request on a decode instance) as the decode leg after a prefill leg: the
        instance fetches what it does not hold from the prefill instance instead of computing it (vLLM's
        MultiConnector loads from its first connector that has the blocks: the transfer, before the pool)."""
        features = decision.features
        fetched = features._replace(
            uncached_tokens=0,
            loaded_tokens=0,
            attention_pairs=0.0,
            transferred_tokens=features.uncached_tokens + features.loaded_tokens,
        )
        return replace(
            decision,
            uncached_tokens=0,
            features=fetched,
            predicted_ttft_s=decision.instance.ttft_model.predict(fetched),
        )

    def served(self, decision: Decision, policy: Policy) -> None:
        """decision is the one an instance answered (a request retried elsewhere counts once)."""
        reused = decision.reused
        self._metrics.prompt_tokens(policy.name).inc(decision.prompt_tokens)
        if decision.session_key is not None:
            placement = self._placements.record(decision.session_key, decision.instance.name)
            self._metrics.session_turns(policy.name, placement).inc()
        for tier, blocks in zip(("gpu", "cpu", "pool"), (reused.gpu, reused.cpu, reused.pool), strict=True):
            if blocks:
                self._metrics.predicted_cached(policy.name, tier).inc(blocks * self._block_size)

    def sessions_placed(self) -> dict[str, str]:
        """Where this router sent sessions' turns since the last call (session key -> instance), for its
        peers."""
        return self._placements.placed_here()

    def sessions_placed_elsewhere(self, placements: Mapping[str, str], policies: Iterable[Policy]) -> None:
        """Where a peer sent sessions' turns: each policy's session affinity follows them."""
        listening = list(policies)
        for session_key, instance in placements.items():
            self._placements.placed_elsewhere(session_key, instance)
            for policy in listening:
                policy.placed_elsewhere(session_key, instance)

    def withdraw(self, decision: Decision) -> None:
        """The request never ran where it was routed: take back the blocks decide() entered for it there."""
        if decision.speculated is not None:
            self._index.withdraw(decision.instance.name, decision.speculated)

    def close(self) -> None:
        self._audit.close()
        self._tokenize_thread.shutdown(wait=False, cancel_futures=True)

    async def _prompt(self, body: ChatRequest | CompletionRequest, off_loop: bool) -> KeyedPrompt:
        """The prompt's token ids as the engine will see them, and its images placed in them: a chat with
        images, of a model whose images are laid out here, is rendered here whatever it carries (tools too:
        an instance's /tokenize would give its ids without its images' keys)."""
        if isinstance(body, CompletionRequest):
            if body.prompt is None:
                return await self._embedded(body, off_loop)
            return KeyedPrompt(await self._token_ids(body, off_loop))
        local = self._tokenizers.get(body.model)
        if local is None or local.image_layout is None or not has_image_parts(body.messages):
            return KeyedPrompt(await self._token_ids(body, off_loop))
        if body.truncate_prompt_tokens is not None:
            raise TruncatedPrompt("the engine keeps only the prompt's last tokens")
        if body.documents is not None or body.chat_template is not None:
            raise UnreproducibleTemplate("documents or a request's own template reach the template")
        roots = self._model_roots(body.model)
        if len(roots) != 1:  # vLLM hashes an image with its --model: each path its own keys
            raise InvalidPrompt(f"images are keyed by the model's path on its instances: {len(roots)} known")
        body = self._tools_rendered(body)
        kwargs = body.engine_template_inputs().get("chat_template_kwargs")
        inputs = TemplateInputs(body.tools, kwargs, isinstance(body, ResponsesChatRequest))
        flags = (body.add_generation_prompt, body.continue_final_message, body.add_special_tokens)
        fetched = {}
        if urls := remote_image_urls(body.messages):
            if self._images is None:
                raise InvalidPrompt("images given by URL are not fetched (tokenization.image_url_domains)")
            fetched = await self._images.fetch_all(urls)
        chat = (roots[0], body.messages, flags, inputs, fetched)
        return KeyedPrompt(*await self._local(off_loop, local.chat_with_images, *chat))

    async def _embedded(self, body: CompletionRequest, off_loop: bool) -> KeyedPrompt:
        """A completion given as prompt_embeds: one position per row, each token id 0 (vLLM's)."""
        if body.truncate_prompt_tokens is not None:
            raise TruncatedPrompt("the engine keeps only the prompt's last positions")
        embeds = body.prompt_embeds
        if isinstance(embeds, list) and len(embeds) == 1:
            embeds = embeds[0]
        if not isinstance(embeds, str):
            raise InvalidPrompt("prompt_embeds are several prompts, or not base64")
        dtype = self._embeds_dtypes.get(body.model)
        if dtype is None:
            raise UnknownEngineDtype(f"models[{body.model}].dtype is not set")
        prompt = await self._local(off_loop, embedded_prompt, embeds, dtype, self._block_size)
        return KeyedPrompt([0] * prompt.positions, embeds=prompt.block_digests)

    def _tools_rendered(self, body: ChatRequest) -> ChatRequest:
        """body with the tools its engine renders: none for a tool_choice "none" on a model run with
        --exclude-tools-when-tool-choice-none."""
        if body.tools is not None and body.tool_choice == "none" and body.model in self._tools_out_when_none:
            return msgspec.structs.replace(body, tools=None)
        return body

    async def _token_ids(self, body: ChatRequest | CompletionRequest, off_loop: bool) -> list[int]:
        """The prompt's token ids as the engine will see them; [] when nothing here can tell."""
        if body.truncate_prompt_tokens is not None:
            raise TruncatedPrompt("the engine keeps only the prompt's last tokens")
        local = self._tokenizers.get(body.model)
        if isinstance(body, CompletionRequest):
            given = token_ids_given(body.prompt)
            if given is not None:  # token ids are the engine's prompt as they are: no tokenizer needed
                return given
            if local is not None:
                return await self._local(off_loop, local.completion_ids, body.prompt, body.add_special_tokens)
            remote = self._remote(body.model)
            if remote is None:
                return []
            return await remote.completion_ids(body.prompt, add_special_tokens=body.add_special_tokens)
        if body.documents is not None:
            raise UnreproducibleTemplate("documents reach the template")
        body = self._tools_rendered(body)
        flags = {
            "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
            "add_special_tokens": body.add_special_tokens,
        }
        template_inputs = body.engine_template_inputs()
        with_inputs = bool(template_inputs)
        # A Responses request's tool calls reach the template in another order than /tokenize's (the audit's).
        responses = isinstance(body, ResponsesChatRequest)
        if local is not None and body.chat_template is None and self._audit.trusts(body.model, with_inputs):
            try:
                ids = await self._local(
                    off_loop,
                    local.chat_ids,
                    body.messages,
                    body.add_generation_prompt,
                    body.continue_final_message,
                    body.add_special_tokens,
                    TemplateInputs(body.tools, template_inputs.get("chat_template_kwargs"), responses),
                )
            except InvalidPrompt:
                if not with_inputs:  # with tools or kwargs, a shape beyond what is built here: ask the engine
                    raise
            else:
                if not responses:
                    self._audit.consider(body.model, body.messages, flags, template_inputs, ids)
                return ids
        if responses:  # /tokenize would lay its tool calls out as a chat's
            raise UnreproducibleTemplate("a Responses prompt without a local tokenizer")
        # A request's own template (and chats the audit found rendered differently) go to the engine's code.
        remote = self._remote(body.model)
        if remote is None:
            return []
        # /tokenize keeps the deprecated reasoning_content that the chat endpoint renames.
        return await remote.chat_ids(engine_messages(body.messages), **flags, template_inputs=template_inputs)

    async def _local(self, off_loop: bool, tokenize: Callable[..., T], *args: Any) -> T:
        if not off_loop:
            return tokenize(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_thread, tokenize, *args)
