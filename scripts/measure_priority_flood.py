"""How long an interactive request waits behind a batch flood, through `kvroute serve`, seen from outside.

One simulated instance of --max-num-seqs sequences; --batch long `batch` requests sent at once, then, from
a second later, --interactive short `interactive` ones, one every half second; the objectives rank them 10
and -10 (flow_control.objectives). Each setup runs on a fresh fleet and router: the engine first come first
served (vLLM's default) or run with `--scheduling-policy priority`, the router's flow control on or off, and
flow_control.engine_priority on or off. Prints, per setup, an interactive request's latency alone, its worst
under the flood, the batch median, their ratio, and every answer's status.

    .venv/bin/python scripts/measure_priority_flood.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvroute.processes import FleetPorts, running_fleet, running_router  # noqa: E402

OBJECTIVE = "x-gateway-inference-objective"
OBJECTIVES = {"interactive": {"priority": 10}, "batch": {"priority": -10}}


@dataclass(frozen=True)
class Setup:
    name: str
    scheduling_policy: str
    flow_control: bool
    engine_priority: bool


SETUPS = (
    Setup("engine fcfs, router queue", "fcfs", True, True),
    Setup("engine priority, router queue, engine_priority off", "priority", True, False),
    Setup("engine priority, router queue, engine_priority on", "priority", True, True),
    Setup("engine priority, no router queue, engine_priority on", "priority", False, True),
)


def post(url: str, body: bytes, objective: str) -> tuple[int, float]:
    request = urllib.request.Request(url, body, {"content-type": "application/json", OBJECTIVE: objective})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            answer.read()
            status = answer.status
    except urllib.error.HTTPError as error:
        error.read()
        status = error.code
    return status, time.monotonic() - started


def completion(first_token: int, prompt_tokens: int, max_tokens: int) -> bytes:
    body = {"model": "tiny-llama", "prompt": [first_token] * prompt_tokens, "max_tokens": max_tokens}
    return json.dumps(body).encode()


def run(setup: Setup, args: argparse.Namespace, log_dir: Path) -> dict[str, object]:
    ports = FleetPorts.allocate(1)
    engine = [
        *("--max-num-seqs", str(args.max_num_seqs), "--decode-tps", str(args.decode_tps)),
        *("--scheduling-policy", setup.scheduling_policy),
    ]
    flow_control = {
        "enabled": setup.flow_control,
        "engine_priority": setup.engine_priority,
        "objectives": OBJECTIVES,
    }
    with (
        running_fleet(ports, log_dir, engine),
        running_router(ports.router_config(flow_control=flow_control), log_dir, setup.name[:20]) as url,
    ):
        endpoint = url + "/v1/completions"
        alone = [post(endpoint, completion(5 + n, 50, 1), "interactive")[1] for n in range(5)]
        answers: dict[str, list[tuple[int, float]]] = {"batch": [], "interactive": []}

        def send(kind: str, body: bytes) -> None:
            answers[kind].append(post(endpoint, body, kind))

        threads = [
            threading.Thread(target=send, args=("batch", completion(20 + n, 500, args.batch_tokens)))
            for n in range(args.batch)
        ]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        for n in range(args.interactive):
            thread = threading.Thread(target=send, args=("interactive", completion(60 + n, 50, 1)))
            thread.start()
            threads.append(thread)
            time.sleep(0.5)
        for thread in threads:
            thread.join(300)
    batch = [seconds for _, seconds in answers["batch"]]
    interactive = [seconds for _, seconds in answers["interactive"]]
    statuses = Counter(status for kind in answers.values() for status, _ in kind)
    worst, batch_median = max(interactive), statistics.median(batch)
    return {
        "setup": setup.name,
        "interactive_alone_p50_s": round(statistics.median(alone), 3),
        "interactive_worst_s": round(worst, 3),
        "batch_median_s": round(batch_median, 3),
        "worst_over_batch_median": round(worst / batch_median, 3),
        "statuses": dict(sorted(statuses.items())),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--batch-tokens", type=int, default=50, help="each batch answer's tokens")
    parser.add_argument("--interactive", type=int, default=6)
    parser.add_argument("--max-num-seqs", type=int, default=2)
    parser.add_argument("--decode-tps", type=float, default=50.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvroute-flood-") as run_dir:
        rows = [run(setup, args, Path(run_dir) / str(n)) for n, setup in enumerate(SETUPS)]
    print(
        "| setup | interactive alone, p50 | interactive worst, flood | batch median | worst / batch median "
        "| statuses |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['setup']} | {row['interactive_alone_p50_s']} s | {row['interactive_worst_s']} s | "
            f"{row['batch_median_s']} s | {row['worst_over_batch_median']} | {row['statuses']} |"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
