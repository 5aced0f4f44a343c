from typing import Any

import msgspec

class BatchDecoder:
    def __init__(
        self, stored: type[Any], removed: type[Any], cleared: type[Any], most_rank: int, enabled: bool = True
    ) -> None: ...
    def decode(self, payload: bytes | memoryview) -> tuple[float, list[Any], int | None] | None: ...
    def event(self, payload: msgspec.Raw | bytes | memoryview) -> Any | None: ...
