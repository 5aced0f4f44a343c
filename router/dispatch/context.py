"""A request's context: what a front door hands the conductor (Arrival), and what the stages that follow
read of it once its body is decoded (Received), passed from stage to stage whole."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from router.apis.openai_body import ChatRequest, CompletionRequest
from router.apis.routes import Api
from router.tracing.spans import NULL_TRACE, Trace
from router.upstreams.instances import Instance
from scorers.policy import Policy


@dataclass(eq=False, slots=True)
class FlowTicket:
    """A request's place in flow control's counts while it is in flight."""

    flow: str
    objective: str
    model: str
    queued_s: float = 0.0
    granted: bool = False  # let go from the queue, not yet counted at an instance
    # Its place in the queue, if it waited: router/dispatch/wait/flow_queue.py Queued, which the waiting stage
    # alone reads (typed loosely here: the context sits below the stages).
    entry: Any = None
    ended: bool = False
    # The limits in flight whose slots it holds on the replicas' shared store (router/shared/slots.py).
    slots: tuple[str, ...] = ()


@dataclass(slots=True)  # not frozen: one is made per request, and a frozen one's __init__ costs 3x
class Arrival:
    """A request as a front door received it: its body's bytes, its route and headers."""

    raw: bytes
    api: Api
    headers: Mapping[str, str]  # each name's first value, by lower-cased name
    stored: str | None = None  # the stored response the path names (a retrieval or a cancellation)
    query: str = ""  # the query string (a retrieval's stream and starting_after)
    trace: Trace = NULL_TRACE  # its root span (router/tracing/)
    # The door's, once admission has answered either way: serve gives its body's share of the budget back.
    admitted: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request may go, and what its attempts send: the client's body, or one made for the instance
    (a Responses request's id names its instance, router/apis/responses/ids.py)."""

    api: str = "chat"  # the metrics' label
    pinned: Instance | None = None  # the one instance that may serve it (it holds the stored response)
    pinned_by: str | None = None  # that stored response's id
    body_for: Callable[[Instance], bytes] | None = None
    watch: Callable[[bytes], None] | None = (
        None  # shown the answer, as router/dispatch/observe/outcome.py says
    )
    get: bool = False  # sent as a GET (retrieving a stored response), without a body

    @property
    def splits(self) -> bool:
        """Whether a disaggregated model's prefill leg can serve it: the chat and completions APIs only
        (the router's prefill leg is one of those; the agents' APIs are routed whole)."""
        return self.api in ("chat", "completions")


@dataclass(slots=True)  # not frozen: one is made per request, and a frozen one's __init__ costs 4x
class Received:
    """A request as the router routes it: its body decoded, its policy, what reaches the engine."""

    body: ChatRequest | CompletionRequest
    policy: Policy
    session: str | None
    raw: bytes  # the body the engine gets
    headers: dict[str, str]  # the request headers the engine gets
    tokenize: bool  # small enough to tokenize (else routed without prefix knowledge)
    off_loop: bool  # long enough to tokenize on the worker thread
    target: Target  # where it may go and what each attempt sends
    flow: str  # whom it is fair to (router/dispatch/wait/flow_gate.py flow_of)
    objective: str | None  # the objective it names
    ticket: FlowTicket | None = None  # its place in flow control, once admitted there
    trace: Trace = NULL_TRACE  # its root span (router/tracing/)

    @property
    def model(self) -> str:
        return self.body.model

    @property
    def streamed(self) -> bool:
        return bool(self.body.stream)
