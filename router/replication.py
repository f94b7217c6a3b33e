"""Hot-prefix replication: copy a prefix that one replica cannot serve alone to a second (third...) replica ahead of need.

The router feeds every routed request to ``HotPrefixPlanner.observe`` (its page keys, token ids, salt, which replicas
hold how many of its leading pages per the prefix index, and their loads); the ingress runs ``tick`` a few times a
second, sends the ``StartCopy`` actions to the target replicas (``prefetch_prefix``, fire and forget), cancels on
``CancelCopy`` and reports how each copy ended. Plain Python with an injected clock; thread-safe (one lock).

Demand, per page key, over a sliding window of ``window_s`` seconds::

    count(k)    = requests seen in the window whose first ``max_prefix_pages`` page keys include k
    request     | k0 | k1 | k2 | k3 | k4 |        (keys chain: count(k0) >= count(k1) >= ... along one request)
    count       | 9  | 9  | 9  | 2  | 1  |        min_requests = 4
    hot prefix  | k0   k1   k2 |                  h = 3 leading pages counted >= min_requests; named by k2

A hot prefix ``P`` (at least ``min_pages`` pages) is over what its holders can serve when

    holders(P) = replicas holding all of P's pages (index), plus targets of copies done but not yet in the index
    load(r)    = requests running + waiting on r (the policy's effective load: reported or routed-and-unfinished)
    over(P)    = min(load(h) for h in holders) >= busy_requests                       # every holder is busy
                 or (requests_per_replica_s > 0 and
                     count(P) / window_s > requests_per_replica_s * len(holders))     # more demand than they serve

and then, if ``len(holders) < max_replicas``, no copy of P is pending or running, and the last copy of P ended at
least ``settle_s`` ago (the index and the loads must show its effect before another is planned), one copy is planned:

    source = the holder with the most matched pages, then the lowest load, then the smallest id
    target = the non-holder with the lowest load, then the most pages of P already, then the smallest id;
             for the load trigger only a target less loaded than every holder (moving there must help)
    pages  = len(P) - pages of P the target already holds

Execution (``tick``), in plan order: a pending copy starts when fewer than ``max_inflight`` copies run and its pages fit
in what is left of the budget of the current interval (``budget_pages`` per ``interval_s``, fixed intervals of the
clock; a copy bigger than a whole budget is trimmed to it). Cancelled: a pending or running copy whose prefix's demand
fell below ``min_requests`` (``CancelCopy`` for a running one), and every copy from or to a replica that left
(``forget_replica``). A running copy past ``copy_timeout_s`` is cancelled and counted as failed. A done copy counts its
target as a holder until the index confirms it (an observation shows the target holding P) or ``settle_s`` passes.

Counters (``stats``): copies planned, started, done, cancelled, failed, and pages started / copied (as the target
replicas reported). The hits on proactively copied pages are counted by the replicas themselves.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from common.page_keys import PageKey


@dataclass(frozen=True)
class ReplicationConfig:
    """The thresholds and bounds of the rule in the module docstring."""

    window_s: float = 5.0
    """Sliding window of the demand counts."""
    min_requests: int = 4
    """Requests of a prefix within the window before it is hot (and below which its copies are cancelled)."""
    busy_requests: int = 4
    """Load (running + waiting requests) at which a holder counts as busy: one replica no longer serves the prefix."""
    requests_per_replica_s: float = 0.0
    """Requests per second of one prefix that one replica serves; above it times the holders, copy (0: load only)."""
    max_replicas: int = 4
    """Most replicas holding a prefix, copies included."""
    min_pages: int = 1
    """Shortest hot prefix worth copying, in pages."""
    max_prefix_pages: int = 64
    """Deepest page of a request whose demand is counted."""
    budget_pages: int = 256
    """Pages copied per interval, all prefixes together."""
    interval_s: float = 10.0
    """Length of a budget interval."""
    max_inflight: int = 2
    """Copies running at once."""
    settle_s: float = 2.0
    """After a copy of a prefix ends: wait this long before planning another (the routers learn of the copy)."""
    copy_timeout_s: float = 30.0
    """A running copy not reported by then is cancelled and counted as failed."""
    max_prefixes: int = 1024
    """Most hot prefixes tracked at once (the least recently seen are forgotten first)."""

    def __post_init__(self) -> None:
        for name in ("window_s", "interval_s", "copy_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hot-prefix replication: {name} must be > 0 seconds, got {getattr(self, name)!r}")
        for name in ("min_requests", "busy_requests", "min_pages", "max_prefix_pages", "budget_pages", "max_inflight",
                     "max_prefixes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hot-prefix replication: {name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_replicas, bool) or not isinstance(self.max_replicas, int) or self.max_replicas < 2:
            raise ValueError(f"hot-prefix replication: max_replicas must be an integer >= 2 (the holder and a copy), "
                             f"got {self.max_replicas!r}")
        if self.requests_per_replica_s < 0 or self.settle_s < 0:
            raise ValueError("hot-prefix replication: requests_per_replica_s and settle_s must be >= 0")


class CopyState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"


@dataclass(frozen=True)
class StartCopy:
    """Send ``prefetch_prefix`` to ``target``: copy the first ``num_pages`` full pages of ``token_ids`` from ``source``."""

    copy_id: str
    target: str
    source: str
    token_ids: Sequence[int]
    num_pages: int
    cache_salt: str | None


@dataclass(frozen=True)
class CancelCopy:
    """Cancel the running copy ``copy_id`` (its demand dropped, or its source or target left)."""

    copy_id: str
    reason: str


@dataclass
class ReplicationStats:
    """Planner-side counters since start (for /metrics)."""

    num_planned: int = 0
    num_started: int = 0
    num_done: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_pages_started: int = 0
    """Pages the started copies asked for (charged to the budget)."""
    num_pages_copied: int = 0
    """Pages the targets reported copied."""

    def copy(self) -> "ReplicationStats":
        return ReplicationStats(**vars(self))


@dataclass
class _Copy:
    copy_id: str
    prefix_key: PageKey
    target: str
    source: str
    num_pages: int
    """Pages to copy (charged to the budget)."""
    upto_pages: int
    """The target holds the prefix's first ``upto_pages`` pages once done (it held the first ones already)."""
    state: CopyState = CopyState.PENDING
    started_at: float = 0.0
    ended_at: float = 0.0


