"""An instance's prefill queue holds a request's uncached tokens until the engine is past them, not longer."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from aiohttp import web

from kvroute.processes import running_router
from tests.support.fake_upstreams import healthy, only_instance, serving
from tests.support.http import get_json, post


def test_a_whole_answer_leaves_the_prefill_queue_when_its_ttft_is_due_not_at_its_end(tmp_path: Path) -> None:
    """A whole answer that decodes for 3 s: its prompt was prefilled long before, so it must not count
    as queued prefill (which every later routing decision reads) until the answer comes back."""

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(3)
        return web.json_response({"choices": [{"text": "ok"}]})

    with serving(healthy, slow) as port:
        config = only_instance("a", port)
        with running_router(config, tmp_path) as url:
            body = json.dumps({"model": "tiny-llama", "prompt": "summarize the tests " * 50, "max_tokens": 1})
            answer = threading.Thread(target=post, args=(url + "/v1/completions", body.encode()))
            answer.start()

            def state() -> dict[str, int]:
                (instance,) = get_json(url + "/dashboard/state")["instances"]
                return {"in_flight": instance["in_flight"], "pending": instance["pending_prefill_tokens"]}

            seen = []
            deadline = time.monotonic() + 2.5  # well inside the answer's 3 s, well past its predicted TTFT
            while time.monotonic() < deadline:
                seen.append(state())
                time.sleep(0.1)
            answer.join(10)
            after = state()
    assert seen[-1] == {"in_flight": 1, "pending": 0}, seen[-5:]  # still answering, no longer prefilling
    assert after == {"in_flight": 0, "pending": 0}
