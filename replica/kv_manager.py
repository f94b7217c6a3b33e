"""KV cache manager: the page pool and the prefix cache together, and the KV events they produce.

The scheduler talks only to this class (never to the free queue). Invariants, checked by ``check_integrity``:

- every page is either free (reference count 0, in the free queue) or in use (count > 0): free + in use == total;
- a cached page may be free (evictable, hit brings it back) or in use (shared by every request that holds it);
- when the pool hands out a free page that was cached, its key leaves the cache first (an eviction).

With prefix caching off the cache is a ``NullPrefixCache``: nothing is inserted, so nothing is ever matched and
released pages are plain free pages.

Retention (priority + TTL, see page_pool) is given to cached pages with ``retain``; the manager also keeps the page-time
metrics of vLLM's ``--kv-cache-metrics`` (``KVCacheMetrics``): lifetime (cached -> evicted), idle before eviction (last
use -> evicted), reuse gap (last use -> next hit), and evictions by reason (capacity | ttl | reset) and priority.

Retention for the shared tiers: a retention the pool gives a cached page (a request's, a pin's, a hit restarting a
TTL), an admin pin of pages cached elsewhere, and an unpin, are also queued as ``(key, priority, expires_at)`` changes
(``drain_tier_retention``; priority 0: released) that the engine hands to the tiers, so pages they already hold follow.
A page's change is queued again only when its priority changes or its end moved by at least a quarter of its TTL (at
least ``TIER_REFRESH_MIN_S``), so hits on a hot retained prefix do not become a stream of tier commands.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from common.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored, StoredPageInfo
from common.page_keys import PageKey, prefix_id_of
from common.types import KVCacheMetrics, PinPrefix, PrefixReport
from replica.export_index import ExportIndex
from replica.page_pool import PagePool
from replica.prefix_cache import NullPrefixCache, PrefixCache
from replica.retention import RetentionRegistry

PIN_UNDO_ENTRIES = 64
"""Prefixes per replica whose pins' earlier states are kept for ``take_back_pin`` (the pins in flight, in practice)."""
PIN_UNDO_PER_PREFIX = 8


TIER_REFRESH_MIN_S = 1.0
"""A retained page's restarted TTL reaches the tiers again only once its end moved by at least this (and a quarter of
its TTL)."""


