from collections.abc import Sequence

def chain_hashes(
    token_ids: Sequence[int], block_size: int, parent: int, start: int = 0, later: bytes | None = None
) -> list[int]: ...
