"""A trace through the fleet behind kvroute's own router, its requests taken by the product's conductor
(kvroute/simulate/conducted.py) as `kvroute serve` takes them: the run keeps the clients' side (sessions'
turns, tool calls, what each request waited and found) and the engines; every routing step is the router's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.conducted import EngineSender, SimulatedRouter
from kvroute.simulate.engine import SimRequest
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.policies import ConfiguredPolicy, SimPolicy
from kvroute.simulate.results import RunResult
from kvroute.simulate.run import Run, session_of
from router.dispatch.wait.flow_gate import Waiter
from router.dispatch.wait.flow_queue import Queued
from router.errors import OpenAIError
from scorers.ttft_model import TTFTPriors


class ConductedRun(Run):
    def __init__(
        self,
        blocks: TraceBlocks,
        fleet: FleetSpec,
        policy: SimPolicy,
        priors: TTFTPriors | None = None,
        progress: Callable[[int], None] | None = None,
        tie_seed: int = 0,
    ) -> None:
        if not isinstance(policy, ConfiguredPolicy) or not policy.conducts:
            raise ValueError(f"{policy.name} is no kvroute router")
        super().__init__(blocks, fleet, policy, priors, progress, tie_seed)
        self.sender = EngineSender(self.loop, self.engines, self.view)
        self.router = SimulatedRouter(policy.config, policy.policy_name, self.view, self.sender)
        for engine in self.engines:
            engine.on_first_token, engine.on_finish = self._first_token, self._finished
        self._answers: dict[int, asyncio.Future[None]] = {}  # by request number: its last token
        self._serving: set[asyncio.Task[None]] = set()  # held: asyncio keeps only weak references
        self._retried = 0  # refusals another attempt followed, as Run.retried counts them
        self._count_backlogged_dispatches()

    def _count_backlogged_dispatches(self) -> None:
        """What the run's own queue counts as it lets requests go (Run._let_go), counted as the router's
        flow control lets them go: by the trace's flow, those let go while another flow waited."""
        control = self.router.flow_gate.control
        let_go = control.next_ready
        flows = {request.flow for request in self.trace if request.flow is not None}
        backlogged = self.backlogged_dispatches

        def counted() -> Queued[Waiter] | None:
            entry = let_go()
            if entry is not None and entry.flow in flows:
                waiting = control.queues()[entry.model].by_flow
                if len(waiting) > (entry.flow in waiting):
                    backlogged[entry.flow] = backlogged.get(entry.flow, 0) + 1
            return entry

        control.next_ready = counted  # type: ignore[method-assign]

    def run(self, ideal_hit_rate: float) -> RunResult:
        try:
            result = super().run(ideal_hit_rate)
        finally:
            self.router.close()
        result.retried = self._retried
        if self.sender.warm_ups:
            result.programs["warm_ups"] = float(self.sender.warm_ups)
        return result

    def _submit(self, number: int) -> None:
        traced = self.trace[number]
        request = SimRequest(number, traced, self.blocks.chains[number], session_of(traced), self.loop.now)
        if not self.engines[0].fits(traced):  # vLLM's 400: longer than the model's context
            self.rejected += 1
            self._release(request)
            return
        self.outstanding += 1
        task = self.aio.create_task(self._serve(request))
        self._serving.add(task)
        task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        self._serving.discard(task)
        task.result()  # what failed in the router's code fails the run, at once

    async def _serve(self, request: SimRequest) -> None:
        """As a client: sends request, reads its answer to the end."""
        router = self.router
        prompt = self.blocks.prompt_ids(request.number)
        # Its last token may come in the step of its first, before this coroutine is back from the conductor.
        answer = self._answers[request.number] = asyncio.get_running_loop().create_future()
        try:
            outcome = await router.serve(request, prompt, str(request.number))
        except OpenAIError as error:
            del self._answers[request.number]
            self._retried += max(len(request.tried) - 1, 0)  # the last refusal, if any, ended it
            if error.status == 429:
                code = str(error.code)
                self.refused_by_router[code] = self.refused_by_router.get(code, 0) + 1
            self.refused(request, failed=error.status >= 500 and error.status != 503)
            return
        if outcome.status != 200:  # every instance it could try was busy
            del self._answers[request.number]
            self._retried += len(request.tried) - 1
            router.ended(outcome)
            self.refused(request)
            return
        self._retried += len(request.tried)
        request.queued_s = 0.0 if outcome.ticket is None else outcome.ticket.queued_s
        await answer
        router.ended(outcome)
        self.done.append(request)
        self.outstanding -= 1
        self._release(request)

    # The router hears an engine's first token or last one and acts on it (lets queued requests go, sends a
    # session's next turn) before the engine goes on, as the run's own steps do for every peer: a router's
    # and a client's reactions take no simulated time, whoever's they are.
    def _first_token(self, request: SimRequest) -> None:
        self.sender.first_token(request)
        self.loop.drain()

    def _finished(self, request: SimRequest) -> None:
        self.sender.finished(request)
        if not request.warm_up:
            self._answers.pop(request.number).set_result(None)
        self.loop.drain()
