"""Which tokenizer the routing decision consults, and what it does when none can tell."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from router.apis.openai_body import ChatRequest, CompletionRequest
from router.config import parse_config
from router.dispatch.decide.decision import Decider, DeciderOptions, Prepared
from router.index.block_index import BlockIndex
from router.index.events import BlockStored
from router.metrics import RouterMetrics
from router.programs.settings import ProgramsConfig
from router.programs.table import Programs
from router.prompt import block_hashing
from router.prompt.remote_tokenizer import TokenizeFailed
from router.prompt.template_inputs import TemplateInputs
from router.prompt.token_cache import CachedChatTokenizer
from router.prompt.tokenization import PromptTokenizer
from router.upstreams.instances import Upstreams
from scorers.plugins import WAIT_CAUSED_S, WAIT_CAUSED_WEIGHT
from scorers.policy import Policy
from scorers.request import RoutingRequest, TierMatch

MESSAGES = [{"role": "user", "content": "run the tests " * 40}]


class RecordingRemote:
    """Stands in for an instance's /tokenize: records what it was asked, answers with fixed ids."""

    instance = "engine-0"

    def __init__(self) -> None:
        self.asked: list[Mapping[str, Any] | None] = []

    async def chat_ids(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_inputs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        self.asked.append(template_inputs)
        return self.ids(messages, template_inputs or {})

    def ids(self, messages: Sequence[Any], inputs: Mapping[str, Any]) -> list[int]:
        """What it answers with, for messages rendered with inputs (tools, template kwargs)."""
        return list(range(100))


class AgreeingRemote(RecordingRemote):
    """An engine that renders as the router does."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def ids(self, messages: Sequence[Any], inputs: Mapping[str, Any]) -> list[int]:
        return self.tokenizer.chat_ids(
            messages,
            inputs=TemplateInputs(
                tools=inputs.get("tools"), template_kwargs=inputs.get("chat_template_kwargs")
            ),
        )


def prepare(tokenizer: PromptTokenizer, remote: RecordingRemote, **body: Any) -> int:
    router = Decider(BlockIndex(32), {"tiny-llama": tokenizer}, 32, RouterMetrics(), lambda model: remote)  # type: ignore[arg-type,return-value]
    prepared = asyncio.run(router.prepare(ChatRequest(model="tiny-llama", messages=MESSAGES, **body), None))
    return prepared.request.prompt_tokens


def test_plain_chats_are_tokenized_locally(tokenizer: PromptTokenizer) -> None:
    remote = RecordingRemote()
    assert prepare(tokenizer, remote) == len(tokenizer.chat_ids(MESSAGES))
    assert remote.asked == []


TOOLS = [{"type": "function", "function": {"name": "run_tests"}}]


@pytest.mark.parametrize(
    "inputs",
    [
        {"chat_template": "{{ messages[0]['content'] }}"},
        {"chat_template_kwargs": {"tools": TOOLS}},  # apply_chat_template's own parameter
        {"tools": TOOLS, "chat_template_kwargs": {"truncation": True}},
    ],
)
def test_template_inputs_go_to_the_engine(tokenizer: PromptTokenizer, inputs: dict[str, Any]) -> None:
    remote = RecordingRemote()
    assert prepare(tokenizer, remote, **inputs) == 100
    assert remote.asked == [inputs]


@pytest.mark.parametrize(
    ("kwargs", "reasoning_effort"),
    [
        ({"enable_thinking": None}, None),
        ({"enable_thinking": "auto"}, None),
        ({"enable_thinking": None}, "low"),
    ],
)
def test_kwargs_set_to_null_or_auto_are_left_unset_as_vllm_merges_them(
    tokenizer: PromptTokenizer, kwargs: dict[str, Any], reasoning_effort: str | None
) -> None:
    remote = RecordingRemote()
    tokens = prepare(tokenizer, remote, chat_template_kwargs=kwargs, reasoning_effort=reasoning_effort)
    assert tokens == len(tokenizer.chat_ids(MESSAGES))  # not enable_thinking false's <think></think>
    assert remote.asked == []


class MessageRecordingRemote(RecordingRemote):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[Sequence[Any]] = []

    async def chat_ids(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_inputs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        self.messages.append(messages)
        return await super().chat_ids(messages, template_inputs=template_inputs)


def test_the_engine_asked_for_ids_gets_reasoning_content_renamed_as_its_chat_endpoint_does(
    tokenizer: PromptTokenizer,
) -> None:
    remote = MessageRecordingRemote()
    router = Decider(BlockIndex(32), {}, 32, RouterMetrics(), lambda model: remote)  # type: ignore[arg-type,return-value]
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "x", "reasoning_content": "r"},
        {"role": "user", "content": "y"},
    ]
    asyncio.run(router.prepare(ChatRequest(model="tiny-llama", messages=messages), None))
    assert remote.messages[0][1] == {"role": "assistant", "content": "x", "reasoning": "r"}


def test_a_prompt_the_engine_truncates_is_routed_without_prefix_knowledge(tokenizer: PromptTokenizer) -> None:
    # vLLM keeps its last tokens: none of the blocks hashed from the prompt's start would be computed.
    assert prepare(tokenizer, RecordingRemote(), truncate_prompt_tokens=10) == 0
    router = Decider(BlockIndex(32), {"tiny-llama": tokenizer}, 32, RouterMetrics(), lambda model: None)
    body = CompletionRequest(model="tiny-llama", prompt="run the tests " * 40, truncate_prompt_tokens=10)
    assert asyncio.run(router.prepare(body, None)).request.prompt_tokens == 0


def test_chat_template_kwargs_are_rendered_here_those_the_template_reads(tokenizer: PromptTokenizer) -> None:
    remote = RecordingRemote()
    thinking_off = prepare(tokenizer, remote, chat_template_kwargs={"enable_thinking": False, "unread": 1})
    assert remote.asked == []
    assert thinking_off == len(tokenizer.chat_ids(MESSAGES)) + len(
        tokenizer.text_ids("<think></think>\n", False)
    )
    assert prepare(tokenizer, remote, chat_template_kwargs={"unread": 1}) == len(tokenizer.chat_ids(MESSAGES))


def prepare_chats(
    tokenizer: PromptTokenizer,
    remote: RecordingRemote,
    chats: list[list[dict[str, Any]]],
    audit_every: int,
    bodies: list[dict[str, Any]] | None = None,
) -> tuple[list[int], RouterMetrics]:
    """Each chat's prompt tokens as the router counts them, one after another, audits let run in between;
    bodies: each chat's other fields (default: TOOLS)."""
    metrics = RouterMetrics()
    router = Decider(
        BlockIndex(32),
        {"tiny-llama": tokenizer},
        32,
        metrics,
        lambda model: remote,  # type: ignore[arg-type,return-value]
        options=DeciderOptions(audit_every=audit_every),
    )

    async def run() -> list[int]:
        counts = []
        for messages, fields in zip(chats, bodies or [{"tools": TOOLS}] * len(chats), strict=True):
            body = ChatRequest(model="tiny-llama", messages=messages, **fields)
            counts.append((await router.prepare(body, None)).request.prompt_tokens)
            for _ in range(3):
                await asyncio.sleep(0)
        return counts

    return asyncio.run(run()), metrics


def audits(metrics: RouterMetrics, result: str, kind: str = "with_inputs") -> float:
    labels = {"model": "tiny-llama", "kind": kind, "result": result}
    return metrics.registry.get_sample_value("kvroute_tokenization_audits_total", labels) or 0.0


def test_chats_with_tools_are_rendered_here_and_the_first_and_every_nth_is_checked(
    tokenizer: PromptTokenizer,
) -> None:
    chats = [[{"role": "user", "content": f"turn {turn} " * 20}] for turn in range(5)]
    remote = AgreeingRemote(tokenizer)
    counts, metrics = prepare_chats(tokenizer, remote, chats, audit_every=2)
    assert counts == [len(tokenizer.chat_ids(chat, inputs=TemplateInputs(tools=TOOLS))) for chat in chats]
    assert counts[0] > len(tokenizer.chat_ids(chats[0]))  # the tools were rendered too
    assert remote.asked == [{"tools": TOOLS}] * 3  # chats 0, 2 and 4
    assert (audits(metrics, "match"), audits(metrics, "mismatch")) == (3, 0)


class SilentOnceRemote(AgreeingRemote):
    """An engine whose first /tokenize gives no answer (busy past the timeout, or restarting)."""

    def ids(self, messages: Sequence[Any], inputs: Mapping[str, Any]) -> list[int]:
        if len(self.asked) == 1:
            raise TokenizeFailed("timed out")
        return super().ids(messages, inputs)


def test_a_check_the_engine_did_not_answer_is_made_on_the_next_chat(tokenizer: PromptTokenizer) -> None:
    chats = [[{"role": "user", "content": f"turn {turn} " * 20}] for turn in range(4)]
    remote = SilentOnceRemote(tokenizer)
    _, metrics = prepare_chats(tokenizer, remote, chats, audit_every=100)
    assert len(remote.asked) == 2  # chat 0's check failed, chat 1's was made; chats 2 and 3 are not due
    assert (audits(metrics, "failed"), audits(metrics, "match"), audits(metrics, "mismatch")) == (1, 1, 0)


def test_one_mismatch_sends_the_models_chats_with_tools_to_the_engine_and_raises_the_alarm(
    tokenizer: PromptTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    chats = [[{"role": "user", "content": f"turn {turn} " * 20}] for turn in range(3)]
    first = len(tokenizer.chat_ids(chats[0], inputs=TemplateInputs(tools=TOOLS)))
    remote = RecordingRemote()
    counts, metrics = prepare_chats(tokenizer, remote, chats, audit_every=100)
    assert counts == [first, 100, 100]
    assert (audits(metrics, "mismatch"), audits(metrics, "match")) == (1, 0)
    assert len(remote.asked) == 3  # the audit, then the two chats themselves
    labels = {"model": "tiny-llama", "vllm_instance": "engine-0"}
    assert metrics.registry.get_sample_value("kvroute_tokenizer_mismatch", labels) == 1
    [error] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "model tiny-llama, instance engine-0" in error.getMessage()


def test_a_chat_with_tools_not_rendered_here_goes_to_the_engine(tokenizer: PromptTokenizer) -> None:
    """A tool call without an id is beyond what the router reproduces of vLLM's request model."""
    chat = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "x", "arguments": ""}}],
        },
    ]
    remote = RecordingRemote()
    counts, metrics = prepare_chats(tokenizer, remote, [chat], audit_every=1)
    assert counts == [100]
    assert remote.asked == [{"tools": TOOLS}]
    assert audits(metrics, "match") + audits(metrics, "mismatch") == 0


