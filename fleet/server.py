"""One simulated vLLM instance: vLLM's OpenAI API subset, /tokenize, /health and /metrics, over aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleet.block_pool import Adapter
from fleet.cache_config import cache_config_labels
from fleet.engine import Engine, PromptCache
from fleet.kv_transfer import KVTransfers, TransferSide
from fleet.response_store import ResponseStore
from fleet.responses import Envelope, model_card
from fleet.sampling import request_seed, sampler
from fleet.sampling_checks import sampling_error
from router.apis.openai_body import (
    BOOLEAN_FIELDS,
    DATA_PARALLEL_RANK_HEADER,
    chat_endpoint_template_kwargs,
    lax_bool,
)
from router.prompt.chat_conversation import InvalidPrompt
from router.prompt.multimodal.block_keys import Placed
from router.prompt.template_inputs import TemplateInputs
from router.prompt.tokenization import PromptTokenizer

_json = msgspec.json.Encoder()
_T = TypeVar("_T")


@dataclass
class SimInstance:
    name: str
    model_name: str
    engines: list[Engine]  # one per data-parallel rank, in rank order, behind one API server
    tokenizer: PromptTokenizer
    vocabulary: list[int]
    max_model_len: int
    created: int
    root: str = ""
    started: float = field(default_factory=time.time)  # as vLLM's process_start_time_seconds
    adapters: tuple[Adapter, ...] = ()  # LoRA adapters, by --lora-modules
    api_key: str | None = None  # vLLM's --api-key
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's option: the chat endpoint only, not /tokenize
    prompt_tokens_details: bool = False  # vLLM's --enable-prompt-tokens-details: usage says what was cached
    # vLLM's --override-generation-config '{"max_new_tokens": N}': the output budget of a request naming none
    max_new_tokens: int | None = None
    # Where the simulated model samples its EOS: an answer ends there (finish_reason stop) unless its budget
    # ends first. None: never (the sampler draws printable tokens only); agents take a cut answer for an error
    eos_after: int | None = None
    # vLLM's --enable-auto-tool-choice with a --tool-call-parser: without them a chat (or an Anthropic body)
    # whose tool_choice is not "none" is refused. Agents send tools, so the simulated fleet takes them.
    auto_tool_choice: bool = True
    # The Responses API's store (VLLM_ENABLE_RESPONSES_API_STORE); on here, so turns can be chained
    responses: ResponseStore = field(default_factory=ResponseStore)
    # Its KV connector's end of prefill-to-decode transfer (fleet/kv_transfer.py); None: it runs no connector
    transfer: TransferSide | None = None
    transfers: KVTransfers | None = None  # the fleet's, shared by its instances
    # vLLM's API server renders and tokenizes on a thread of its own: a long prompt does not hold up the
    # requests of its instance, nor, here, those of the other instances sharing this process's event loop.
    tokenize_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, "fleet-tokenize")
    )

    async def off_loop(self, work: Callable[..., _T], *args: Any) -> _T:
        """work(*args) on the instance's tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_thread, work, *args)

    def adapter(self, model: object) -> Adapter | None:
        return next((a for a in self.adapters if a.name == model), None)

    def engine_for(self, request: web.Request) -> Engine:
        """The rank X-data-parallel-rank names, as vLLM's API server sends it; else the least loaded (vLLM's
        balancer counts waiting and running requests)."""
        rank = request.headers.get(DATA_PARALLEL_RANK_HEADER)
        if rank is None:
            return min(self.engines, key=lambda engine: engine.num_waiting + engine.num_running)
        if not rank.isdigit() or int(rank) >= len(self.engines):
            raise ClientError(400, f"no data parallel rank {rank!r} here", "BadRequestError")
        return self.engines[int(rank)]


class ClientError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


def _sse(body: Any) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


_BOM = b"\xef\xbb\xbf"  # vLLM's JSON parsing (Python's json) skips it
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")  # vLLM 0.32's validate_cache_salt


