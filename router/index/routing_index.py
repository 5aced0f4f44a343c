"""What the request path asks of the block index besides matches (router/index/pool.py's PrefixMatches): the
BlockIndex itself in a lone router; in a worker of `kvroute serve --workers N`, a RemoteIndex
(router/index/remote_index.py) that tells the host's, the one index of the machine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class RoutingIndex(Protocol):
    def routed(self, instance: str, chain: Sequence[int], held: int) -> Any:
        """A request was routed to instance, which holds chain[:held]; returns what withdraw takes back (the
        index's speculation, or a remote one's handle), None when nothing was entered."""
        ...

    def withdraw(self, instance: str, speculation: Any) -> None:
        """The routed request never ran there: what routed entered for it goes."""
        ...

    def cache_reset(self, instance: str) -> None:
        """instance emptied its prefix cache: its GPU blocks go now."""
        ...