@pytest.mark.parametrize(
    ("engines_leave_tools_out", "tool_choice", "rendered_with_tools"),
    [(True, "none", False), (True, "auto", True), (True, None, True), (False, "none", True)],
)
def test_tools_are_left_out_as_the_engines_option_leaves_them_out(
    tokenizer: PromptTokenizer,
    engines_leave_tools_out: bool,
    tool_choice: str | None,
    rendered_with_tools: bool,
) -> None:
    """vLLM's --exclude-tools-when-tool-choice-none renders a chat whose tool_choice is "none" without its
    tools: so must the router, or the prompt's blocks are not the engine's (stated per model in the config)."""
    models = frozenset({"tiny-llama"} if engines_leave_tools_out else ())
    router = Decider(
        BlockIndex(32),
        {"tiny-llama": tokenizer},
        32,
        RouterMetrics(),
        options=DeciderOptions(tools_out_when_none=models),
    )  # type: ignore[dict-item]
    body = ChatRequest(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice)
    prompt_tokens = asyncio.run(router.prepare(body, None)).request.prompt_tokens
    assert prompt_tokens == len(
        tokenizer.chat_ids(MESSAGES, inputs=TemplateInputs(tools=TOOLS if rendered_with_tools else None))
    )
    assert len(tokenizer.chat_ids(MESSAGES, inputs=TemplateInputs(tools=TOOLS))) > len(
        tokenizer.chat_ids(MESSAGES)
    )


