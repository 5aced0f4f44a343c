"""An instance as the programs' tests need one: its KV cache's tokens and the programs' working sets there."""

from __future__ import annotations

from router.upstreams.instances import Instance, InstanceSetup


def instance(name: str, capacity: int | None = 10_000, program_tokens: int = 0) -> Instance:
    made = Instance(
        name=name,
        url=f"http://{name}",
        models=frozenset({"m"}),
        setup=InstanceSetup(kv_capacity_tokens=capacity),
    )
    made.program_tokens = program_tokens
    return made