def _check_cache_salt(salt: object) -> None:
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ClientError(
            400,
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            "BadRequestError",
            "cache_salt",
        )
    if len(salt) > 128 or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise ClientError(
            400,
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            "BadRequestError",
            "cache_salt",
        )


async def _read_body(request: web.Request) -> dict[str, Any]:
    try:
        body = msgspec.json.decode((await request.read()).removeprefix(_BOM))
    except msgspec.DecodeError as exc:
        raise ClientError(400, f"invalid JSON body: {exc}", "BadRequestError") from exc
    if not isinstance(body, dict):
        raise ClientError(400, "the request body must be a JSON object", "BadRequestError")
    return checked_fields(body, BOOLEAN_FIELDS)


def checked_fields(body: dict[str, Any], booleans: Iterable[str]) -> dict[str, Any]:
    """body with its booleans read as vLLM's pydantic models read them ("false" is False, "yes" True) and
    its sampling parameters checked as vLLM checks them."""
    for name in booleans:
        if body.get(name) is not None:
            read = lax_bool(body[name])
            if read is None:
                raise ClientError(400, f"{name}: Input should be a valid boolean", "BadRequestError", name)
            body[name] = read
    if (error := sampling_error(body)) is not None:
        name, message = error
        raise ClientError(400, message, "BadRequestError", name)
    return body


def max_tokens_for(
    limit: int,
    body: dict[str, Any],
    prompt_len: int,
    chat: bool,
    from_text: bool,
    default: int | None = None,
) -> int:
    """vLLM 0.32's rules: reject what can never fit, otherwise clamp the output budget to the context;
    default: the budget of a request naming none (vLLM's max_new_tokens generation config), else the rest of
    the context."""
    completion_budget = chat and body.get("max_completion_tokens") is not None
    param = "max_completion_tokens" if completion_budget else "max_tokens"
    requested = body.get(param, None if chat else 16)
    if requested is not None and (type(requested) is not int or requested < 1):
        raise ClientError(400, f"{param} must be a positive integer", "BadRequestError", param)
    if requested is not None and requested > limit:
        raise ClientError(
            400,
            f"{param}={requested} cannot be greater than max_model_len={limit}. Please request fewer output "
            f"tokens. (parameter={param}, value={requested})",
            "BadRequestError",
            param,
        )
    if prompt_len >= limit:
        # vLLM tokenizes text truncated to limit + 1 tokens, so it only knows "at least" that many.
        count = f"at least {limit + 1}" if from_text and prompt_len > limit else str(prompt_len)
        value = limit + 1 if from_text and prompt_len > limit else prompt_len
        raise ClientError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt contains "
            f"{count} input tokens, which exceeds this limit even without any output tokens. Please "
            f"reduce the length of the input prompt. (parameter=input_tokens, value={value})",
            "BadRequestError",
            "input_tokens",
        )
    return min(limit - prompt_len, requested or default or limit)


