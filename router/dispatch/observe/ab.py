"""A/B results per policy on live traffic: counts, latency quantiles, cache predictions, and whether the
difference in TTFT between the baseline (the first policy of the split) and each other policy is real.

The difference of medians gets a 95% bootstrap confidence interval, which assumes nothing about the shape of
latency distributions; the verdict names a winner only when the interval excludes zero. The split assigns
sessions, not requests, to policies, and a session's turns are alike (one long agent session is many slow
first turns or many cache hits), so the bootstrap resamples sessions with all their recent TTFTs: resampling
requests would take a few long sessions for many independent samples and make the interval too narrow.
A request without a session key is a session of its own.

Replicas sharing a store (ab_shared.py) each export their results, and a report merges its peers' with its
own: every replica's counts, and each one's most recent EXPORTED_SAMPLES latencies, so that each replica's
weigh alike in the quantiles and the comparison.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
import zlib
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

MIN_SAMPLES = 30  # per policy, before a verdict
# Sessions per policy before a verdict: resampling a handful of sessions gives an interval as narrow as
# their count allows (one session: always the same draw), which says nothing.
MIN_SESSIONS = 10
_BOOTSTRAP_ROUNDS = 2000
_BOOTSTRAP_SAMPLES = 2000  # the most recent TTFTs of each policy that a comparison resamples, per router
EXPORTED_SAMPLES = _BOOTSTRAP_SAMPLES  # the most recent latencies of each policy a replica tells its peers
_REPORT_MAX_AGE_S = 1.0  # report_off_loop computes at most this often; callers in between share it


@dataclass(frozen=True)
class _Resampled:
    sessions: int
    # the median of the recent TTFTs and those of the bootstrap rounds; None below the minimums
    medians: tuple[float, np.ndarray] | None


@dataclass
class _PolicyStats:
    max_samples: int
    requests: int = 0
    errors: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    observed_cached_tokens: int = 0  # from answers whose usage reports cached tokens
    observed_prompt_tokens: int = 0  # the prompt tokens of those answers
    by_instance: Counter[str] = field(default_factory=Counter)  # the instance that answered (a decode leg's)
    by_prefill_instance: Counter[str] = field(default_factory=Counter)  # disaggregated requests' prefill legs
    pd_paths: Counter[str] = field(default_factory=Counter)  # disaggregated models' requests, by path
    ttft: deque[float] = field(init=False)
    ttft_sessions: deque[str | None] = field(init=False)  # each TTFT's session key, in step with ttft
    e2e: deque[float] = field(init=False)
    routers: int = 1  # whose results these are (merged: several replicas'), each resampled as much

    def __post_init__(self) -> None:
        self.ttft = deque(maxlen=self.max_samples)
        self.ttft_sessions = deque(maxlen=self.max_samples)
        self.e2e = deque(maxlen=self.max_samples)

    def copy(self) -> _PolicyStats:
        """A copy that later samples do not change (deque copies are C-level: ~0.1 ms for 20,000)."""
        twin = copy.copy(self)
        twin.by_instance, twin.e2e = self.by_instance.copy(), self.e2e.copy()
        twin.by_prefill_instance, twin.pd_paths = self.by_prefill_instance.copy(), self.pd_paths.copy()
        twin.ttft, twin.ttft_sessions = self.ttft.copy(), self.ttft_sessions.copy()
        return twin

    def recent_ttft(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The most recent TTFTs a comparison resamples, a session number for each (0, 1, ...), and how many
        sessions they came from."""
        start = max(len(self.ttft) - _BOOTSTRAP_SAMPLES * self.routers, 0)
        values = np.fromiter(itertools.islice(self.ttft, start, None), dtype=float)
        numbers: dict[str, int] = {}
        sessions = np.empty(len(values), dtype=np.intp)
        count = 0
        for i, key in enumerate(itertools.islice(self.ttft_sessions, start, None)):
            number = count if key is None else numbers.setdefault(key, count)
            count += number == count  # a new session (or none) took the next number
            sessions[i] = number
        return values, sessions, count


