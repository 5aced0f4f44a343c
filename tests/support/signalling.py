"""For the tests that signal `kvroute serve` and its workers (test_signals.py, test_worker_faults.py): what a
process does with SIGHUP, SIGHUPs sent all along, requests on connections of their own, a pool's workers, the
port's accept queues."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from kvroute.processes import Child

WORKER = "x-kvroute-worker"


def sighup_taken(pid: int) -> int | None:
    """How many threads pid runs if it blocks, ignores or handles SIGHUP; None while it leaves SIGHUP its
    default, which ends it (or is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    fields = {name: value.strip() for name, _, value in (line.partition(":") for line in lines)}
    taken = any(int(fields[mask], 16) & 1 << (signal.SIGHUP - 1) for mask in ("SigBlk", "SigIgn", "SigCgt"))
    return int(fields["Threads"]) if taken else None


def children(parent: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return False
    return fields[0] != "Z"


def _worker_spec(pid: int) -> dict[str, object] | None:
    """The argument of worker pid (router/http/workers.py), once it runs the worker's code."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"router.http.workers" not in argv:  # forked, not yet the worker: the pool's command line
        return None
    spec: dict[str, object] = json.loads(argv[-2])
    return spec


def _serves_http(pid: int) -> bool:
    spec = _worker_spec(pid)
    return spec is not None and not spec["hosts_index"]


def serving(pid: int) -> bool:
    """Whether worker pid accepts connections: its ready file is there."""
    spec = _worker_spec(pid)
    return spec is not None and (Path(str(spec["ready_dir"])) / str(pid)).exists()


def new_worker(pool: Child, known: set[int], timeout_s: float = 60.0) -> int:
    """The pid of the pool's first worker not in known, once it runs the worker's code (its index host is no
    worker)."""
    deadline = time.monotonic() + timeout_s
    while not (found := {pid for pid in children(pool.process.pid) - known if _serves_http(pid)}):
        assert time.monotonic() < deadline, f"no new worker within {timeout_s:.0f} s:\n{pool.log_tail()}"
        time.sleep(0.01)
    assert len(found) == 1, found
    return found.pop()


def accept_queue(port: int, worker: int) -> int:
    """The connections waiting in the accept queue of worker's socket listening on 127.0.0.1:port (Linux
    shows a listening socket's in the rx_queue column of /proc/net/tcp)."""
    inodes = {
        os.readlink(fd).removeprefix("socket:[").removesuffix("]")
        for fd in Path(f"/proc/{worker}/fd").iterdir()
    }
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"worker {worker} listens on no socket of port {port}")


class _Every:
    """tick() every interval_s on a thread of its own, as long as the with block lasts (or until it returns
    False)."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self._interval_s) and self.tick():
            pass

    def tick(self) -> bool:
        raise NotImplementedError


class Hangups(_Every):
    """SIGHUP to process group pgid every interval_s, as long as the with block lasts."""

    def __init__(self, pgid: int, interval_s: float = 0.05) -> None:
        super().__init__(interval_s)
        self._pgid = pgid
        self.sent = 0

    def tick(self) -> bool:
        try:
            os.killpg(self._pgid, signal.SIGHUP)
        except ProcessLookupError:
            return False
        self.sent += 1
        return True


def chat(port: int, text: str, timeout_s: float = 120.0) -> tuple[str, int | None]:
    """One request on a connection of its own: "200" or what went wrong, and the worker that answered."""
    body = json.dumps(
        {"model": "tiny-llama", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    )
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = connection.getresponse()
        response.read()
        worker = response.getheader(WORKER)
        return str(response.status), None if worker is None else int(worker)
    except OSError as exc:  # a reset, a timeout
        return type(exc).__name__, None
    except http.client.HTTPException as exc:  # the connection closed before an answer
        return type(exc).__name__, None
    finally:
        connection.close()


class Requests:
    """count requests sent at once, each on a new connection, each in a thread of its own."""

    def __init__(self, port: int, count: int, name: str) -> None:
        self.results: list[tuple[str, int | None]] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._one, args=(port, f"{name} {i}"), daemon=True) for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _one(self, port: int, text: str) -> None:
        result = chat(port, text)
        with self._lock:
            self.results.append(result)

    def answered(self) -> int:
        with self._lock:
            return len(self.results)

    def wait(self, timeout_s: float) -> list[tuple[str, int | None]]:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in self._threads), f"unanswered after {timeout_s:.0f} s"
        return self.results


class Pinger(_Every):
    """A request every interval_s, one at a time, as long as the with block lasts: whether the port answers
    all along, and which workers did."""

    def __init__(self, port: int, interval_s: float = 0.2) -> None:
        super().__init__(interval_s)
        self._port = port
        self.results: list[tuple[str, int | None]] = []

    def tick(self) -> bool:
        self.results.append(chat(self._port, f"ping {len(self.results)}", timeout_s=60.0))
        return True

    def failures(self) -> list[str]:
        return [outcome for outcome, _ in self.results if outcome != "200"]

    def workers(self) -> set[int | None]:
        return {worker for _, worker in self.results}