@dataclass
class _Prefix:
    keys: tuple[PageKey, ...]
    token_ids: Sequence[int]
    cache_salt: str | None
    last_seen: float
    last_copy_ended: float = -float("inf")
    copy_ids: list[str] = field(default_factory=list)


class HotPrefixPlanner:
    """The rule of the module docstring. ``clock``: seconds (tests pass a fake one). Every public method takes the
    lock; ``observe`` is O(pages of the request + holders) and runs on the routing path."""

    def __init__(self, config: ReplicationConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or ReplicationConfig()
        self.clock = clock
        self.stats = ReplicationStats()
        self._lock = threading.Lock()
        self._window: deque[tuple[float, tuple[PageKey, ...]]] = deque()
        self._key_to_count: dict[PageKey, int] = {}
        self._prefixes: dict[PageKey, _Prefix] = {}
        """Hot prefixes by their last page key, least recently seen first."""
        self._copies: dict[str, _Copy] = {}
        """Copies pending, running or done-awaiting-confirmation, in plan order."""
        self._outbox: list[CancelCopy] = []
        self._copy_ids = itertools.count(1)
        self._interval_index: int | None = None
        self._budget_used = 0
        self.listener: Callable[[], None] | None = None
        """Called (outside the lock) when ``observe`` planned a copy, so the executor can tick at once."""

    # ---- the routing path ------------------------------------------------------------------------------------------
    def observe(self, page_keys: Sequence[PageKey], token_ids: Sequence[int], cache_salt: str | None,
                replica_id_to_matched: Mapping[str, int], replica_id_to_load: Mapping[str, int],
                now: float | None = None) -> bool:
        """Count one routed request; plan a copy of its hot prefix if it is over what its holders serve. Returns
        whether a copy was planned. ``replica_id_to_matched``: leading pages of ``page_keys`` each replica holds
        (replicas holding none may be left out); ``replica_id_to_load``: every candidate replica's load."""
        keys = tuple(page_keys[: self.config.max_prefix_pages])
        if not keys:
            return False
        with self._lock:
            now = self.clock() if now is None else now
            self._expire(now)
            self._window.append((now, keys))
            counts = self._key_to_count
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
            num_hot = 0
            while num_hot < len(keys) and counts[keys[num_hot]] >= self.config.min_requests:
                num_hot += 1
            if num_hot < self.config.min_pages:
                return False
            prefix = self._track(keys[:num_hot], token_ids, cache_salt, now)
            planned = self._plan(prefix, replica_id_to_matched, replica_id_to_load, now)
        if planned and self.listener is not None:
            self.listener()
        return planned

    # ---- the executor's side ---------------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[StartCopy | CancelCopy]:
        """Expire demand, cancel copies whose demand dropped or that ran too long, start pending copies within the
        budget. Returns the actions to carry out, cancellations first."""
        with self._lock:
            now = self.clock() if now is None else now
            self._expire(now)
            self._refill_budget(now)
            actions: list[StartCopy | CancelCopy] = list(self._outbox)
            self._outbox.clear()
            for copy in list(self._copies.values()):
                if copy.state is CopyState.DONE:
                    if now - copy.ended_at >= self.config.settle_s:
                        self._drop(copy)
                    continue
                if self._key_to_count.get(copy.prefix_key, 0) < self.config.min_requests:
                    actions.extend(self._cancel(copy, "demand dropped", now))
                elif copy.state is CopyState.RUNNING and now - copy.started_at >= self.config.copy_timeout_s:
                    actions.append(CancelCopy(copy.copy_id, "timed out"))
                    self.stats.num_failed += 1
                    self._end(copy, now)
            actions.extend(self._start_pending(now))
            self._forget_cold_prefixes()
            return actions

    def report_done(self, copy_id: str, num_pages_copied: int, now: float | None = None) -> None:
        """The target answered: ``num_pages_copied`` pages are cached there now. Unknown or ended copies are ignored."""
        with self._lock:
            copy = self._copies.get(copy_id)
            if copy is None or copy.state is not CopyState.RUNNING:
                return
            now = self.clock() if now is None else now
            self.stats.num_done += 1
            self.stats.num_pages_copied += num_pages_copied
            copy.state = CopyState.DONE
            copy.ended_at = now
            prefix = self._prefixes.get(copy.prefix_key)
            if prefix is not None:
                prefix.last_copy_ended = now

    def report_failed(self, copy_id: str, now: float | None = None) -> None:
        """The copy raised, timed out, or the target copied nothing. Unknown or ended copies are ignored."""
        with self._lock:
            copy = self._copies.get(copy_id)
            if copy is None or copy.state is not CopyState.RUNNING:
                return
            self.stats.num_failed += 1
            self._end(copy, self.clock() if now is None else now)

    def forget_replica(self, replica_id: str) -> None:
        """A replica left: cancel every copy from or to it (a running one through ``CancelCopy`` at the next tick)."""
        with self._lock:
            now = self.clock()
            for copy in list(self._copies.values()):
                if replica_id in (copy.target, copy.source):
                    if copy.state is CopyState.DONE:
                        self._drop(copy)
                    else:
                        self._outbox.extend(self._cancel(copy, f"replica {replica_id} left", now))

    def snapshot(self) -> ReplicationStats:
        with self._lock:
            return self.stats.copy()

    def copies(self) -> list[tuple[str, str, str, str, int]]:
        """(copy id, state, target, source, pages) of every tracked copy, in plan order (for tests and logs)."""
        with self._lock:
            return [(c.copy_id, c.state.value, c.target, c.source, c.num_pages) for c in self._copies.values()]

    def num_requests(self, key: PageKey) -> int:
        """Requests in the window whose counted keys include ``key``."""
        with self._lock:
            return self._key_to_count.get(key, 0)

    # ---- internals (lock held) -------------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        window, counts = self._window, self._key_to_count
        horizon = now - self.config.window_s
        while window and window[0][0] <= horizon:
            for key in window.popleft()[1]:
                left = counts[key] - 1
                if left:
                    counts[key] = left
                else:
                    del counts[key]

    def _track(self, keys: tuple[PageKey, ...], token_ids: Sequence[int], cache_salt: str | None,
               now: float) -> _Prefix:
        prefix = self._prefixes.pop(keys[-1], None)
        if prefix is None:
            prefix = _Prefix(keys, token_ids, cache_salt, now)
        prefix.token_ids, prefix.cache_salt, prefix.last_seen = token_ids, cache_salt, now
        self._prefixes[keys[-1]] = prefix  # most recently seen last
        while len(self._prefixes) > self.config.max_prefixes:
            oldest_key = next(iter(self._prefixes))
            if self._prefixes[oldest_key].copy_ids:
                break  # copies in flight keep their prefix; it leaves when they end
            del self._prefixes[oldest_key]
        return prefix

    def _plan(self, prefix: _Prefix, replica_id_to_matched: Mapping[str, int],
              replica_id_to_load: Mapping[str, int], now: float) -> bool:
        config = self.config
        num_pages = len(prefix.keys)
        for copy_id in list(prefix.copy_ids):  # a done copy's target is confirmed once the index shows it
            copy = self._copies[copy_id]
            if copy.state is CopyState.DONE and replica_id_to_matched.get(copy.target, 0) >= num_pages:
                self._drop(copy)
        copies = [self._copies[copy_id] for copy_id in prefix.copy_ids]
        if any(copy.state is not CopyState.DONE for copy in copies) or now - prefix.last_copy_ended < config.settle_s:
            return False
        holders = {r for r, matched in replica_id_to_matched.items() if matched >= num_pages and r in
                   replica_id_to_load}
        holders.update(copy.target for copy in copies)
        if not holders or len(holders) >= config.max_replicas:
            return False
        holder_loads = [replica_id_to_load.get(r, 0) for r in holders]
        busy = min(holder_loads) >= config.busy_requests
        rate = self._key_to_count.get(prefix.keys[-1], 0) / config.window_s
        over_rate = config.requests_per_replica_s > 0 and rate > config.requests_per_replica_s * len(holders)
        if not (busy or over_rate):
            return False
        sources = [r for r in holders if replica_id_to_matched.get(r, 0) >= num_pages]
        if not sources:
            return False  # only unconfirmed copies hold it: wait for the index
        source = min(sources, key=lambda r: (-replica_id_to_matched[r], replica_id_to_load.get(r, 0), r))
        targets = [r for r in replica_id_to_load if r not in holders]
        if not over_rate:
            targets = [r for r in targets if replica_id_to_load[r] < min(holder_loads)]
        if not targets:
            return False
        target = min(targets, key=lambda r: (replica_id_to_load[r], -replica_id_to_matched.get(r, 0), r))
        num_held = min(replica_id_to_matched.get(target, 0), num_pages)
        num_copied = min(num_pages - num_held, config.budget_pages)
        copy = _Copy(f"copy-{next(self._copy_ids)}", prefix.keys[-1], target, source, num_copied,
                     num_held + num_copied)
        self._copies[copy.copy_id] = copy
        prefix.copy_ids.append(copy.copy_id)
        self.stats.num_planned += 1
        return True

    def _refill_budget(self, now: float) -> None:
        index = int(now // self.config.interval_s)
        if index != self._interval_index:
            self._interval_index = index
            self._budget_used = 0

    def _start_pending(self, now: float) -> list[StartCopy]:
        config = self.config
        num_running = sum(1 for copy in self._copies.values() if copy.state is CopyState.RUNNING)
        started = []
        for copy in self._copies.values():
            if num_running >= config.max_inflight:
                break
            if copy.state is not CopyState.PENDING or self._budget_used + copy.num_pages > config.budget_pages:
                continue
            prefix = self._prefixes[copy.prefix_key]
            copy.state = CopyState.RUNNING
            copy.started_at = now
            self._budget_used += copy.num_pages
            num_running += 1
            self.stats.num_started += 1
            self.stats.num_pages_started += copy.num_pages
            started.append(StartCopy(copy.copy_id, copy.target, copy.source, prefix.token_ids, copy.upto_pages,
                                     prefix.cache_salt))
        return started

    def _cancel(self, copy: _Copy, reason: str, now: float) -> list[CancelCopy]:
        was_running = copy.state is CopyState.RUNNING
        self.stats.num_cancelled += 1
        self._drop(copy)
        prefix = self._prefixes.get(copy.prefix_key)
        if prefix is not None:
            prefix.last_copy_ended = now
        return [CancelCopy(copy.copy_id, reason)] if was_running else []

    def _end(self, copy: _Copy, now: float) -> None:
        self._drop(copy)
        prefix = self._prefixes.get(copy.prefix_key)
        if prefix is not None:
            prefix.last_copy_ended = now

    def _drop(self, copy: _Copy) -> None:
        self._copies.pop(copy.copy_id, None)
        prefix = self._prefixes.get(copy.prefix_key)
        if prefix is not None and copy.copy_id in prefix.copy_ids:
            prefix.copy_ids.remove(copy.copy_id)

    def _forget_cold_prefixes(self) -> None:
        for key in [key for key, prefix in self._prefixes.items()
                    if not prefix.copy_ids and self._key_to_count.get(key, 0) < self.config.min_requests]:
            del self._prefixes[key]


# ---- where the router finds the planner the ingress made ------------------------------------------------------------
_deployment_to_planner: dict[tuple[str, str], HotPrefixPlanner] = {}
_registry_lock = threading.Lock()


def register_planner(app_name: str, deployment_name: str, planner: HotPrefixPlanner | None) -> None:
    """Make ``planner`` the one routers of this deployment in this process feed (None: stop). Serve builds the router
    inside the handle, out of the ingress's reach, so the two meet here, per process and deployment."""
    with _registry_lock:
        if planner is None:
            _deployment_to_planner.pop((app_name, deployment_name), None)
        else:
            _deployment_to_planner[(app_name, deployment_name)] = planner


def planner_for(app_name: str, deployment_name: str) -> HotPrefixPlanner | None:
    return _deployment_to_planner.get((app_name, deployment_name))
