"""Configuration reload while serving: on a change of the file, SIGHUP, or POST /admin/reload.

A new file that does not validate, or that changes what only a restart can (models, tokenizers, block size,
index, pool, upstream and tokenization settings), is refused with the reason, and the running configuration
stays. Otherwise policies, the traffic split, the admin token and the instances are taken over: new instances
are subscribed to, removed ones get no new requests while those in flight finish, and their index entries go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import watchfiles
import zmq.asyncio

from router.block_index import BlockIndex
from router.config import ConfigError, InstanceConfig, RouterConfig, load_config
from router.errors import OpenAIError
from router.instances import Fleet
from router.kv_subscriber import KVEventSubscriber
from router.metrics import RouterMetrics
from router.policy import Policy
from router.pool import place_instances
from router.proxy import Proxy
from router.supervisor import supervise
from router.traffic import TrafficSplit

log = logging.getLogger(__name__)

# What a reload may change; everything else is built into running parts and needs a restart.
RELOADABLE = frozenset({"policies", "default_policy", "traffic", "admin", "instances"})


class Reloader:
    def __init__(
        self,
        config: RouterConfig,
        path: Path | None,
        fleet: Fleet,
        index: BlockIndex,
        metrics: RouterMetrics,
        zmq_context: zmq.asyncio.Context,
        proxy: Callable[[], Proxy],
    ) -> None:
        self.config = config
        self._path = None if path is None else path.absolute()
        self._fleet, self._index, self._metrics = fleet, index, metrics
        self._zmq, self._proxy = zmq_context, proxy
        self._subscriptions: dict[str, tuple[KVEventSubscriber, asyncio.Task[None]]] = {}
        self._lock = asyncio.Lock()
        self._seen = None if self._path is None else _content_of(self._path, config)  # for the watch

    def subscribe(self, instances: list[InstanceConfig]) -> None:
        for instance in instances:
            if instance.events is None:
                continue
            subscriber = KVEventSubscriber(
                instance.name, instance.events, instance.replay, self._index, self._metrics, self._zmq,
                block_size=self._index.block_size,
            )  # fmt: skip
            self._subscriptions[instance.name] = subscriber, asyncio.create_task(subscriber.run())

    def warnings(self) -> list[str]:
        """What an operator must fix for routing to work as configured: instances whose KV blocks are of
        another size than the index's."""
        return [
            f"{name} publishes KV blocks of {subscriber.foreign_block_size} tokens; block_size is "
            f"{self._index.block_size}"
            for name, (subscriber, _) in self._subscriptions.items()
            if subscriber.foreign_block_size is not None
        ]

    def engine_restarted(self, name: str) -> None:
        """A new engine process serves instance name (the load scraper saw its start time change): its
        subscriber knows which index entries the new process holds; without one, nothing does, and all go."""
        subscription = self._subscriptions.get(name)
        if subscription is None:
            self._index.drop_instance(name)
        else:
            subscription[0].engine_restarted()

    async def stop(self) -> None:
        tasks = [task for _, task in self._subscriptions.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._subscriptions.clear()

    async def reload(self, trigger: str = "an admin request") -> dict[str, Any]:
        """Re-read the file; raises OpenAIError (400) with the reason when the new one cannot be used.
        trigger: what asked for it, for the log."""
        if self._path is None:
            raise OpenAIError(
                400, "The router was not started from a file.", "invalid_request_error", "no_file"
            )
        async with self._lock:
            try:
                new = load_config(self._path)
                summary = await self.apply(new)
            except ConfigError as exc:
                self._metrics.config_reloads("invalid").inc()
                log.error("configuration reload on %s refused, the running one stays:\n%s", trigger, exc)
                raise OpenAIError(400, str(exc), "invalid_request_error", "invalid_config") from exc
        self._metrics.config_reloads("ok").inc()
        log.info("configuration reloaded on %s: %s", trigger, summary)
        return summary

    async def apply(self, new: RouterConfig) -> dict[str, Any]:
        old = self.config
        fixed = [
            key
            for key in type(new).model_fields
            if key not in RELOADABLE and getattr(new, key) != getattr(old, key)
        ]
        if fixed:
            raise ConfigError(f"{self._path}: changing {', '.join(fixed)} needs a restart")
        new.require_api_keys(str(self._path))
        added, removed, in_place = self._fleet.update(new)
        # Changed at the same URL: the same engine, and the same object (router/instances.py). Its pool
        # membership (unless the file took it out: pool: false) and its metric series (an open breaker's
        # gauge, the calibrated rates, set only when they change) stay. So do its subscriber and index entries
        # when its events endpoints did not change (new models or key): subscribed afresh, it could only
        # rebuild them from the engine's replay buffer, which has lost what was cached long ago (a shared
        # system prompt) and will not announce it again while it stays cached.
        before = {spec.name: (spec.events, spec.replay) for spec in old.instances}
        same_events = {
            spec.name
            for spec in new.instances
            if spec.name in in_place and before[spec.name] == (spec.events, spec.replay)
        }
        left_pool = set(old.pool_members()) - set(new.pool_members())
        for name in removed:
            if name not in same_events:
                subscription = self._subscriptions.pop(name, None)
                if subscription is not None:
                    subscription[1].cancel()
            if name not in in_place:  # gone: its entries, pool membership, owner bits and series go
                self._index.forget_instance(name)
                self._metrics.forget_instance(name)
                continue
            if name not in same_events:
                self._index.drop_instance(name)
            if name in left_pool:
                self._index.leave_pool(name)  # as on a fresh start: back in when it writes to the pool
        # A name back in the file is exported again; moved to another URL in this same reload, the requests
        # the old engine is still serving count in its series too, as labels cannot tell the two apart.
        for instance in added:
            self._metrics.restore_instance(instance.name)
        self.subscribe([spec for spec in added if spec.name not in same_events])
        place_instances(self._index, new)
        proxy = self._proxy()
        started_afresh = _swap_policies(proxy, new)
        # A split set at runtime (PUT /admin/traffic) stays unless the file's own split changed or the
        # running one names a policy that is gone.
        # Order counts: the first policy is the A/B baseline, and the ranges are laid out in order.
        running = proxy.traffic.weights.keys()
        changed = list(new.traffic_weights().items()) != list(old.traffic_weights().items())
        if changed or not running <= new.policies.keys():
            proxy.traffic = TrafficSplit(new.traffic_weights())
        proxy.traffic_config = new.traffic
        self.config = new
        return {"added": [i.name for i in added], "removed": removed, "policies": list(new.policies),
                "policies_started_afresh": started_afresh, "split": proxy.traffic.shares()}  # fmt: skip

    async def watch(self) -> None:
        """Reload on SIGHUP and when what the file holds changes, for as long as the router runs: a watch that
        fails is counted, logged and started again, and SIGHUP goes on reloading meanwhile."""
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
        finally:  # without a handler, SIGHUP ends the process
            loop.remove_signal_handler(signal.SIGHUP)

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


def _swap_policies(proxy: Proxy, new: RouterConfig) -> list[str]:
    """A policy whose definition stays keeps its state (session affinity, round-robin position); one
    redefined starts afresh, and so do its A/B results, which would otherwise mix two policies. A removed
    one's results go too: added back later, it starts afresh. Returns the policies redefined or added."""
    old = proxy.policies
    kept = {name: policy for name, policy in old.items() if new.policies.get(name) == policy.config}
    for name in old.keys() - kept.keys():
        proxy.ab.forget(name)
    proxy.policies = {name: kept.get(name) or Policy(name, config) for name, config in new.policies.items()}
    return [name for name in new.policies if name not in kept]


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