@dataclass(frozen=True)
class CommitResult:
    """What ``commit_page`` did: the page id the request should hold from now on (the one already cached under the
    same key when two requests computed the same page), and whether that id changed."""

    page_id: int
    deduplicated: bool
    newly_cached: bool = False
    """The key entered the cache with this call (false when caching is off or the page already held it)."""


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 max_retained_pages: int | None = None, protected_fraction: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``max_retained_pages``: the retention budget (None: the whole pool). ``protected_fraction``: the share of
        the pool that reused pages may hold in the free queue's protected segment (``PagePool``; 0: plain LRU).
        ``clock``: seconds (tests pass a fake one)."""
        self.page_size = page_size
        self.clock = clock
        self.pool = PagePool(num_pages, max_retained_pages=max_retained_pages, protected_fraction=protected_fraction,
                             clock=clock)
        self.cache = PrefixCache() if enable_prefix_caching else NullPrefixCache()
        self._ghosts: OrderedDict[PageKey, None] = OrderedDict()
        """Keys of the pages evicted last (at most one pool's worth): a page computed again under one of them was
        needed after it was evicted, so it enters the cache protected (a reuse; the ghost list of 2Q / ARC). Without
        it a prefix whose uses are further apart than one turnover of the probation queue is never protected."""
        self.exports = ExportIndex()
        """The cached pages as other threads may copy them (peer exports off the engine thread; see export_index)."""
        self.num_evictions = 0
        self.metrics = KVCacheMetrics(max_retained_pages=self.pool.max_retained_pages)
        self._page_to_cached_at: dict[int, float] = {}
        self._page_to_last_use: dict[int, float] = {}
        self.registry = RetentionRegistry(page_size, clock)
        self._events: list[KVEvent] = []
        self._event_seq = 0
        self._proactive_keys: set[PageKey] = set()
        """Cached keys whose pages arrived by a proactive copy (hot-prefix replication), until evicted."""
        self.num_proactive_hit_pages = 0
        self.num_proactive_hit_requests = 0
        self._tier_retention: list[tuple[PageKey, int, float]] = []
        """Retention changes for the shared tiers: (key, priority (0: released), monotonic end or ``math.inf``)."""
        self._key_to_tier_retention: dict[PageKey, tuple[int, float]] = {}
        """What was last queued for each cached retained page (so a hit re-queues only when its end moved enough)."""
        self._pin_undo: OrderedDict[str, list[tuple[str, tuple | None]]] = OrderedDict()
        """Prefix id -> its last admin pins, oldest first: (pin id, the (priority, ttl_s, source) of the entry that
        pin replaced, or None). ``take_back_pin`` restores it when that pin's warm-up fails. At most
        ``PIN_UNDO_PER_PREFIX`` pins of ``PIN_UNDO_ENTRIES`` prefixes; an unpin drops the prefix's records."""

    # ---- queries -------------------------------------------------------------------------------------------------
    @property
    def enable_prefix_caching(self) -> bool:
        return self.cache.enabled

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_pages

    @property
    def num_pages_in_use(self) -> int:
        return self.pool.num_pages - self.pool.num_free

    def match_prefix(self, page_keys: Sequence[PageKey]) -> list[int]:
        """Page ids of the longest cached prefix of ``page_keys`` (nothing when caching is off). Read-only."""
        return self.cache.match(page_keys)

    def num_free_after_acquiring(self, page_ids: Sequence[int]) -> int:
        """Free pages left once ``page_ids`` (a prefix hit) are acquired."""
        return self.pool.num_free - sum(1 for page_id in set(page_ids) if self.pool.is_free(page_id))

    def cached_keys(self) -> list[PageKey]:
        return list(self.cache.key_to_page)

    # ---- mutations -----------------------------------------------------------------------------------------------
    def acquire(self, page_ids: Sequence[int], *, reuse: bool = True) -> None:
        """Pin pages found by ``match_prefix`` (one reference each); a hit restarts a retained page's TTL. ``reuse``
        False: pinned only to be read (a peer's export, a copy's own leading pages), which does not protect the
        pages from eviction (``PagePool``'s segmented LRU)."""
        now = self.clock()
        for page_id in page_ids:
            last_use = self._page_to_last_use.get(page_id)
            if last_use is not None:
                self.metrics.reuse_gap.observe(now - last_use)
                self._page_to_last_use[page_id] = now
            self.pool.acquire(page_id, reuse=reuse)
            self._note_tier_retention(page_id)

    def allocate(self, num_pages: int) -> list[int]:
        """Fresh pages for new tokens. Cached pages taken from the free queue are evicted from the cache."""
        page_ids = self.pool.allocate(num_pages)
        evicted = []
        for taken in self.pool.last_taken:
            key = self.cache.remove(taken.page_id)
            if key is not None:
                self.exports.withdraw(key)
                evicted.append(key)
                self._remember_evicted(key)
                self._proactive_keys.discard(key)
                self._key_to_tier_retention.pop(key, None)
                self._observe_eviction(taken.page_id, "ttl" if taken.expired else "capacity", taken.priority)
        if evicted:
            self.num_evictions += len(evicted)
            self._emit(PagesRemoved, tuple(evicted))
        self.exports.wait_unpinned(page_ids)  # a peer export still copying one of them finishes first
        return page_ids

    def mark_reused(self, page_id: int) -> None:
        """The page was filled from a peer or a shared tier for a request: protected like a hit (``PagePool``)."""
        self.pool.mark_reused(page_id)

    def release(self, page_ids: Sequence[int]) -> None:
        """Drop one reference on each page, last page first, so that a request's deepest pages are reused before its
        leading ones (which are the likeliest to be shared)."""
        now = self.clock()
        for page_id in reversed(page_ids):
            if page_id in self._page_to_last_use:
                self._page_to_last_use[page_id] = now
            self.pool.release(page_id, keep_contents=self.cache.key_of(page_id) is not None)

    def retain(self, page_ids: Sequence[int], priority: int, ttl_s: float | None) -> int:
        """Give the cached pages among ``page_ids`` this retention (see ``PagePool.retain``); returns how many
        took it (the budget may refuse some)."""
        num_taken = 0
        for page_id in page_ids:
            if self.cache.key_of(page_id) is not None and self.pool.retain(page_id, priority, ttl_s):
                num_taken += 1
                self._note_tier_retention(page_id)
        return num_taken

    def unretain(self, page_ids: Sequence[int]) -> int:
        return sum(1 for page_id in page_ids if self.pool.unretain(page_id))

    def drain_tier_retention(self) -> list[tuple[PageKey, int, float]]:
        """The retention changes queued for the shared tiers since the last call: ``(key, priority, end)``, the end on
        this manager's clock (``math.inf``: until unpinned); priority 0: the retention was released (unpin)."""
        changes, self._tier_retention = self._tier_retention, []
        return changes

    def _note_tier_retention(self, page_id: int) -> None:
        """Queue the cached page's retention for the tiers if it is new, its priority changed, or its end moved by
        a quarter of its TTL (at least ``TIER_REFRESH_MIN_S``)."""
        retention = self.pool.retention_of(page_id)
        if retention is None:
            return
        key = self.cache.key_of(page_id)
        if key is None:
            return
        last = self._key_to_tier_retention.get(key)
        if last is not None and last[0] == retention.priority:
            if retention.expires_at == last[1]:
                return
            gap = max(TIER_REFRESH_MIN_S, (retention.ttl_s or 0.0) / 4)
            if math.isfinite(retention.expires_at) and retention.expires_at - last[1] < gap:
                return
        self._key_to_tier_retention[key] = (retention.priority, retention.expires_at)
        self._tier_retention.append((key, retention.priority, retention.expires_at))

    def pin_prefix(self, pin: PinPrefix) -> tuple[int, int]:
        """Admin pin: remember it (pages cached later get it) and retain the pages cached now. Returns (pages of the
        prefix cached here, pages that took the retention)."""
        if pin.page_keys:
            prefix_id = prefix_id_of(pin.page_keys)
            earlier = self.registry.prefix_id_to_entry.get(prefix_id)
            records = self._pin_undo.pop(prefix_id, [])
            records.append((pin.pin_id, None if earlier is None else (earlier.priority, earlier.ttl_s, earlier.source)))
            self._pin_undo[prefix_id] = records[-PIN_UNDO_PER_PREFIX:]
            while len(self._pin_undo) > PIN_UNDO_ENTRIES:
                self._pin_undo.popitem(last=False)
        self.registry.add(pin.page_keys, priority=pin.priority, ttl_s=pin.ttl_s, source="admin", label=pin.label)
        return self._retain_prefix(pin.page_keys, pin.priority, pin.ttl_s)

    def _retain_prefix(self, keys: Sequence[PageKey], priority: int, ttl_s: float | None) -> tuple[int, int]:
        """Retain the cached pages of ``keys`` and queue the rest for the tiers, which may hold them. Returns (pages
        cached here, pages that took the retention)."""
        page_ids = self.match_prefix(keys)
        num_retained = self.retain(page_ids, priority, ttl_s)
        end = math.inf if ttl_s is None else self.clock() + ttl_s
        for key in keys[len(page_ids):]:
            self._tier_retention.append((key, priority, end))
        return len(page_ids), num_retained

    def take_back_pin(self, prefix_id: str, pin_id: str = "") -> bool:
        """Undo this replica's part of the admin pin ``pin_id`` whose warm-up failed. The last pin of the prefix:
        the prefix goes back to what it was before that pin (an earlier pin or request retention keeps its priority,
        its TTL counted again from now, and its stats; with none, it is unpinned). A pin that a later pin of the same
        prefix followed: the later one stands, and should it fail too, the prefix goes back to what it was before
        both. Nothing changes after an unpin of the prefix. True when the prefix's entry changed."""
        records = self._pin_undo.get(prefix_id, [])
        index = next((n for n, (listed_id, _) in enumerate(records) if listed_id == pin_id), None)
        if index is None:
            return False
        earlier = records.pop(index)[1]
        if index < len(records):
            records[index] = (records[index][0], earlier)
            return False
        if earlier is None:
            return self.unpin_prefix(prefix_id)
        if not records:
            del self._pin_undo[prefix_id]
        entry = self.registry.set_retention(prefix_id, *earlier)
        if entry is None:
            return False
        self._release(entry)  # then the earlier retention: the tiers keep the stronger of two
        self._retain_prefix(entry.keys, entry.priority, entry.ttl_s)
        return True

    def unpin_prefix(self, prefix_id: str) -> bool:
        """Forget a listed prefix and end the retention of its pages that no other listed prefix shares."""
        self._pin_undo.pop(prefix_id, None)  # a failed pin's take-back must not bring back what this ends
        entry = self.registry.remove(prefix_id)
        if entry is None:
            return False
        self._release(entry)
        return True

    def _release(self, entry) -> None:
        """End the retention of ``entry``'s pages that no other listed prefix shares, here and in the tiers (a page
        another prefix shares keeps its retention, the higher of the two, as before)."""
        still = self.registry.keys_still_listed(excluding=entry)
        page_ids = self.match_prefix(entry.keys)
        self.unretain([page_id for page_id, key in zip(page_ids, entry.keys) if key not in still])
        for key in entry.keys:
            if key not in still:
                self._key_to_tier_retention.pop(key, None)
                self._tier_retention.append((key, 0, 0.0))

    def prefix_reports(self, replica_id: str) -> list[PrefixReport]:
        now = self.clock()
        reports = []
        for entry in self.registry.entries():
            page_ids = self.match_prefix(entry.keys)
            reports.append(PrefixReport(
                replica_id=replica_id, prefix_id=entry.prefix_id, source=entry.source, label=entry.label,
                priority=entry.priority, ttl_s=entry.ttl_s, num_pages=len(entry.keys),
                num_pages_resident=len(page_ids),
                num_pages_retained=sum(1 for page_id in page_ids if self.pool.retention_of(page_id) is not None),
                num_requests=entry.num_requests, num_hits=entry.num_hits, cached_tokens=entry.cached_tokens,
                idle_s=round(now - entry.last_used_at, 3), page_keys=tuple(entry.keys)))
        return reports

    def retained_keys(self) -> list[tuple[PageKey, int, float]]:
        """(key, priority, seconds left or ``math.inf``) of every cached page whose retention holds now (routers treat
        them as staying here)."""
        now = self.clock()
        out = []
        for page_id, retention in self.pool.retentions().items():
            key = self.cache.page_to_key.get(page_id) if hasattr(self.cache, "page_to_key") else None
            if key is not None:
                out.append((key, retention.priority, retention.expires_at - now))
        return out

    # ---- hot-prefix replication ---------------------------------------------------------------------------------
    def mark_proactive(self, keys: Sequence[PageKey]) -> None:
        """These cached pages arrived by a proactive copy: hits on them are counted (``observe_local_hit``)."""
        self._proactive_keys.update(key for key in keys if self.cache.lookup(key) is not None)

    def observe_local_hit(self, keys: Sequence[PageKey]) -> None:
        """A request's first admission reused the cached pages ``keys``: count those that a proactive copy brought."""
        if not self._proactive_keys:
            return
        num_hit = sum(1 for key in keys if key in self._proactive_keys)
        if num_hit:
            self.num_proactive_hit_pages += num_hit
            self.num_proactive_hit_requests += 1

    def kv_cache_metrics(self) -> KVCacheMetrics:
        """A snapshot of the page-time metrics and retention gauges."""
        self.metrics.num_retained_pages = self.pool.num_retained
        self.metrics.retention_demotions = dict(self.pool.demotions)
        self.metrics.num_protected_pages = self.pool.num_protected
        self.metrics.max_protected_pages = self.pool.max_protected_pages
        self.metrics.protected_demotions = self.pool.num_protected_demoted
        return self.metrics.copy()

    def _observe_eviction(self, page_id: int, reason: str, priority: int) -> None:
        now = self.clock()
        cached_at = self._page_to_cached_at.pop(page_id, None)
        last_use = self._page_to_last_use.pop(page_id, None)
        if cached_at is not None:
            self.metrics.lifetime.observe(now - cached_at)
        if last_use is not None:
            self.metrics.idle_before_evict.observe(now - last_use)
        self.metrics.evictions[(reason, priority)] = self.metrics.evictions.get((reason, priority), 0) + 1

    def commit_page(self, page_id: int, key: PageKey, token_ids: Sequence[int], *, parent_key: PageKey | None = None,
                    salted: bool = False, requested: bool = True) -> CommitResult:
        """Register a newly filled full page under ``key`` (``parent_key``: the key of the page before it, None for
        page 0; ``salted``: a cache salt is folded into its chain; both only travel in the stored event).
        ``requested`` False: filled ahead of any request (a proactive copy), so the ghost list does not protect it.

        If another page already holds ``key`` (two requests computed the same prefix at once), the caller should hold
        that page instead: it is acquired here and ``page_id`` is released, so the prefix is stored once.
        """
        existing = self.cache.lookup(key)
        if existing is not None:
            if existing == page_id:
                return CommitResult(page_id, False)
            self.pool.acquire(existing)
            self.pool.release(page_id, keep_contents=False)
            return CommitResult(existing, True)
        token_ids = tuple(token_ids)  # one tuple, shared by the cache and the event
        if not self.cache.insert(key, page_id, token_ids):
            return CommitResult(page_id, False)
        self.exports.publish(key, page_id, token_ids)
        now = self.clock()
        self._page_to_cached_at[page_id] = now
        self._page_to_last_use[page_id] = now
        pin = self.registry.pin_for(key)
        if pin is not None:
            self.pool.retain(page_id, *pin)
            self._note_tier_retention(page_id)
        if requested and key in self._ghosts:  # evicted, then needed again
            del self._ghosts[key]
            self.pool.mark_reused(page_id)
        self._emit(PagesStored, (key,), (StoredPageInfo(parent_key, token_ids, salted),))
        return CommitResult(page_id, False, newly_cached=True)

    def _remember_evicted(self, key: PageKey) -> None:
        ghosts = self._ghosts
        ghosts[key] = None
        if len(ghosts) > self.pool.num_pages:
            ghosts.popitem(last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page that no request holds. Returns False (and changes nothing) while any page is in
        use, like other servers' reset endpoints."""
        if self.num_pages_in_use:
            return False
        for page_id in list(self.cache.page_to_key):
            self._observe_eviction(page_id, "reset", self.pool.priority_of(page_id))
        self.pool.clear_retention()
        self.pool.forget_contents()
        self._key_to_tier_retention.clear()
        self.registry.clear_requests()
        self.cache.clear()
        self.exports.clear()
        self._proactive_keys.clear()
        self._ghosts.clear()
        self._emit_cleared()
        return True

    # ---- events --------------------------------------------------------------------------------------------------
    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _emit(self, kind: type, keys: tuple[PageKey, ...], infos: tuple[StoredPageInfo, ...] = ()) -> None:
        """Append an event; consecutive events of one kind merge (keeping their seq) so a step emits few events."""
        extra = {"infos": infos} if kind is PagesStored else {}
        if self._events and type(self._events[-1]) is kind:
            last = self._events[-1]
            if kind is PagesStored:
                extra = {"infos": last.infos + infos}
            self._events[-1] = kind(seq=last.seq, keys=last.keys + keys, **extra)
            return
        self._event_seq += 1
        self._events.append(kind(seq=self._event_seq, keys=keys, **extra))

    def _emit_cleared(self) -> None:
        self._event_seq += 1
        self._events.append(AllPagesCleared(seq=self._event_seq))

    # ---- checks --------------------------------------------------------------------------------------------------
    def check_integrity(self, page_tables: Sequence[Sequence[int]] | None = None) -> None:
        """Pool and cache consistent; if the holders' page tables are given (even none), reference counts equal the
        number of tables holding each page."""
        self.pool.check_integrity()
        self.cache.check_integrity()
        self.exports.check_integrity(self.cache.key_to_page)
        if self.num_free_pages + self.num_pages_in_use != self.num_pages:
            raise AssertionError("free + in use != total")
        if page_tables is not None:
            expected = [0] * self.num_pages
            for table in page_tables:
                for page_id in table:
                    expected[page_id] += 1
            if expected != self.pool.refcounts:
                diff = [i for i, (a, b) in enumerate(zip(expected, self.pool.refcounts)) if a != b]
                raise AssertionError(f"reference counts differ from page tables at pages {diff}")
