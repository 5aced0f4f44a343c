"""Configuration reload while serving: on a change of the file, SIGHUP, or POST /admin/reload.

A new file that does not validate, or that changes what only a restart can (models, tokenizers, block size,
index, pool, upstream and tokenization settings), is refused with the reason, and the running configuration
stays. Otherwise the runtime takes over policies, the traffic split, the admin token and the instances
(router/runtime.py): new instances are subscribed to, removed ones get no new requests while those in flight
finish, and their index entries go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

import watchfiles

from router.config import ConfigError, RouterConfig, load_config
from router.errors import OpenAIError
from router.runtime import Runtime
from router.supervisor import supervise

log = logging.getLogger(__name__)


class Reloader:
    def __init__(self, runtime: Runtime, path: Path | None) -> None:
        self._runtime = runtime
        self._path = None if path is None else path.absolute()
        self._metrics = runtime.metrics
        self._lock = asyncio.Lock()
        # for the watch: the file holds the file's configuration (discovered instances are not in it)
        self._seen = None if self._path is None else _content_of(self._path, runtime.file_config)

    async def reload(self, trigger: str = "an admin request") -> dict[str, Any]:
        """Re-read the file; raises OpenAIError (400) with the reason when the new one cannot be used.
        trigger: what asked for it, for the log."""
        if self._path is None:
            raise OpenAIError(
                400, "The router was not started from a file.", "invalid_request_error", "no_file"
            )
        async with self._lock:
            try:
                summary = self._runtime.apply(load_config(self._path), str(self._path))
            except ConfigError as exc:
                self._metrics.config_reloads("invalid").inc()
                log.error("configuration reload on %s refused, the running one stays:\n%s", trigger, exc)
                raise OpenAIError(400, str(exc), "invalid_request_error", "invalid_config") from exc
        self._metrics.config_reloads("ok").inc()
        log.info("configuration reloaded on %s: %s", trigger, summary)
        return summary

    async def watch(self) -> None:
        """Reload on SIGHUP and when what the file holds changes, for as long as the router runs: a watch that
        fails is counted, logged and started again, and SIGHUP goes on reloading meanwhile. Before and after,
        SIGHUP is ignored (kvroute/cli.py): the watch's first look catches up with a change made before."""
        if self._path is None:
            return
        hangup = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, hangup.set)
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread, or no signals here
            log.warning("SIGHUP cannot reload here; the file is still watched")
        path = self._path
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._reload_on(hangup))
                tasks.create_task(
                    supervise("config-watch", lambda: self._follow(path), 1.0, self._metrics.task_failures)
                )
        finally:
            _ignore_hangups(loop)

    async def _reload_on(self, hangup: asyncio.Event) -> None:
        while True:
            await hangup.wait()
            hangup.clear()
            await self._reload_logged("SIGHUP")

    async def _follow(self, path: Path) -> None:
        """Reload when what path holds changes. Its directory is watched, not below it, and the file read
        again on any change there: editors replace the file, and a Kubernetes ConfigMap's file is a symlink
        through ..data, which an update points at a new directory. Comparing the content makes one reload of
        an update that comes in several batches of events, and catches up with one made while no watch ran.
        Other files there are passed over: a log written beside the file would otherwise wake the watch, and
        its "change detected" line would be the next write."""

        def ours(_: watchfiles.Change, changed: str) -> bool:
            name = os.path.basename(changed)
            return name == path.name or name.startswith("..")  # ..data and its kin in a ConfigMap

        changes = watchfiles.awatch(path.parent, watch_filter=ours, recursive=False)
        async with contextlib.aclosing(changes):
            await self._reload_if_changed(path)
            async for _ in changes:
                await self._reload_if_changed(path)

    async def _reload_if_changed(self, path: Path) -> None:
        content = _content(path)
        if content != self._seen:
            self._seen = content
            await self._reload_logged(f"a change of {path}")

    async def _reload_logged(self, trigger: str) -> None:
        try:
            await self.reload(trigger)
        except OpenAIError:
            pass  # logged and counted by reload()
        except Exception:  # one failed reload must not end the watch
            log.exception("configuration reload failed, the running one stays")


def _ignore_hangups(loop: asyncio.AbstractEventLoop) -> None:
    """SIGHUP's handler removed, and SIGHUP ignored from now on rather than given its default, which ends the
    process: one during the shutdown must not turn a clean exit into a death by signal. Blocked in this thread
    meanwhile, so that one sent between the two steps is not taken here by the default (another thread could
    still take it, within those two system calls)."""
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        if loop.remove_signal_handler(signal.SIGHUP):
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def _content_of(path: Path, config: RouterConfig) -> bytes | None:
    """What path holds when it still says config; None when it says something else now, which the watch's
    first look takes for a change: the file was changed after the router read it, before the watch began."""
    content = _content(path)
    try:
        unchanged = load_config(path) == config
    except ConfigError:
        unchanged = False
    return content if unchanged else None


def _content(path: Path) -> bytes | None:
    """What path holds, through any symlinks; None while there is nothing to read (a file being replaced)."""
    try:
        return path.read_bytes()
    except OSError:
        return None