class Generation:
    """What both endpoints share: validation, the engine call, and the response envelopes."""

    def __init__(
        self,
        request: web.Request,
        instance: SimInstance,
        body: dict[str, Any],
        prompt_ids: list[int],
        chat: bool,
        from_text: bool,
    ) -> None:
        self.instance, self.body, self.prompt_ids, self.chat = instance, body, prompt_ids, chat
        self.engine = instance.engine_for(request)
        self.lora = instance.adapter(body.get("model"))
        self.envelope = Envelope(chat=chat, model=body["model"])  # the base's name or an adapter's
        if not prompt_ids:
            raise ClientError(400, "The prompt cannot be empty.", "BadRequestError", "prompt")
        self.max_tokens = max_tokens_for(
            instance.max_model_len, body, len(prompt_ids), chat, from_text, instance.max_new_tokens
        )
        # The tokens the model generates: its budget (max_tokens), or fewer where it samples its EOS first
        eos = instance.eos_after
        self.output_len = min(self.max_tokens, eos) if eos is not None else self.max_tokens
        self.finish_reason = "stop" if self.output_len < self.max_tokens else "length"
        if body.get("n", 1) != 1:
            raise ClientError(400, "the simulated fleet supports n=1 only", "BadRequestError", "n")
        seed = request_seed(body.get("seed"), body.get("temperature", 1.0), prompt_ids)
        self.sample = sampler(instance.vocabulary, seed)
        self.salt = salt if isinstance(salt := body.get("cache_salt"), str) else None
        self.priority = body.get("priority", 0)
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ClientError(400, "priority must be an integer", "BadRequestError", "priority")
        params = body.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise ClientError(400, "kv_transfer_params must be an object", "BadRequestError")
        side = instance.transfer
        # What the instance's connector acts on; other instances ignore the params, as vLLM without one does.
        self.remote_decode = bool(side and side.produces and params and params.get("do_remote_decode"))
        self.remote_prefill = bool(side and side.consumes and params and params.get("do_remote_prefill"))
        self.transfer_params: dict[str, Any] = params or {}
        self.cache = PromptCache()
        self.images: list[Placed] = []  # a chat's images, placed in its prompt

    async def tokens(self) -> AsyncIterator[int]:
        load = self._fetch if self.remote_prefill and self.instance.transfers is not None else None
        connector = self.instance.transfer is not None
        async for token in self.engine.generate(
            self.prompt_ids,
            self.output_len,
            self.sample,
            self.salt,
            self.lora,
            connector,
            load,
            self.cache,
            self.finish_reason,
            self.priority,
            self.images,
        ):
            yield token

    def reported_cache(self) -> PromptCache | None:
        """What a chat or completion's usage reports of the prompt's cache: nothing unless the instance runs
        with --enable-prompt-tokens-details."""
        return self.prompt_cache() if self.instance.prompt_tokens_details else None

    def prompt_cache(self) -> PromptCache:
        """What the prompt found cached. A decode leg given the prefill leg's count (vLLM's
        remote_prefill_cached_tokens) reports that instead of what it loaded."""
        remote, params = self.transfer_params.get("remote_prefill_cached_tokens"), self.transfer_params
        if params.get("do_remote_prefill") and type(remote) is int:
            return replace(self.cache, cached_tokens=remote)
        return self.cache

    async def _fetch(self) -> bool:
        assert self.instance.transfers is not None
        return await self.instance.transfers.fetch(self.transfer_params, self.prompt_ids)

    def kept_for_decode(self) -> dict[str, Any] | None:
        """A prefill leg's KV kept for its decode leg; the answer's kv_transfer_params."""
        instance = self.instance
        if not self.remote_decode or instance.transfers is None or instance.transfer is None:
            return None
        return instance.transfers.keep(instance.transfer, self.transfer_params, self.prompt_ids)


async def _complete(request: web.Request, generation: Generation) -> web.StreamResponse:
    if generation.body.get("stream"):
        return await _stream(request, generation)
    output = [token async for token in generation.tokens()]
    text = generation.instance.tokenizer.decode(output)
    prompt_tokens, cache = len(generation.prompt_ids), generation.reported_cache()
    body = generation.envelope.body(text, generation.finish_reason, prompt_tokens, len(output), cache)
    body["kv_transfer_params"] = generation.kept_for_decode()
    return json_response(body)


async def _stream(request: web.Request, generation: Generation) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    envelope, token_text = generation.envelope, generation.instance.tokenizer.token_text
    count = 0
    async for token in generation.tokens():
        if count == 0 and generation.chat:  # vLLM sends the role with the first output, not before
            await response.write(_sse(envelope.role_chunk()))
        count += 1
        finish = generation.finish_reason if count == generation.output_len else None
        await response.write(_sse(envelope.token_chunk(token_text(token), finish)))
    options = generation.body.get("stream_options") or {}
    if isinstance(options, dict) and options.get("include_usage"):
        usage = envelope.usage_chunk(len(generation.prompt_ids), count, generation.reported_cache())
        await response.write(_sse(usage))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _aliases(instance: SimInstance) -> str:
    return ", ".join([instance.model_name, *(a.name for a in instance.adapters)])


