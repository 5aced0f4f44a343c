"""A trace's prompts as the engine's 16-token blocks, hashed with kvroute's own chain hash.

A trace names a prompt by hash ids of `block_tokens` tokens (512 in the Mooncake trace). Each becomes
block_tokens / block_size engine blocks with synthetic token ids that depend only on (hash id, position),
so two prompts share exactly the blocks their hash ids share, and the chain hash the index computes from
a BlockStored event's tokens equals the one computed here from the prompt (router/prompt/block_hashing.py).
A partial last block is not hashed, as in vLLM.

An answer's tokens fill blocks too, which the engine caches as vLLM does. Where the session's next turn
extends this prompt (the agentic traces), the answer's tokens are that turn's at the same positions, so its
cached blocks are the next turn's prefix; elsewhere (the Mooncake trace, which names no sessions) they are
tokens no other prompt has.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property

import numpy as np

from kvroute.traces import Trace, TraceRequest
from router.prompt import block_hashing

_LOW = 0xFFFFFFFF
# Trace hash ids of answers no later prompt repeats: far above any trace's own.
_FRESH_IDS = 1 << 48
_FRESH_PER_REQUEST = 1 << 16


def block_tokens(
    request_ids: Sequence[int], sub_blocks: int, block_size: int, start: int, end: int
) -> list[int]:
    """Token ids of engine blocks [start, end) of a prompt with trace hash ids request_ids."""
    padding = [0] * (block_size - 3)
    tokens: list[int] = []
    for position in range(start, end):
        trace_id = request_ids[position // sub_blocks]
        tokens += (trace_id & _LOW, (trace_id >> 32) & _LOW, position % sub_blocks, *padding)
    return tokens


class TraceBlocks:
    """Every request's chain of engine block hashes, computed once per trace and shared by all runs."""

    def __init__(
        self,
        trace: Trace,
        block_size: int = 16,
        chains: list[array[int]] | None = None,
        answers_in_next_turn: bool = True,
    ) -> None:
        """answers_in_next_turn: a session's next turn resends the answer's tokens (False: a replay to a real
        engine, whose answers the trace does not know)."""
        if trace.block_tokens % block_size:
            raise ValueError(f"trace blocks of {trace.block_tokens} tokens are no multiple of {block_size}")
        self.trace = trace
        self.block_size = block_size
        self.sub_blocks = trace.block_tokens // block_size
        if chains is None:
            # A session's turn resends the previous turn: only the blocks after its full ones are hashed.
            previous: dict[str, tuple[TraceRequest, array[int]]] = {}
            chains = []
            for request in trace.requests:
                known = previous.get(request.session) if request.session is not None else None
                chain = self._chain(request, *known) if known else self._chain(request)
                chains.append(chain)
                if request.session is not None:
                    previous[request.session] = (request, chain)
        self.chains = chains
        self._next_turn = _next_turns(trace) if answers_in_next_turn else {}
        self._answers: dict[int, tuple[tuple[int, ...], array[int]]] = {}

    def with_trace(self, trace: Trace) -> TraceBlocks:
        """The same prompts at other times (with_rate): the chains are reused, not hashed again; so are the
        answers' blocks, where the requests (so the sessions' turns) are the same."""
        blocks = TraceBlocks(trace, self.block_size, self.chains[: len(trace.requests)])
        if len(trace.requests) == len(self.trace.requests):
            blocks._next_turn, blocks._answers = self._next_turn, self._answers
        return blocks

    def _chain(
        self,
        request: TraceRequest,
        before: TraceRequest | None = None,
        before_chain: array[int] | None = None,
    ) -> array[int]:
        """block_tokens() for the prompt, vectorized (this runs over every block of the trace), reusing
        before's chain as far as its full trace blocks are a prefix of this prompt."""
        full = request.input_tokens // self.block_size
        start = 0
        if before is not None and before_chain is not None:
            shared = len(before.block_ids) - 1
            if before.block_ids[:shared] == request.block_ids[:shared]:
                start = min(shared * self.sub_blocks, full, len(before_chain))
        positions = np.arange(start, full, dtype=np.int64)
        trace_ids = np.asarray(request.block_ids, dtype=np.int64)[positions // self.sub_blocks]
        tokens = np.zeros((full - start, self.block_size), dtype=np.int64)
        tokens[:, 0] = trace_ids & _LOW
        tokens[:, 1] = (trace_ids >> 32) & _LOW
        tokens[:, 2] = positions % self.sub_blocks
        parent = before_chain[start - 1] if start and before_chain is not None else block_hashing.ROOT
        chain = before_chain[:start] if start and before_chain is not None else array("Q")
        chain.extend(block_hashing.chain(tokens.ravel().tolist(), self.block_size, parent))
        return chain

    def prompt_ids(self, number: int) -> list[int]:
        """Request number's prompt as token ids, as a client sends them to the completions API: its chain's
        blocks' tokens, then its partial last block's."""
        request = self.trace.requests[number]
        ids, size = request.block_ids, self.block_size
        full, tail = divmod(request.input_tokens, size)
        positions = np.arange(full + (tail > 0), dtype=np.int64)
        trace_ids = np.asarray(ids, dtype=np.int64)[positions // self.sub_blocks]
        tokens = np.zeros((len(positions), size), dtype=np.int64)
        tokens[:, 0] = trace_ids & _LOW
        tokens[:, 1] = (trace_ids >> 32) & _LOW
        tokens[:, 2] = positions % self.sub_blocks
        return tokens.ravel()[: request.input_tokens].tolist()  # type: ignore[no-any-return]

    def text_chain(self, number: int) -> array[int] | None:
        """Request number's chain as a router that hashes token ids alone computes it, where its prompt has
        images (TraceRequest.text_block_ids); None for a text prompt, whose chain it is."""
        if self.trace.requests[number].text_block_ids is None:
            return None
        return self._text_chains[number]

    @cached_property
    def _text_chains(self) -> list[array[int]]:
        previous: dict[str, tuple[TraceRequest, array[int]]] = {}
        chains = []
        for request, chain in zip(self.trace.requests, self.chains, strict=True):
            if request.text_block_ids is not None:
                as_text = replace(request, block_ids=request.text_block_ids)
                known = previous.get(request.session) if request.session is not None else None
                chain = self._chain(as_text, *known) if known else self._chain(as_text)
                request = as_text
            chains.append(chain)
            if request.session is not None:
                previous[request.session] = (request, chain)
        return chains

    def tokens(self, request: TraceRequest, start: int, end: int) -> list[int]:
        return block_tokens(request.block_ids, self.sub_blocks, self.block_size, start, end)

    def sequence(self, number: int) -> array[int]:
        """Request number's prompt and answer as engine block hashes: its chain, then the blocks its answer
        fills (the partial last prompt block first)."""
        return self._answer(number)[1]

    def sequence_tokens(self, number: int, start: int, end: int) -> list[int]:
        """Token ids of blocks [start, end) of request number's prompt and answer."""
        ids = self._answer(number)[0]
        return block_tokens(ids, self.sub_blocks, self.block_size, start, end)

    def _answer(self, number: int) -> tuple[tuple[int, ...], array[int]]:
        known = self._answers.get(number)
        if known is not None:
            return known
        request, chain = self.trace.requests[number], self.chains[number]
        total = request.input_tokens + request.output_tokens
        ids = request.block_ids
        following = self._next_turn.get(number)
        if following is not None:
            later = self.trace.requests[following].block_ids
            if later[: len(ids)] == ids:
                ids = later
        needed = -(-total // self.trace.block_tokens)
        fresh = _FRESH_IDS + number * _FRESH_PER_REQUEST
        ids = ids + tuple(range(fresh, fresh + max(needed - len(ids), 0)))
        start, end = len(chain), total // self.block_size
        sequence = array("Q", chain)
        if end > start:
            tokens = block_tokens(ids, self.sub_blocks, self.block_size, start, end)
            parent = chain[-1] if chain else block_hashing.ROOT
            sequence.extend(block_hashing.chain(tokens, self.block_size, parent))
        self._answers[number] = ids, sequence
        return ids, sequence

    def ideal_hit_rate(self) -> float:
        """The share of prompt tokens a single infinite shared prefix cache would serve."""
        total = sum(r.input_tokens for r in self.trace.requests)
        return sum(self.ideal_hits) / total if total else 0.0

    @cached_property
    def ideal_hits(self) -> list[int]:
        """Each request's prompt tokens a single infinite shared prefix cache would serve.

        Like vLLM, whole blocks only and never the last prompt token. A trace block's engine blocks follow
        from its first one (same prefix, same hash id), so the cache is kept per trace block: the most of
        its engine blocks ever computed. One pass over every block of the trace, kept: the hit rate and the
        TTFT floor both read it.
        """
        seen: dict[int, int] = {}
        size, per = self.block_size, self.sub_blocks
        served = []
        for number, (request, chain) in enumerate(zip(self.trace.requests, self.chains, strict=True)):
            hits = 0
            for first in range(0, len(chain), per):
                full = min(per, len(chain) - first)
                known = seen.get(chain[first], 0)
                hits += min(known, full)
                if known < full:
                    break
            served.append(min(hits, (request.input_tokens - 1) // size) * size)
            # What it computed, its answer's blocks included (those a next turn can reuse).
            sequence = self.sequence(number) if request.session is not None else chain
            for first in range(0, len(sequence), per):
                full = min(per, len(sequence) - first)
                if full > seen.get(sequence[first], 0):
                    seen[sequence[first]] = full
        return served


def _next_turns(trace: Trace) -> dict[int, int]:
    """Each request's session's next turn, by position in the trace."""
    following: dict[int, int] = {}
    last: dict[str, int] = {}
    for number, request in enumerate(trace.requests):
        if request.session is None:
            continue
        previous = last.get(request.session)
        if previous is not None:
            following[previous] = number
        last[request.session] = number
    return following
