"""One wrk run: a Lua script posting chat completions of a given size, hot or cold; its results."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import msgspec

_MARK = "WRKJSON "
_FILLER = "Route the request to the instance that already holds the most of its prompt in cache. "

# wrk calls done() once with its own aggregates; printing them as JSON spares parsing its text report.
_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d,' ..
    '"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.mean,
    latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


class WrkResult(msgspec.Struct):
    requests: int
    duration_us: int
    p50_us: int
    p99_us: int
    mean_us: float
    max_us: int
    connect: int
    read: int
    write: int
    status: int  # non-2xx/3xx answers
    timeout: int

    @property
    def errors(self) -> int:
        return self.connect + self.read + self.write + self.status + self.timeout

    @property
    def requests_per_s(self) -> float:
        return self.requests / (self.duration_us / 1e6) if self.duration_us else 0.0


class WrkError(RuntimeError):
    pass


def find_wrk() -> str | None:
    return shutil.which("wrk")


@dataclass(frozen=True)
class Prompt:
    """size_bytes: the whole JSON body; cold: every request's content starts with a fresh counter, so no
    cache keyed on the prompt's prefix (kvroute's token cache, the engines' prefix caches) ever hits."""

    size_bytes: int
    cold: bool
    tag: str  # distinguishes runs, so one run's cold prompts are not another's hot ones

    def body_parts(self) -> tuple[str, str]:
        head = f'{{"model":"tiny-llama","max_tokens":1,"messages":[{{"role":"user","content":"{self.tag} '
        tail = '"}]}'
        room = max(self.size_bytes - len(head) - len(tail) - (8 if self.cold else 0), 0)
        filler = (_FILLER * (room // len(_FILLER) + 1))[:room]
        return head, filler + tail

    def body(self) -> str:
        head, tail = self.body_parts()
        return head + tail

    def lua(self) -> str:
        head, tail = self.body_parts()
        lines = [
            'wrk.method = "POST"',
            'wrk.headers["Content-Type"] = "application/json"',
        ]
        if self.cold:
            lines += [
                f"local head = {_lua_string(head)}",
                f"local tail = {_lua_string(tail)}",
                "local n = 0",
                "request = function()",
                "  n = n + 1",
                "  return wrk.format(nil, nil, nil, head .. n .. tail)",
                "end",
            ]
        else:
            lines.append(f"wrk.body = {_lua_string(head + tail)}")
        return "\n".join(lines) + "\n" + _DONE


def _lua_string(text: str) -> str:
    # A long bracket string takes the text as it is; the level only has to avoid a closing "]==]" inside.
    level = "=" * 3
    while f"]{level}]" in text:
        level += "="
    return f"[{level}[{text}]{level}]"


def run_wrk(
    binary: str, url: str, prompt: Prompt, connections: int, duration_s: float, script_dir: Path
) -> WrkResult:
    """One wrk thread: it is C, fast enough to saturate any router here, and leaves the other core free."""
    script_dir.mkdir(parents=True, exist_ok=True)
    script = script_dir / f"{prompt.tag}.lua"
    script.write_text(prompt.lua())
    argv = [
        binary,
        "-t1",
        f"-c{connections}",
        f"-d{max(duration_s, 1):.0f}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        url + "/v1/chat/completions",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(_MARK):
            return msgspec.json.decode(line[len(_MARK) :], type=WrkResult)
    raise WrkError(
        f"wrk gave no result (exit {done.returncode}): {done.stderr.strip() or done.stdout[-500:]}"
    )