def check_model(instance: SimInstance, body: dict[str, Any]) -> None:
    """A body naming no model is for the instance's own, as vLLM takes it."""
    if not body.get("model"):
        body["model"] = instance.model_name
    if body.get("model") != instance.model_name and instance.adapter(body.get("model")) is None:
        raise ClientError(
            404,
            f"The model `{body.get('model')}` does not exist. Valid aliases: {_aliases(instance)}.",
            "NotFoundError",
            "model",
        )


def handler(
    work: Callable[[SimInstance, web.Request, dict[str, Any]], Any],
) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.StreamResponse:
        instance: SimInstance = request.app["instance"]
        try:
            body = await _read_body(request)
            return await work(instance, request, body)  # type: ignore[no-any-return]
        except ClientError as exc:
            return error_response(exc.status, exc.message, exc.kind, exc.param)
        except InvalidPrompt as exc:
            return error_response(400, str(exc), "BadRequestError")

    return handle


def _chat_ids(
    instance: SimInstance,
    body: dict[str, Any],
    reasoning_effort: Any = None,
    tools_out_when_none: bool = False,
) -> list[int]:
    """A chat body's prompt as vLLM tokenizes it, with vLLM's defaults for the flags that change it;
    reasoning_effort: the body's, and tools_out_when_none: the instance's option, where the endpoint takes
    them (the chat endpoint, not /tokenize)."""
    tools = None if tools_out_when_none and body.get("tool_choice") == "none" else body.get("tools")
    return instance.tokenizer.chat_ids(
        body["messages"],
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        add_special_tokens=body.get("add_special_tokens", False),
        inputs=TemplateInputs(
            tools, chat_endpoint_template_kwargs(body.get("chat_template_kwargs"), reasoning_effort)
        ),
    )


def _completion_ids(instance: SimInstance, body: dict[str, Any]) -> list[int]:
    return instance.tokenizer.completion_ids(body["prompt"], body.get("add_special_tokens", True))


def _check_tool_choice(instance: SimInstance, body: dict[str, Any]) -> None:
    """vLLM's refusal of a tool choice it has no parser for (tools alone mean "auto")."""
    choice = body.get("tool_choice", "auto" if body.get("tools") else None)
    if instance.auto_tool_choice or choice in (None, "none"):
        return
    if choice == "auto":
        message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    else:
        named = isinstance(choice, dict) and isinstance(choice.get("function"), dict)
        shown = f'function "{choice["function"].get("name")}"' if named else f'"{choice}"'
        message = f"tool_choice={shown} requires --tool-call-parser to be set"
    raise ClientError(400, message, "BadRequestError")


def validated_chat(instance: SimInstance, body: dict[str, Any]) -> list[int]:
    """A chat request's prompt token ids, after the checks vLLM makes first (generate and render alike)."""
    return validated_chat_with_images(instance, body)[0]


