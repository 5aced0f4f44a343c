"""The `tokenization` section: how prompts are rendered, tokenized and keyed here (router/prompt/)."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from router.settings_base import Strict


class TokenizationConfig(Strict):
    cache_max_entries: int = Field(default=65_536, ge=1, description="conversation prefixes kept")
    cache_max_tokens: int = Field(default=2_000_000, ge=1, description="token ids kept over all prefixes")
    max_tokenized_bytes: int = Field(
        default=4 * 2**20,
        ge=0,
        # its first name, kept for the files that use it; limits.max_body_bytes bounds what is read at all
        validation_alias=AliasChoices("max_tokenized_bytes", "max_body_bytes"),
        description="larger bodies are routed without tokenizing (CPU and memory a request may take)",
    )
    thread_above_bytes: int = Field(
        default=64 * 2**10,
        ge=0,
        description="larger bodies are tokenized on a worker thread, so the event loop goes on serving",
    )
    audit_every: int = Field(
        default=100,
        ge=0,
        description="chats are rendered here; the first of each model and kind (plain, with tools or "
        "chat_template_kwargs) and one in this many after it are checked against an instance's /tokenize, "
        "and one mismatch sends that model's chats of that kind (all of them, after a plain one) to the "
        "engine (0: never check)",
    )
    image_url_domains: list[str] = Field(
        default_factory=list,
        description="images a chat gives by http(s) URL are fetched here (each once, kept a while) to key "
        "them as the engine does, when their host is one of these or below one (as vLLM's "
        "--allowed-media-domains); empty: never fetched, such requests are routed by load",
    )
    image_max_bytes: int = Field(default=20 * 2**20, ge=1, description="a larger image is not fetched")
    image_fetch_timeout_s: float = Field(
        default=5.0, gt=0, description="a fetch that takes longer is given up: the request is routed by load"
    )
