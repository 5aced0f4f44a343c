"""The waiting stage: a request waits in the router, holding no instance, while none that could serve it
may take it: first its turn in flow control (router/dispatch/wait/flow_gate.py), then KV memory on some
instance (router/dispatch/wait/memory_gate.py). Both doors wait here, and both gates are woken by one event,
room freed (a first byte, an end, a peer router's change)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from router.dispatch.context import Received
from router.dispatch.decide.decision import Decider, Prepared, uncached_at_best
from router.dispatch.observe.events import Event
from router.dispatch.wait.flow_control import Demand
from router.dispatch.wait.flow_gate import FlowGate
from router.dispatch.wait.memory_gate import MemoryGate
from router.metrics import RouterMetrics
from router.upstreams.instances import Upstreams


class Waiting:
    def __init__(
        self,
        flow_gate: FlowGate,
        memory_hold_s: float,
        upstreams: Upstreams,
        decider: Decider,
        metrics: RouterMetrics,
        room_freed: Event,
    ) -> None:
        """memory_hold_s: the memory gate's bound (0: off); room_freed: what wakes both gates."""
        self.flow_gate, self._upstreams, self._decider, self._metrics = flow_gate, upstreams, decider, metrics
        self._memory: MemoryGate[asyncio.Future[None]] = MemoryGate(memory_hold_s)
        room_freed.subscribe(self._room_freed)

    async def wait(self, received: Received, prepared: Prepared) -> Prepared:
        """What the index and the pool hold once the request may go: after its turn in flow control (a 429
        past a limit), and once some instance has memory for it (or the hold's bound passed). A request a
        stored response pins to one instance does not wait for the fleet's turn."""
        if received.target.pinned is None:
            prepared = await self._turn(received, prepared)
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

    def _room_freed(self) -> None:
        """The held requests that now fit go, and those flow control lets go."""
        memory = self._memory
        if len(memory):
            for released in memory.release():
                released.set_result(None)
        self.flow_gate.pump()