@dataclass(slots=True)  # not frozen: one is made per request
class Ended:
    """A request that ended, as the A/B results count it."""

    instance: str
    status: int
    seconds: float | None  # the end-to-end time of an answer; None for an error, whose time says nothing
    prompt_tokens: int
    predicted_cached: int  # of those, what the instance was predicted to reuse
    prefill_instance: str | None = None  # a disaggregated model's request's prefill leg
    pd_path: str | None = None  # and how it was served


class PolicyResults(msgspec.Struct, array_like=True):
    """One policy's results at one replica, as it tells its peers: its counts, and its most recent
    latencies."""

    requests: int
    errors: int
    rejected: int
    prompt_tokens: int
    predicted_cached_tokens: int
    observed_cached_tokens: int
    observed_prompt_tokens: int
    by_instance: dict[str, int]
    by_prefill_instance: dict[str, int]
    pd_paths: dict[str, int]
    ttft: list[float]
    ttft_sessions: list[str | None]
    e2e: list[float]


def _recent(samples: deque[Any]) -> list[Any]:
    return list(itertools.islice(samples, max(len(samples) - EXPORTED_SAMPLES, 0), None))


class ABStats:
    def __init__(self, max_samples: int = 20_000, seed: int = 0) -> None:
        """max_samples: the most recent latencies kept per policy, for quantiles and comparisons."""
        self._max_samples = max_samples
        self._seed = seed
        self._stats: dict[str, _PolicyStats] = {}
        self._reporting = asyncio.Lock()
        self._last_report: tuple[float, dict[str, float], dict[str, Any]] | None = None
        self._generation = 0  # a reset or forget while a report is computed makes that report stale
        # With replicas sharing a store: their latest exported results (router/dispatch/observe/ab_shared.py).
        self.peers_results: Callable[[], Awaitable[list[dict[str, PolicyResults]]]] | None = None

    def _of(self, policy: str) -> _PolicyStats:
        stats = self._stats.get(policy)
        if stats is None:
            stats = self._stats[policy] = _PolicyStats(self._max_samples)
        return stats

    def first_byte(self, policy: str, seconds: float, session: str | None = None) -> None:
        stats = self._of(policy)
        stats.ttft.append(seconds)
        stats.ttft_sessions.append(session)

    def finished(self, policy: str, ended: Ended) -> None:
        stats = self._of(policy)
        stats.requests += 1
        stats.errors += ended.status >= 500
        stats.by_instance[ended.instance] += 1
        if ended.prefill_instance is not None:
            stats.by_prefill_instance[ended.prefill_instance] += 1
        if ended.pd_path is not None:
            stats.pd_paths[ended.pd_path] += 1
        if ended.seconds is not None:
            stats.e2e.append(ended.seconds)
        stats.prompt_tokens += ended.prompt_tokens
        stats.predicted_cached_tokens += ended.predicted_cached

    def observed_cache(self, policy: str, prompt_tokens: int, cached_tokens: int) -> None:
        stats = self._of(policy)
        stats.observed_prompt_tokens += prompt_tokens
        stats.observed_cached_tokens += cached_tokens

    def failed(self, policy: str) -> None:
        """A request sent upstream that brought no answer (connection lost, timeout)."""
        stats = self._of(policy)
        stats.requests += 1
        stats.errors += 1

    def rejected(self, policy: str) -> None:
        """A request the router answered itself (no instance could take it)."""
        stats = self._of(policy)
        stats.requests += 1
        stats.rejected += 1

    @property
    def requests(self) -> int:
        """The requests counted, of every policy."""
        return sum(stats.requests for stats in self._stats.values())

    def export(self) -> dict[str, PolicyResults]:
        """This router's results, for its peers."""
        return {
            name: PolicyResults(
                stats.requests,
                stats.errors,
                stats.rejected,
                stats.prompt_tokens,
                stats.predicted_cached_tokens,
                stats.observed_cached_tokens,
                stats.observed_prompt_tokens,
                dict(stats.by_instance),
                dict(stats.by_prefill_instance),
                dict(stats.pd_paths),
                _recent(stats.ttft),
                _recent(stats.ttft_sessions),
                _recent(stats.e2e),
            )
            for name, stats in self._stats.items()
        }

    def merge(self, peers: list[dict[str, PolicyResults]]) -> None:
        """Add peers' exported results to these (a report's copy): their counts, and their recent latencies
        beside as many of this router's."""
        if not peers:
            return
        for stats in self._stats.values():
            stats.ttft, stats.e2e = deque(_recent(stats.ttft)), deque(_recent(stats.e2e))
            stats.ttft_sessions = deque(_recent(stats.ttft_sessions))
        for results in peers:
            for name, theirs in results.items():
                stats = self._of(name)
                stats.requests += theirs.requests
                stats.errors += theirs.errors
                stats.rejected += theirs.rejected
                stats.prompt_tokens += theirs.prompt_tokens
                stats.predicted_cached_tokens += theirs.predicted_cached_tokens
                stats.observed_cached_tokens += theirs.observed_cached_tokens
                stats.observed_prompt_tokens += theirs.observed_prompt_tokens
                stats.by_instance.update(theirs.by_instance)
                stats.by_prefill_instance.update(theirs.by_prefill_instance)
                stats.pd_paths.update(theirs.pd_paths)
                stats.ttft.extend(theirs.ttft)
                stats.ttft_sessions.extend(theirs.ttft_sessions)
                stats.e2e.extend(theirs.e2e)
        for stats in self._stats.values():
            stats.routers = 1 + len(peers)

    def reset(self) -> None:
        self._stats.clear()
        self._last_report = None
        self._generation += 1

    def forget(self, policy: str) -> None:
        """Start a policy's results afresh (it was redefined)."""
        self._stats.pop(policy, None)
        self._last_report = None
        self._generation += 1

    async def report_off_loop(self, split: dict[str, float]) -> dict[str, Any]:
        """report(), computed on a worker thread from a copy of the samples and at most once a second: its
        bootstraps take a few hundred milliseconds of CPU, which on the event loop would stall every request,
        and the dashboard polls it."""
        async with self._reporting:
            last = self._last_report
            if last is not None and time.monotonic() - last[0] < _REPORT_MAX_AGE_S and last[1] == split:
                return last[2]
            generation = self._generation
            peers = [] if self.peers_results is None else await self.peers_results()
            snapshot = ABStats(self._max_samples, self._seed)
            snapshot._stats = {name: stats.copy() for name, stats in self._stats.items()}
            report = await asyncio.to_thread(snapshot.merged_report, split, peers)
            if generation == self._generation:
                self._last_report = time.monotonic(), dict(split), report
            return report

    def merged_report(self, split: dict[str, float], peers: list[dict[str, PolicyResults]]) -> dict[str, Any]:
        """report() with peers' results merged in first (off the loop: thousands of samples each)."""
        self.merge(peers)
        return self.report(split)

    def report(self, split: dict[str, float]) -> dict[str, Any]:
        """The A/B JSON: the split (shares), per-policy results, and each policy against the baseline."""
        total = sum(split.values()) or 1.0
        names = list(dict.fromkeys([*split, *self._stats]))
        baseline = next(iter(split), None)
        resampled: dict[str, _Resampled] = {}  # the baseline's bootstrap serves every comparison
        return {
            "split": {name: split.get(name, 0.0) / total for name in names},
            "baseline": baseline,
            "policies": {name: self._summary(self._of(name)) for name in names},
            "comparisons": [
                self.compare(baseline, other, resampled) for other in names if baseline and other != baseline
            ],
        }

    def compare(
        self, baseline: str, candidate: str, resampled: dict[str, _Resampled] | None = None
    ) -> dict[str, Any]:
        """resampled: policies already bootstrapped in this report, by name."""
        resampled = {} if resampled is None else resampled
        for name in (baseline, candidate):
            if name not in resampled:
                resampled[name] = self._resample(name)
        a, b = resampled[baseline], resampled[candidate]
        result: dict[str, Any] = {
            "baseline": baseline,
            "candidate": candidate,
            "samples": [len(self._of(baseline).ttft), len(self._of(candidate).ttft)],
            "sessions": [a.sessions, b.sessions],  # of the recent samples that a comparison resamples
        }
        if a.medians is None or b.medians is None:
            samples, sessions = result["samples"], result["sessions"]
            if min(samples) < MIN_SAMPLES:
                result["verdict"] = (
                    f"not enough data yet ({samples[0]} and {samples[1]} TTFTs, {MIN_SAMPLES} each needed)"
                )
            else:
                result["verdict"] = (
                    f"not enough sessions yet ({sessions[0]} and {sessions[1]}, {MIN_SESSIONS} each needed)"
                )
            return result
        (median_a, rounds_a), (median_b, rounds_b) = a.medians, b.medians
        diff = (median_a - median_b) * 1000
        low, high = (float(v) * 1000 for v in np.percentile(rounds_a - rounds_b, [2.5, 97.5]))
        result.update(ttft_p50_diff_ms=round(diff, 1), ci95_ms=[round(low, 1), round(high, 1)])
        if low > 0:
            verdict = f"{candidate} is faster by {diff:.0f} ms p50, 95% CI [{low:.0f}, {high:.0f}]"
        elif high < 0:
            verdict = f"{baseline} is faster by {-diff:.0f} ms p50, 95% CI [{-high:.0f}, {-low:.0f}]"
        else:
            verdict = f"no significant difference yet (p50 difference 95% CI [{low:.0f}, {high:.0f}] ms)"
        result["verdict"] = verdict
        return result

    def _resample(self, policy: str) -> _Resampled:
        values, sessions, count = self._of(policy).recent_ttft()
        if len(values) < MIN_SAMPLES or count < MIN_SESSIONS:
            return _Resampled(count, None)
        # Each policy's own stream, the same whichever comparisons a report makes.
        rng = np.random.default_rng([self._seed, zlib.crc32(policy.encode())])
        return _Resampled(count, (float(np.median(values)), _bootstrap_medians(values, sessions, count, rng)))

    @staticmethod
    def _summary(stats: _PolicyStats) -> dict[str, Any]:
        return {
            "requests": stats.requests,
            "errors": stats.errors,
            "rejected": stats.rejected,
            "ttft_ms": _quantiles(stats.ttft),
            "e2e_ms": _quantiles(stats.e2e),
            "prompt_tokens": stats.prompt_tokens,
            "predicted_cached_tokens": stats.predicted_cached_tokens,
            # over the answers that report cached tokens only: compare it with observed_prompt_tokens
            "observed_cached_tokens": stats.observed_cached_tokens if stats.observed_prompt_tokens else None,
            "observed_prompt_tokens": stats.observed_prompt_tokens if stats.observed_prompt_tokens else None,
            "requests_per_instance": dict(sorted(stats.by_instance.items())),
            "prefill_legs_per_instance": dict(sorted(stats.by_prefill_instance.items())),
            "pd_paths": dict(sorted(stats.pd_paths.items())),  # disaggregated, skipped, fallback
        }


