"""The waiting stage: a request waits in the router, holding no instance, while none that could serve it
may take it: first its turn in flow control (router/dispatch/wait/flow_gate.py), then, when it starts an
agent program, room beside the programs alive (router/programs/admission.py), then KV memory on some
instance (router/dispatch/wait/memory_gate.py). Both doors wait here, and the gates are woken by one event,
room freed (a first byte, an end, a peer router's change)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import cast

from router.dispatch.context import Received
from router.dispatch.decide.decision import Decider, Prepared, uncached_at_best
from router.dispatch.wait.flow_control import Demand
from router.dispatch.wait.flow_gate import FlowGate
from router.dispatch.wait.memory_gate import MemoryGate
from router.metrics import RouterMetrics
from router.programs.table import NoPrograms, Programs
from router.upstreams.instances import Instance, Upstreams

# How often waiting programs look for room when nothing else wakes them.
PROGRAM_TICK_S = 0.25


class Waiting:
    def __init__(
        self,
        flow_gate: FlowGate,
        memory_hold_s: float,
        upstreams: Upstreams,
        decider: Decider,
        metrics: RouterMetrics,
        programs: Programs | NoPrograms,
    ) -> None:
        """memory_hold_s: the memory gate's bound (0: off). Room freed wakes the gates (wake())."""
        self.flow_gate, self._upstreams, self._decider, self._metrics = flow_gate, upstreams, decider, metrics
        self._memory: MemoryGate[asyncio.Future[None]] = MemoryGate(memory_hold_s, flow_gate.clock)
        self._programs = programs
        self._program_tick: asyncio.TimerHandle | None = None

    async def wait(self, received: Received, prepared: Prepared) -> Prepared:
        """What the index and the pool hold once the request may go: after its turn in flow control (a 429
        past a limit), and once some instance has memory for it (or the hold's bound passed). A request a
        stored response pins to one instance does not wait for the fleet's turn."""
        if received.target.pinned is None:
            prepared = await self._turn(received, prepared)
            if self._starts_program(prepared):
                prepared = await self._program_room(prepared)
        request, memory = prepared.request, self._memory
        if not memory.enabled:  # spares looking the candidates up for every request
            return prepared
        candidates = self._upstreams.candidates(request.model)
        if memory.must_wait(request.prompt_tokens, candidates, prepared.chain):
            await self._hold_for_memory(request.model, request.prompt_tokens, prepared.chain)
        return prepared

    async def _turn(self, received: Received, prepared: Prepared) -> Prepared:
        request, gate = prepared.request, self.flow_gate
        # Untokenized (too large, or no tokenizer): about 4 bytes a token.
        tokens = request.prompt_tokens or len(received.raw) // 4
        work = uncached_at_best(request) if request.chain else tokens
        received.ticket = ticket = await gate.wait(
            Demand(received.model, received.flow, received.objective, work, tokens)
        )
        if ticket is None or not ticket.granted:
            return prepared
        received.trace.queued(ticket.queued_s, ticket.objective)
        try:
            return await self._decider.refresh(prepared)
        finally:
            gate.started(ticket)

    def _starts_program(self, prepared: Prepared) -> bool:
        """Whether the request starts its program as it comes to the program gate (its tool call may have
        outlasted the time-to-live while it waited its turn); one the router could not tokenize passes."""
        request, programs = prepared.request, self._programs
        key = request.session_key
        return (
            programs.gate.enabled
            and key is not None
            and request.prompt_tokens > 0
            and not programs.alive(key)
        )

    async def _program_room(self, prepared: Prepared) -> Prepared:
        """A new program waits while the programs alive fill every instance's KV cache (or the gate's
        bound passes); what the index holds is looked up again if it waited."""
        request, programs = prepared.request, self._programs
        gate, key = programs.gate, request.session_key
        assert key is not None  # a program's request has one

        def candidates() -> list[Instance]:
            return self._upstreams.candidates(request.model)

        if programs.starts_now(request.prompt_tokens, candidates()):
            return prepared
        kind = "back" if programs.known(key) else "new"
        held = time.perf_counter()
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        gate.hold(released, key, request.prompt_tokens, candidates, kind == "back")
        self._count_waiting()
        self._tick_programs()
        try:
            async with asyncio.timeout(gate.max_wait_s):  # not wait_for: see _hold_for_memory
                await asyncio.shield(released)
        except TimeoutError:
            pass
        finally:
            if not released.done():
                released.cancel()
                gate.drop(released)
            self._count_waiting()
            self._metrics.program_wait_seconds(kind).observe(time.perf_counter() - held)
        return await self._decider.refresh(prepared)

    def _tick_programs(self) -> None:
        """While programs wait, look again every PROGRAM_TICK_S: a tool call's time-to-live lapses on no
        event, and its working set's room with it."""
        if self._program_tick is None and len(self._programs.gate):
            self._program_tick = asyncio.get_running_loop().call_later(PROGRAM_TICK_S, self._ticked)

    def _ticked(self) -> None:
        self._program_tick = None
        self._release_programs()
        self._tick_programs()

    def _release_programs(self) -> None:
        going = self._programs.let_go()
        for released in going:
            cast("asyncio.Future[None]", released).set_result(None)
        if going:
            self._count_waiting()

    def _count_waiting(self) -> None:
        for kind, count in self._programs.gate.waiting().items():
            self._metrics.programs_waiting(kind).set(count)

    async def _hold_for_memory(self, model: str, prompt_tokens: int, chain: Sequence[int]) -> None:
        """Wait until some instance has KV memory for the prompt, or the hold's bound passes."""
        gate, held = self._memory, time.perf_counter()
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        gate.hold(released, prompt_tokens, lambda: self._upstreams.candidates(model), chain)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns a result that came in the same turn as a
            # cancellation, and the request would go upstream for a client that has gone.
            async with asyncio.timeout(gate.max_hold_s):
                await asyncio.shield(released)
        except TimeoutError:
            pass
        finally:
            # No await from here to the decision: a released prompt goes from granted to in flight at once.
            if released.done():
                gate.started(prompt_tokens)
            else:
                released.cancel()
                gate.drop(released)
            self._metrics.memory_hold(model).observe(time.perf_counter() - held)

    def wake(self) -> None:
        """The held requests that now fit go, and those flow control lets go."""
        memory = self._memory
        if len(memory):
            for released in memory.release():
                released.set_result(None)
        self._release_programs()
        self.flow_gate.pump()
