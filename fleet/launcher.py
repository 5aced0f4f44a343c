"""Runs N simulated vLLM instances in one process: HTTP server, engine and event publisher each."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from fleet.block_pool import Adapter, BlockHasher, BlockPool
from fleet.engine import Engine, EngineTiming
from fleet.kv_transfer import Connector, KVTransfers, Role, TransferSide
from fleet.messages_api import add_messages_routes
from fleet.publisher import EventPublisher
from fleet.render import add_render_routes
from fleet.response_store import DEFAULT_CAPACITY, ResponseStore
from fleet.responses_api import add_responses_routes
from fleet.sampling import printable_token_ids
from fleet.server import SimInstance, serve
from router.prompt.tokenization import PromptTokenizer


@dataclass(frozen=True)
class FleetOptions:
    tokenizer_path: Path
    instances: int = 3
    host: str = "127.0.0.1"
    port: int = 8101
    event_port: int = 5601
    replay_port: int = 5701
    model_name: str = "tiny-llama"
    block_size: int = 32
    kv_blocks: int = 2048
    max_model_len: int = 32768
    max_new_tokens: int | None = None  # the output budget of a request naming none (vLLM's generation config)
    eos_after: int | None = None  # where the simulated model ends its answers; None: at their budget
    event_encoding: str = "map"
    int_hashes: bool = True
    hash_seed: str = "0"
    hash_algorithm: str = "sha256"  # vLLM's --prefix-caching-hash-algo: sha256 or sha256_cbor
    name_prefix: str = "fleet-"
    first_index: int = 0
    drop_events: float = 0.0  # share of event batches not published live (replay still has them)
    # The ZMQ topic of every event frame, {instance} and {model} filled in. vLLM's default is empty, and
    # vllm-router's kv_aware (0.1.17) drops every frame under any other; llm-d's indexer wants
    # kv@{instance}@{model}.
    events_topic: str = ""
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) of the LoRA adapters every instance serves
    api_key: str | None = None  # what every instance requires on /v1, as vLLM's --api-key
    exclude_tools_when_tool_choice_none: bool = False  # as vLLM's option
    prompt_tokens_details: bool = False  # as vLLM's --enable-prompt-tokens-details
    # as vLLM's --enable-auto-tool-choice with a --tool-call-parser: on, since agents send tools
    auto_tool_choice: bool = True
    # The Responses API's store, as vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1 (on: turns can be chained with
    # previous_response_id, background runs work); each instance keeps at most this many responses
    responses_store: bool = True
    responses_store_capacity: int = DEFAULT_CAPACITY
    # Engines per instance behind its one API server (vllm serve --data-parallel-size); rank R of instance I
    # publishes at event_port + I x size + R, as vLLM offsets each rank's ports.
    data_parallel_size: int = 1
    timing: EngineTiming = field(default_factory=EngineTiming)
    # Prefill/decode disaggregation: each instance's role (all "both" when empty), the transfer connector the
    # instances run, and MooncakeConnector's bootstrap port of the first (instance i: + i).
    roles: tuple[Role, ...] = ()
    kv_connector: Connector = "nixl"
    bootstrap_port: int = 8998

    def instance_name(self, index: int) -> str:
        return f"{self.name_prefix}{self.first_index + index}"

    def transfer_side(self, index: int) -> TransferSide:
        """Instance index's end of the KV transfer: its engine id is its name."""
        return TransferSide(
            self.instance_name(index),
            f"http://{self.host}:{self.bootstrap_port + index}",
            self.host,
            self.port + index,
            self.roles[index] if self.roles else "both",
        )


def add_api_routes(app: web.Application) -> None:
    """What every instance serves beside the chat and completion endpoints: the render endpoints, the
    Responses API and the Anthropic Messages API."""
    add_render_routes(app)
    add_responses_routes(app)
    add_messages_routes(app)


async def run_fleet(
    options: FleetOptions, tokenizer: PromptTokenizer, ready: asyncio.Event | None = None
) -> None:
    """tokenizer: options.tokenizer_path's, loaded by the caller (a bad path is its error to report)."""
    vocabulary = printable_token_ids(tokenizer)
    transfers = KVTransfers(options.kv_connector)
    async with contextlib.AsyncExitStack() as stack:
        tasks = []
        for index in range(options.instances):
            name = options.instance_name(index)
            engines = []
            for rank in range(options.data_parallel_size):
                engine = Engine(
                    BlockPool(options.kv_blocks, options.block_size, options.int_hashes),
                    options.timing,
                    BlockHasher(options.hash_seed, options.hash_algorithm),
                )
                offset = index * options.data_parallel_size + rank
                publisher = EventPublisher(
                    f"tcp://{options.host}:{options.event_port + offset}",
                    f"tcp://{options.host}:{options.replay_port + offset}",
                    # an instance's ranks share it
                    topic=options.events_topic.format(instance=name, model=options.model_name),
                    encoding=options.event_encoding,
                    data_parallel_rank=rank,
                    drop_ratio=options.drop_events,
                )
                stack.push_async_callback(publisher.close)
                publisher.start()
                engine.on_events(publisher.publish)
                engines.append(engine)
                tasks.append(asyncio.create_task(engine.run(), name=f"engine-{name}-{rank}"))
            instance = SimInstance(
                name,
                options.model_name,
                engines,
                tokenizer,
                vocabulary,
                options.max_model_len,
                int(time.time()),
                root=str(options.tokenizer_path),
                adapters=tuple(
                    Adapter(name, id, path) for id, (name, path) in enumerate(options.lora_modules, start=1)
                ),
                api_key=options.api_key,
                exclude_tools_when_tool_choice_none=options.exclude_tools_when_tool_choice_none,
                prompt_tokens_details=options.prompt_tokens_details,
                max_new_tokens=options.max_new_tokens,
                eos_after=options.eos_after,
                auto_tool_choice=options.auto_tool_choice,
                responses=ResponseStore(options.responses_store, options.responses_store_capacity),
                transfer=options.transfer_side(index) if options.roles else None,  # roles: a KV connector
                transfers=transfers,
            )
            port = options.port + index
            await stack.enter_async_context(serve(instance, options.host, port, add_api_routes))
        print(
            f"fleet ready: {options.instances} instances, http {options.host}:{options.port}"
            f"-{options.port + options.instances - 1}, events from {options.event_port}, "
            f"replay from {options.replay_port}",
            flush=True,
        )
        if ready is not None:
            ready.set()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
