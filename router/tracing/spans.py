"""What the request path tells its trace, and the null trace it tells when tracing is off.

A request's trace is a tree of spans (router/tracing/otel.py makes them):

    POST /v1/chat/completions    the request, a child of the client's traceparent when it sent one
      receive                    its body read (kvroute serve)
      parse                      decoded, its model checked, its policy chosen
      tokenize                   its prompt's token ids
      lookup                     its blocks hashed and looked up in the index (and the pool)
      queue                      flow control's wait, when it waited
      decide                     scored and picked (once per attempt): the instance, policy, cached blocks
      prefill                    a disaggregated request's prefill leg, with its own decide and attempts
      attempt                    sent to an instance (one per attempt): the engine's traceparent names it

kvroute epp's root is the pick ("pick POST /v1/chat/completions"): the gateway sends the request itself.

The request path holds a Trace whatever the configuration: NULL_TRACE, whose every method does nothing, when
tracing is off or the request is not sampled, so the path has no `if tracing` of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.upstreams.instances import Instance
    from scorers.request import TierMatch

Attribute = str | bool | int | float


class Decision(Protocol):
    """What a span reads of a routing decision (router/dispatch/decide/decision.py's, which imports this
    module)."""

    @property
    def instance(self) -> Instance: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def prompt_blocks(self) -> int: ...
    @property
    def cached_blocks(self) -> int: ...
    @property
    def uncached_tokens(self) -> int: ...
    @property
    def predicted_ttft_s(self) -> float: ...
    @property
    def reused(self) -> TierMatch: ...


class Outcome(Protocol):
    """What a span reads of how an answer ended (router/dispatch/observe/outcome.py's)."""

    @property
    def instance(self) -> Instance: ...
    @property
    def status(self) -> int: ...
    @property
    def cut(self) -> bool: ...
    @property
    def broken(self) -> bool: ...
    @property
    def engine_error(self) -> bool: ...
    @property
    def attempts(self) -> int: ...
    @property
    def prefill_instance(self) -> str | None: ...


class Trace(Protocol):
    """One span of a request's trace, open until it ends (once: later ends do nothing)."""

    def step(self, name: str) -> Trace:
        """A child span, started now, that ends with the `with` block it opens."""
        ...

    def attempt(self, instance: Instance, retry: int, leg: str) -> Trace:
        """A child span for one attempt at instance (retry: 0 for the first); it ends when told, or with
        this span."""
        ...

    def queued(self, seconds: float, objective: str) -> None:
        """A child span for a wait in flow control's queue that just ended after seconds."""
        ...

    def parsed(self, model: str, policy: str, streamed: bool) -> None:
        """What the request's body and headers say: its model, its policy, whether it streams."""
        ...

    def decided(self, decision: Decision, policy: str) -> None:
        """The instance chosen, and why."""
        ...

    def headers(self, forwarded: dict[str, str]) -> dict[str, str]:
        """The headers an attempt sends, its trace context this span's."""
        ...

    def set(self, key: str, value: Attribute) -> None: ...

    def failed(self, error: BaseException) -> None:
        """What ended the span early: its status is an error, named by type (an OpenAIError by its code)."""
        ...

    def sent(self, kind: str, status: int) -> None:
        """What came of an attempt: answered (with its HTTP status) or how it failed."""
        ...

    def finished(self, outcome: Outcome) -> None:
        """The request's answer is over: its answering attempt and the request end, with its status."""
        ...

    def end(self) -> None: ...

    def __enter__(self) -> Trace: ...

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Tracing(Protocol):
    def request(self, name: str, headers: Mapping[str, str]) -> Trace:
        """A request's root span, started now, continuing the trace context of headers (traceparent)."""
        ...

    def close(self) -> None:
        """Export the spans still held, and stop (blocks: up to the exporter's timeout)."""
        ...


class NullTrace:
    """A span that is not recorded: every method does nothing, and each child is itself."""

    __slots__ = ()

    def step(self, name: str) -> NullTrace:
        return self

    def attempt(self, instance: Instance, retry: int, leg: str) -> NullTrace:
        return self

    def queued(self, seconds: float, objective: str) -> None:
        pass

    def parsed(self, model: str, policy: str, streamed: bool) -> None:
        pass

    def decided(self, decision: Decision, policy: str) -> None:
        pass

    def headers(self, forwarded: dict[str, str]) -> dict[str, str]:
        return forwarded

    def set(self, key: str, value: Attribute) -> None:
        pass

    def failed(self, error: BaseException) -> None:
        pass

    def sent(self, kind: str, status: int) -> None:
        pass

    def finished(self, outcome: Outcome) -> None:
        pass

    def end(self) -> None:
        pass

    def __enter__(self) -> NullTrace:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass


NULL_TRACE = NullTrace()


class NullTracing:
    __slots__ = ()

    def request(self, name: str, headers: Mapping[str, str]) -> NullTrace:
        return NULL_TRACE

    def close(self) -> None:
        pass


NULL_TRACING = NullTracing()
