"""The `shared` section: the store router replicas share state through (router/shared/)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from router.settings_base import Strict


class SharedConfig(Strict):
    """Several routers in front of one fleet (replicas behind a load balancer) share what they must agree on
    through one Redis (or Valkey) server: each one's load in flight per instance, its flows' requests in
    flight and tokens sent (so a tenant's limits are one limit, not one per replica), and the conversations
    behind stored responses (a follow-up through another replica is routed with prefix knowledge). Replicas
    find each other there: nothing names the others. Without the store each carries on with what it knows.
    Read at start: a reload that changes it is refused (a restart applies it)."""

    url: str | None = Field(
        default=None,
        description="the store: redis://HOST:PORT/DB (rediss:// for TLS, unix:///PATH); a password in it is "
        "never logged. null: this router shares nothing",
    )
    namespace: str = Field(
        default="kvroute",
        min_length=1,
        max_length=64,
        description="the prefix of its channel and keys: replicas of one fleet share one, another fleet on "
        "the same store takes another",
    )
    interval_s: float = Field(default=0.05, gt=0, description="each replica publishes its load this often")
    stale_after_s: float = Field(
        default=1.0,
        gt=0,
        description="a replica not heard from this long counts no more (stopped, or cut off)",
    )
    timeout_s: float = Field(
        default=0.25,
        gt=0,
        description="the longest a request waits on the store (a stored conversation's read); past it, the "
        "request goes on without it",
    )
    conversation_ttl_s: float = Field(
        default=3600.0, gt=0, description="a stored response's conversation is kept on the store this long"
    )

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("url must be redis://, rediss:// or unix://")
        return url

    @model_validator(mode="after")
    def _heard_before_stale(self) -> SharedConfig:
        if self.stale_after_s < 2 * self.interval_s:
            raise ValueError(
                "stale_after_s must be at least twice interval_s: one lost snapshot must not drop a replica"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.url is not None
