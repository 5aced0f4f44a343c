"""Stored responses' ids name the instance that holds them.

vLLM keeps a stored response (and the conversation it was rendered from) in the memory of the instance
that made it; a follow-up naming it by `previous_response_id`, a retrieval and a cancellation must go there.
The router sets the id itself, through vLLM's own `request_id` body field: ``resp_`` + a digest of the
instance's URL + its owner's tag (router/apis/responses/owners.py) + a random part. Any router
(another worker, a replica, this one after a restart) reads the instance and the owner back from the id alone,
with no state to share or lose. An id a client chose itself is remembered here with both, in this process, for
as long as it stays among the most recent.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache

import xxhash

from router.apis.responses.owners import OWNER_CHARS
from router.upstreams.instances import Instance, Upstreams

_PREFIX = "resp_"
_TAG_CHARS = 12  # 48 bits of the URL's digest: no two instances of a fleet share one
_REMEMBERED = 65_536  # ids clients chose, with their instances


@lru_cache(maxsize=4096)
def instance_tag(url: str) -> str:
    return xxhash.xxh3_64_hexdigest(url.encode())[:_TAG_CHARS]


class ResponseIds:
    def __init__(self, upstreams: Upstreams) -> None:
        self._upstreams = upstreams
        self._chosen: OrderedDict[str, tuple[str, str]] = OrderedDict()  # a client's id -> URL, owner
        # Told each id a client chose (replicas' shared store: router/shared/conversations.py).
        self.on_chosen: Callable[[str, str, str], None] | None = None

    @staticmethod
    def nonce() -> str:
        return secrets.token_hex(12)

    @staticmethod
    def made(instance: Instance, owner: str, nonce: str) -> str:
        """The id of the response the instance makes for owner's request with this nonce."""
        return f"{_PREFIX}{instance_tag(instance.url)}{owner}{nonce}"

    def chosen(self, response_id: str, instance: Instance, owner: str) -> None:
        """A client set the id itself: the instance that made it and its owner are remembered here."""
        self.adopt(response_id, instance.url, owner)
        if self.on_chosen is not None:
            self.on_chosen(response_id, instance.url, owner)

    def adopt(self, response_id: str, url: str, owner: str) -> None:
        """A client's id and its instance's URL and owner, chosen here or at another replica."""
        self._chosen[response_id] = (url, owner)
        self._chosen.move_to_end(response_id)
        if len(self._chosen) > _REMEMBERED:
            self._chosen.popitem(last=False)

    def knows(self, response_id: str) -> bool:
        """Whether the id names its instance by itself, or was chosen and is remembered here."""
        return response_id.startswith(_PREFIX) or response_id in self._chosen

    def holder(self, response_id: str) -> Instance | None:
        """The instance the id names, if it is one of the fleet's now."""
        chosen = self._chosen.get(response_id)
        if chosen is not None:
            return next((i for i in self._upstreams.instances if i.url == chosen[0]), None)
        if not response_id.startswith(_PREFIX):
            return None
        tag = response_id[len(_PREFIX) : len(_PREFIX) + _TAG_CHARS]
        return next((i for i in self._upstreams.instances if instance_tag(i.url) == tag), None)

    def owner(self, response_id: str) -> str | None:
        """The tag of the key that created it (UNSCOPED without client keys); None for an id the router
        neither made nor remembers."""
        chosen = self._chosen.get(response_id)
        if chosen is not None:
            return chosen[1]
        if not response_id.startswith(_PREFIX):
            return None
        start = len(_PREFIX) + _TAG_CHARS
        return response_id[start : start + OWNER_CHARS]

    def history_key(self, response_id: str) -> str:
        """What router/apis/responses/history.py keeps the response's conversation under: the random
        part of an id the router made (it is chosen before the instance is), a client's own id whole."""
        if response_id in self._chosen or not response_id.startswith(_PREFIX):
            return response_id
        return response_id[len(_PREFIX) + _TAG_CHARS + OWNER_CHARS :]