def validated_chat_with_images(instance: SimInstance, body: dict[str, Any]) -> tuple[list[int], list[Placed]]:
    """validated_chat's ids, and the chat's images placed in them: inline images, for a model whose image
    layout the router's code knows (router/prompt/multimodal/), as vLLM lays them out and hashes them."""
    check_model(instance, body)
    _check_cache_salt(body.get("cache_salt"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError(400, "messages must be a non-empty list", "BadRequestError", "messages")
    _check_tool_choice(instance, body)
    effort, tools_out = body.get("reasoning_effort"), instance.exclude_tools_when_tool_choice_none
    try:
        return _chat_ids(instance, body, effort, tools_out), []
    except InvalidPrompt:
        if instance.tokenizer.image_layout is None:
            raise
    flags = (
        body.get("add_generation_prompt", True),
        body.get("continue_final_message", False),
        body.get("add_special_tokens", False),
    )
    tools = None if tools_out and body.get("tool_choice") == "none" else body.get("tools")
    inputs = TemplateInputs(tools, chat_endpoint_template_kwargs(body.get("chat_template_kwargs"), effort))
    return instance.tokenizer.chat_with_images(instance.root, messages, flags, inputs)


def validated_completion(instance: SimInstance, body: dict[str, Any]) -> tuple[list[int], bool]:
    """A completion's prompt token ids and whether they came from text, after vLLM's first checks."""
    check_model(instance, body)
    _check_cache_salt(body.get("cache_salt"))
    if "prompt" not in body:
        raise ClientError(400, "prompt is required", "BadRequestError", "prompt")
    ids = _completion_ids(instance, body)
    from_text = not isinstance(body["prompt"], list) or any(isinstance(p, str) for p in body["prompt"])
    return ids, from_text


async def _chat(instance: SimInstance, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    ids, images = await instance.off_loop(validated_chat_with_images, instance, body)
    generation = Generation(request, instance, body, ids, chat=True, from_text=True)
    generation.images = images
    return await _complete(request, generation)


async def _completion(
    instance: SimInstance, request: web.Request, body: dict[str, Any]
) -> web.StreamResponse:
    ids, from_text = await instance.off_loop(validated_completion, instance, body)
    generation = Generation(request, instance, body, ids, chat=False, from_text=from_text)
    return await _complete(request, generation)


async def _tokenize(instance: SimInstance, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    if "messages" in body:
        ids = await instance.off_loop(_chat_ids, instance, body)
    elif isinstance(body.get("prompt"), str):  # vLLM's /tokenize takes a completion prompt as text only
        ids = await instance.off_loop(_completion_ids, instance, body)
    else:
        raise ClientError(400, "either messages or prompt (a string) is required", "BadRequestError")
    return json_response(
        {"count": len(ids), "max_model_len": instance.max_model_len, "tokens": ids, "token_strs": None}
    )


async def _models(request: web.Request) -> web.Response:
    instance: SimInstance = request.app["instance"]
    card = model_card(instance.model_name, instance.root, instance.max_model_len, instance.created)
    adapters = [  # as vLLM lists them: the base as parent, no max_model_len
        model_card(a.name, a.path or a.name, None, instance.created, parent=instance.model_name)
        for a in instance.adapters
    ]
    return json_response({"object": "list", "data": [card, *adapters]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    instance: SimInstance = request.app["instance"]
    return json_response({"success": all([engine.reset_prefix_cache() for engine in instance.engines])})


async def _cache_state(request: web.Request) -> web.Response:
    instance: SimInstance = request.app["instance"]
    ranks = [engine.pool.cached_hashes for engine in instance.engines]  # distinct hashes held, per rank
    return json_response({"block_hashes": sum(ranks), "ranks": ranks})


_GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}


class _EngineCollector:
    """Exposes the engine's state under vLLM's metric names and labels, read at scrape time."""

    def __init__(self, instance: SimInstance) -> None:
        self._instance = instance

    def collect(self) -> Iterable[Metric]:
        """Each family with one sample per engine, labelled by its rank, as vLLM's data-parallel servers."""
        instance, names = self._instance, ["model_name", "engine"]
        # vLLM's /metrics carries its process's start time; a router tells a restart by it.
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            instance.started,
        )
        values: dict[str, list[float]] = {}
        for engine in instance.engines:
            stats = engine.stats
            for name, value in {
                "vllm:num_requests_running": engine.num_running,
                "vllm:num_requests_waiting": engine.num_waiting,
                "vllm:kv_cache_usage_perc": engine.pool.usage,
                "vllm:prefix_cache_queries": stats.prefix_cache_queries,
                "vllm:prefix_cache_hits": stats.prefix_cache_hits,
                # Outside the local cache, only decode legs look up (and fetch from a prefill instance).
                "vllm:external_prefix_cache_queries": stats.external_prefix_cache_queries,
                "vllm:external_prefix_cache_hits": stats.external_prefix_cache_hits,
                "vllm:prompt_tokens": stats.prompt_tokens,
                "vllm:generation_tokens": stats.generation_tokens,
                "vllm:num_preemptions": stats.preemptions,
            }.items():
                values.setdefault(name, []).append(value)
        for name, samples in values.items():
            family = GaugeMetricFamily if name in _GAUGES else CounterMetricFamily
            metric = family(name, name.removeprefix("vllm:").replace("_", " "), labels=names)
            for rank, value in enumerate(samples):
                metric.add_metric([instance.model_name, str(rank)], value)
            yield metric
        configs = [
            cache_config_labels(e.pool.num_blocks, e.pool.block_size, rank, e.hasher.algorithm)
            for rank, e in enumerate(instance.engines)
        ]
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(configs[0])
        )
        for config in configs:
            cache.add_metric(list(config.values()), 1.0)
        yield cache
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*names, "source"],
        )
        for rank, engine in enumerate(instance.engines):
            for source, tokens in engine.stats.prompt_tokens_by_source.items():
                by_source.add_metric([instance.model_name, str(rank), source], tokens)
        yield by_source
        success = CounterMetricFamily(
            "vllm:request_success", "finished requests", labels=["engine", "finished_reason", "model_name"]
        )
        for rank, engine in enumerate(instance.engines):
            for reason in ("stop", "length", "abort", "error"):
                finished = engine.stats.finished.get(reason, 0)
                success.add_metric([str(rank), reason, instance.model_name], finished)
        yield success


# vLLM's --api-key guards these path prefixes only (/health, /metrics, /tokenize stay open).
_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def _api_key_guard(key: str) -> Any:
    digest = hashlib.sha256(key.encode()).digest()

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        given_digest = hashlib.sha256(given.encode()).digest()
        granted = scheme.lower() == "bearer" and hmac.compare_digest(given_digest, digest)
        if request.method != "OPTIONS" and request.path.startswith(_GUARDED_PREFIXES) and not granted:
            return json_response({"error": "Unauthorized"}, 401)
        return await handler(request)  # type: ignore[no-any-return]

    return guard


@web.middleware
async def _json_route_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown path or a wrong method answered as vLLM's server (Starlette) answers them."""
    try:
        return await handler(request)  # type: ignore[no-any-return]
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow",)}
        detail = {"detail": "Not Found" if exc.status == 404 else "Method Not Allowed"}
        return web.Response(
            status=exc.status, body=_json.encode(detail), content_type="application/json", headers=headers
        )


def build_app(
    instance: SimInstance, extra_routes: Callable[[web.Application], None] = lambda app: None
) -> web.Application:
    """extra_routes: adds routes built on this module's request handling (fleet/render.py's, the agent
    APIs': fleet/launcher.py's add_api_routes)."""
    middlewares = [_api_key_guard(instance.api_key)] if instance.api_key else []
    middlewares.append(_json_route_errors)
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
    app["instance"] = instance
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(instance))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain", charset="utf-8")

    app.router.add_post("/v1/chat/completions", handler(_chat))
    app.router.add_post("/v1/completions", handler(_completion))
    app.router.add_post("/tokenize", handler(_tokenize))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_get("/debug/cache", _cache_state)  # not vLLM's: what the router's index should hold
    extra_routes(app)
    return app


@contextlib.asynccontextmanager
async def serve(
    instance: SimInstance,
    host: str,
    port: int,
    extra_routes: Callable[[web.Application], None] = lambda app: None,
) -> AsyncIterator[web.AppRunner]:
    # handler_cancellation: a client that goes away cancels its handler, which aborts the engine request.
    runner = web.AppRunner(build_app(instance, extra_routes), handler_cancellation=True, access_log=None)
    await runner.setup()
    transfers, side = instance.transfers, instance.transfer
    try:
        await web.TCPSite(runner, host, port).start()
        if transfers is not None and side is not None:
            transfers.serve(side)
        yield runner
    finally:
        if transfers is not None and side is not None:
            transfers.stop(side.engine_id)  # what it kept for decode legs goes with it
        await runner.cleanup()