def test_documents_which_no_tokenizer_endpoint_takes_route_without_prefix(tokenizer: PromptTokenizer) -> None:
    remote = RecordingRemote()
    assert prepare(tokenizer, remote, documents=[{"text": "x"}]) == 0
    assert remote.asked == []


@pytest.mark.parametrize(("effort", "thinking"), [("none", False), ("high", True)])
def test_reasoning_effort_reaches_the_template_as_vllms_chat_endpoint_passes_it(
    tokenizer: PromptTokenizer, effort: str, thinking: bool
) -> None:
    remote = RecordingRemote()
    expected = tokenizer.chat_ids(
        MESSAGES, inputs=TemplateInputs(template_kwargs={"enable_thinking": thinking})
    )
    assert prepare(tokenizer, remote, reasoning_effort=effort) == len(expected)
    # kwargs the request sets itself win
    on = prepare(tokenizer, remote, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert on == len(
        tokenizer.chat_ids(MESSAGES, inputs=TemplateInputs(template_kwargs={"enable_thinking": True}))
    )
    assert remote.asked == []


def test_a_salted_prompt_matches_only_blocks_cached_under_its_salt(tokenizer: PromptTokenizer) -> None:
    """vLLM's cache_salt goes into the first block's extra keys, so a salted prompt's cache is its own: the
    instance holding the same tokens unsalted (or under another salt) holds nothing for it."""
    ids = tokenizer.chat_ids(MESSAGES)
    blocks = len(ids) // 32
    index = BlockIndex(32)

    def stored(salt: str | None) -> BlockStored:
        extra = None if salt is None else [[salt]] + [None] * (blocks - 1)  # as msgpack decodes vLLM's tuples
        return BlockStored(
            block_hashes=[(7 if salt else 9) << 20 | i for i in range(blocks)],
            parent_block_hash=None,
            token_ids=ids[: blocks * 32],
            block_size=32,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=extra,
        )

    index.apply(("salted", 0), [stored("tenant-a")])
    index.apply(("plain", 0), [stored(None)])
    router = Decider(index, {"tiny-llama": tokenizer}, 32, RouterMetrics())  # type: ignore[dict-item]

    def matched(salt: str | None) -> dict[str, int]:
        body = ChatRequest(model="tiny-llama", messages=MESSAGES, cache_salt=salt)
        prepared = asyncio.run(router.prepare(body, None))
        return {name: match.gpu for name, match in prepared.request.matches.items()}

    assert blocks >= 2
    assert matched("tenant-a") == {"salted": blocks}
    assert matched(None) == {"plain": blocks}
    assert matched("tenant-b") == {}
    assert matched("") == {"plain": blocks}  # vLLM ignores an empty salt


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_an_adapters_prompt_matches_only_blocks_cached_under_that_adapter(
    tokenizer: PromptTokenizer, salt: str | None
) -> None:
    """vLLM keys a LoRA request's blocks by the adapter: its name in every block's extra keys (the salt
    after it in the first block's), announced in two events here, the second continuing the first. The
    adapter's prompt matches them, and neither the base model's cache nor another adapter's."""
    ids = tokenizer.chat_ids(MESSAGES)
    blocks = len(ids) // 32
    index = BlockIndex(32)

    def stored(lora: str | None, first: int, count: int, tag: int) -> BlockStored:
        extra: list[list[str] | None] = [None if lora is None else [lora] for _ in range(count)]
        if salt and first == 0:
            extra[0] = [*(extra[0] or []), salt]
        return BlockStored(
            block_hashes=[tag << 20 | i for i in range(first, first + count)],
            parent_block_hash=None if first == 0 else tag << 20 | first - 1,
            token_ids=ids[first * 32 : (first + count) * 32],
            block_size=32,
            lora_id=None if lora is None else 1,
            medium="GPU",
            lora_name=lora,
            extra_keys=extra,
        )

    split = blocks // 2
    index.apply(("sql", 0), [stored("sql-lora", 0, split, 1), stored("sql-lora", split, blocks - split, 1)])
    index.apply(("base", 0), [stored(None, 0, blocks, 2)])
    index.apply(("chat", 0), [stored("chat-lora", 0, blocks, 3)])
    local = {name: tokenizer for name in ("tiny-llama", "sql-lora", "chat-lora")}
    adapters = frozenset({"sql-lora", "chat-lora"})
    router = Decider(index, local, 32, RouterMetrics(), options=DeciderOptions(adapters=adapters))  # type: ignore[arg-type]

    def matched(model: str) -> dict[str, int]:
        body = ChatRequest(model=model, messages=MESSAGES, cache_salt=salt)
        prepared = asyncio.run(router.prepare(body, None))
        return {name: match.gpu for name, match in prepared.request.matches.items()}

    assert split >= 1
    assert matched("sql-lora") == {"sql": blocks}
    assert matched("chat-lora") == {"chat": blocks}
    assert matched("tiny-llama") == {"base": blocks}


def test_off_loop_tokenization_runs_on_the_worker_thread_with_the_same_ids(
    tokenizer: PromptTokenizer,
) -> None:
    threads: list[str] = []

    class Recording(CachedChatTokenizer):
        def chat_ids(self, *args: Any, **kwargs: Any) -> list[int]:
            threads.append(threading.current_thread().name)
            return super().chat_ids(*args, **kwargs)

        def completion_ids(self, *args: Any, **kwargs: Any) -> list[int]:
            threads.append(threading.current_thread().name)
            return super().completion_ids(*args, **kwargs)

    local = Recording(tokenizer)
    router = Decider(BlockIndex(32), {"tiny-llama": local}, 32, RouterMetrics())

    async def tokens(body: ChatRequest | CompletionRequest, off_loop: bool) -> int:
        return (await router.prepare(body, None, off_loop=off_loop)).request.prompt_tokens

    chat = ChatRequest(model="tiny-llama", messages=MESSAGES)
    completion = CompletionRequest(model="tiny-llama", prompt="run the tests " * 40)
    counts = [
        asyncio.run(tokens(body, off_loop)) for body in (chat, completion) for off_loop in (False, True)
    ]
    router.close()
    assert (
        counts
        == [len(tokenizer.chat_ids(MESSAGES))] * 2 + [len(tokenizer.completion_ids(completion.prompt))] * 2
    )
    main = threading.current_thread().name
    assert [name == main for name in threads] == [True, False, True, False]
    assert all(name.startswith("kvroute-tokenize") for name in threads[1::2])


def test_a_decision_withdrawn_takes_back_only_its_speculative_blocks() -> None:
    config = parse_config(
        {
            "models": [{"name": "tiny-llama"}],
            "block_size": 4,
            "instances": [{"name": "a", "url": "http://a"}, {"name": "b", "url": "http://b"}],
        },
        source="test",
    )
    index = BlockIndex(4)
    router = Decider(index, {}, 4, RouterMetrics())
    chain = list(range(1, 9))
    request = RoutingRequest(model="tiny-llama", prompt_tokens=33, prompt_blocks=8, block_size=4, chain=chain)
    instances = Upstreams(config).instances
    round_robin = Policy("round-robin", config.policies["round-robin"])
    first = router.decide(Prepared(request), round_robin, instances)
    second = router.decide(Prepared(request), round_robin, instances)
    assert {first.instance.name, second.instance.name} == {"a", "b"}
    assert first.speculated is not None and first.speculated.blocks == chain
    router.withdraw(first)  # the instance refused it
    assert index.match(chain) == {second.instance.name: TierMatch(gpu=8)}


def test_a_request_that_loads_from_the_pool_enters_nothing_for_the_requests_behind_it() -> None:
    """vLLM's connectors load a prompt's stored blocks asynchronously: a request admitted while they load
    loads and computes its own copy. So a decision that loads part of its prompt enters none of what it will
    compute as cached there (a burst for one hot document would all go to where the first one went); one
    that computes its prompt does, as the requests behind it in the engine's queue find it computed."""
    config = parse_config(
        {"models": [{"name": "m"}], "block_size": 4, "instances": [{"name": "a", "url": "http://a"}]},
        source="test",
    )
    instances = Upstreams(config).instances
    policy = Policy("round-robin", config.policies["round-robin"])
    chain = list(range(1, 9))
    for held, speculates in ((TierMatch(gpu=2, pool=4), False), (TierMatch(gpu=2), True)):
        index = BlockIndex(4)
        router = Decider(index, {}, 4, RouterMetrics())
        request = RoutingRequest(
            model="m", prompt_tokens=33, prompt_blocks=8, block_size=4, chain=chain, matches={"a": held}
        )
        decision = router.decide(Prepared(request), policy, instances)
        assert (decision.speculated is not None) == speculates
        computes = chain[held.gpu + held.pool :]  # what it computes, beyond what it found
        assert bool(index.match(computes)) == speculates


def test_plain_chats_are_audited_too_and_a_plain_mismatch_sends_every_chat_to_the_engine(
    tokenizer: PromptTokenizer,
) -> None:
    chats = [[{"role": "user", "content": f"turn {turn} " * 20}] for turn in range(4)]
    bodies: list[dict[str, Any]] = [{}, {"tools": TOOLS}, {}, {"tools": TOOLS}]
    remote = RecordingRemote()  # disagrees with everything
    counts, metrics = prepare_chats(tokenizer, remote, chats, audit_every=100, bodies=bodies)
    assert counts[0] == len(tokenizer.chat_ids(chats[0]))
    assert counts[1:] == [100, 100, 100]  # the plain chat's audit failed before the second chat was routed
    assert (audits(metrics, "mismatch", "plain"), audits(metrics, "mismatch")) == (1, 0)
    assert remote.asked == [{}, {"tools": TOOLS}, {}, {"tools": TOOLS}]


class ToolBlindRemote(AgreeingRemote):
    """An engine that renders plain chats as the router does, and chats with tools otherwise."""

    async def chat_ids(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_inputs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if template_inputs:
            self.asked.append(template_inputs)
            return list(range(100))
        return await super().chat_ids(messages, template_inputs=template_inputs)


def test_a_mismatch_with_tools_leaves_plain_chats_rendered_here(tokenizer: PromptTokenizer) -> None:
    chats = [[{"role": "user", "content": f"turn {turn} " * 20}] for turn in range(4)]
    bodies: list[dict[str, Any]] = [{"tools": TOOLS}, {}, {"tools": TOOLS}, {}]
    remote = ToolBlindRemote(tokenizer)
    counts, metrics = prepare_chats(tokenizer, remote, chats, audit_every=100, bodies=bodies)
    assert counts[1::2] == [len(tokenizer.chat_ids(chat)) for chat in chats[1::2]]
    assert counts[2] == 100
    assert (audits(metrics, "mismatch"), audits(metrics, "match", "plain")) == (1, 1)
    assert remote.asked == [{"tools": TOOLS}, {}, {"tools": TOOLS}]  # two audits, then chat 2 itself


def test_a_decision_says_the_wait_it_was_charged_for_causing_and_the_policy_its_weight() -> None:
    config = parse_config(
        {
            "models": [{"name": "tiny-llama"}],
            "block_size": 4,
            "instances": [{"name": "a", "url": "http://a"}, {"name": "b", "url": "http://b"}],
            "default_policy": "caused",
            "policies": {
                "caused": {"scorers": [{"type": "ttft-cost", "params": {"wait_caused": 1.0}}]},
                "capped": {
                    "scorers": [
                        {"type": "ttft-cost", "params": {"wait_caused": 1.0, "wait_caused_cap": 0.01}}
                    ]
                },
            },
        },
        source="test",
    )
    metrics = RouterMetrics()
    router = Decider(BlockIndex(4), {}, 4, metrics)
    request = RoutingRequest(model="tiny-llama", prompt_tokens=400, prompt_blocks=100, block_size=4)
    instances = Upstreams(config).instances
    now = [0.0]
    policy = Policy("caused", config.policies["caused"], clock=lambda: now[0])
    first = router.decide(Prepared(request), policy, instances)
    assert first.explained[WAIT_CAUSED_S] == 0.0  # nothing has arrived yet: nobody is expected behind it
    for _ in range(160):  # 4 requests a second over 2 instances, for 4 half-lives of the measured rate
        now[0] += 0.25
        decision = router.decide(Prepared(request), policy, instances)
        weight = decision.explained[WAIT_CAUSED_WEIGHT]
    assert weight == pytest.approx(2.0, rel=0.1)
    assert f'kvroute_policy_wait_caused_weight{{policy="caused"}} {weight}' in metrics.render().decode()
    queue_rate = decision.instance.ttft_model.rates["queue"]
    assert decision.explained[WAIT_CAUSED_S] == pytest.approx(
        weight * decision.predicted_ttft_s * queue_rate * 400
    )
    # what the answer's header reports is the charge the choice weighed: capped as the scorer caps it
    capped = Policy("capped", config.policies["capped"], clock=lambda: now[0])
    for _ in range(160):
        now[0] += 0.25
        decision = router.decide(Prepared(request), capped, instances)
    assert decision.explained[WAIT_CAUSED_S] == pytest.approx(0.01 * decision.predicted_ttft_s)


def test_a_request_of_no_program_alive_starts_one(tokenizer: PromptTokenizer) -> None:
    """What the program-room scorer reads: whether the request's session is a program whose working set
    is counted (router/programs/)."""
    programs = Programs(ProgramsConfig(), RouterMetrics())
    router = Decider(
        BlockIndex(32),
        {"tiny-llama": tokenizer},
        32,
        RouterMetrics(),
        options=DeciderOptions(programs=programs),
    )
    body = ChatRequest(model="tiny-llama", messages=MESSAGES)
    first = asyncio.run(router.prepare(body, "agent-1")).request
    assert first.new_program and first.session_key is not None
    programs.turn_started(first, "i0", time.perf_counter())
    assert not asyncio.run(router.prepare(body, "agent-1")).request.new_program
    assert not asyncio.run(router.prepare(body, None)).request.new_program  # no session: no program


def test_a_completion_of_token_ids_is_keyed_without_any_tokenizer() -> None:
    # vLLM takes token ids as the prompt they are: a model with neither a local tokenizer nor an instance's
    # /tokenize still has its prefix looked up.
    router = Decider(BlockIndex(32), {}, 32, RouterMetrics())
    ids = list(range(100))
    prepared = asyncio.run(router.prepare(CompletionRequest(model="tiny-llama", prompt=ids), None))
    assert list(prepared.chain) == block_hashing.prompt_chain(ids, 32)
    assert prepared.request.prompt_tokens == 100


@pytest.mark.parametrize("ids", [[-1] * 40, [2**32] * 40])
def test_token_ids_no_engine_has_are_routed_without_prefix_knowledge(ids: list[int]) -> None:
    # The engine is their judge (a 400): the router hashes nothing of them, and answers no 500 of its own.
    router = Decider(BlockIndex(32), {}, 32, RouterMetrics())
    prepared = asyncio.run(router.prepare(CompletionRequest(model="tiny-llama", prompt=ids), None))
    assert (prepared.request.prompt_tokens, list(prepared.chain)) == (0, [])