def _bootstrap_medians(
    values: np.ndarray, sessions: np.ndarray, count: int, rng: np.random.Generator
) -> np.ndarray:
    """The median of each bootstrap round that draws `count` sessions with replacement, each with all its
    samples. A round weighs every sample by how often its session was drawn; its median is np.median's of
    the samples so repeated: the mean of the first samples, in sorted order, at which the weights reach half
    their total and pass it."""
    if count == len(values):  # every sample a session of its own: the plain bootstrap, at a third the cost
        return np.asarray(np.median(rng.choice(values, (_BOOTSTRAP_ROUNDS, len(values))), axis=1))
    order = np.argsort(values, kind="stable")
    values, sessions = values[order], sessions[order]
    draws = rng.integers(0, count, (_BOOTSTRAP_ROUNDS, count)) + count * np.arange(_BOOTSTRAP_ROUNDS)[:, None]
    drawn = np.bincount(draws.ravel(), minlength=_BOOTSTRAP_ROUNDS * count).astype(np.int32)
    reached = np.cumsum(drawn.reshape(_BOOTSTRAP_ROUNDS, count)[:, sessions], axis=1, dtype=np.int32)
    total = reached[:, -1:]
    lower, upper = (2 * reached >= total).argmax(axis=1), (2 * reached > total).argmax(axis=1)
    return np.asarray((values[lower] + values[upper]) / 2)


def _quantiles(samples: Iterable[float]) -> dict[str, float | None]:
    values = np.fromiter(samples, dtype=float)
    if not len(values):
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(values, [50, 95, 99]) * 1000
    return {"p50": round(float(p50), 1), "p95": round(float(p95), 1), "p99": round(float(p99), 1)}
