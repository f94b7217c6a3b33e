"""KV cache manager: the page pool and the prefix cache together, and the KV events they produce.

The scheduler talks only to this class (never to the free queue). Invariants, checked by ``check_integrity``:

- every page is either free (reference count 0, in the free queue) or in use (count > 0): free + in use == total;
- a cached page may be free (evictable, hit brings it back) or in use (shared by every request that holds it);
- when the pool hands out a free page that was cached, its key leaves the cache first (an eviction).

With prefix caching off the cache is a ``NullPrefixCache``: nothing is inserted, so nothing is ever matched and
released pages are plain free pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from common.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored, StoredPageInfo
from common.page_keys import PageKey
from replica.page_pool import PagePool
from replica.prefix_cache import NullPrefixCache, PrefixCache


@dataclass(frozen=True)
class CommitResult:
    """What ``commit_page`` did: the page id the request should hold from now on (the one already cached under the
    same key when two requests computed the same page), and whether that id changed."""

    page_id: int
    deduplicated: bool
    newly_cached: bool = False
    """The key entered the cache with this call (false when caching is off or the page already held it)."""


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True) -> None:
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.cache = PrefixCache() if enable_prefix_caching else NullPrefixCache()
        self.num_evictions = 0
        self._events: list[KVEvent] = []
        self._event_seq = 0

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
    def acquire(self, page_ids: Sequence[int]) -> None:
        """Pin pages found by ``match_prefix`` (one reference each)."""
        for page_id in page_ids:
            self.pool.acquire(page_id)

    def allocate(self, num_pages: int) -> list[int]:
        """Fresh pages for new tokens. Cached pages taken from the free queue are evicted from the cache."""
        page_ids = self.pool.allocate(num_pages)
        evicted = []
        for page_id in page_ids:
            key = self.cache.remove(page_id)
            if key is not None:
                evicted.append(key)
        if evicted:
            self.num_evictions += len(evicted)
            self._emit(PagesRemoved, tuple(evicted))
        return page_ids

    def release(self, page_ids: Sequence[int]) -> None:
        """Drop one reference on each page, last page first, so that a request's deepest pages are reused before its
        leading ones (which are the likeliest to be shared)."""
        for page_id in reversed(page_ids):
            self.pool.release(page_id, keep_contents=self.cache.key_of(page_id) is not None)

    def commit_page(self, page_id: int, key: PageKey, token_ids: Sequence[int], *, parent_key: PageKey | None = None,
                    salted: bool = False) -> CommitResult:
        """Register a newly filled full page under ``key`` (``parent_key``: the key of the page before it, None for
        page 0; ``salted``: a cache salt is folded into its chain; both only travel in the stored event).

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
        self._emit(PagesStored, (key,), (StoredPageInfo(parent_key, token_ids, salted),))
        return CommitResult(page_id, False, newly_cached=True)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page that no request holds. Returns False (and changes nothing) while any page is in
        use, like other servers' reset endpoints."""
        if self.num_pages_in_use:
            return False
        self.cache.clear()
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
    def check_integrity(self, page_tables: Sequence[Sequence[int]] = ()) -> None:
        """Pool and cache consistent; if the running requests' page tables are given, reference counts equal the
        number of tables holding each page."""
        self.pool.check_integrity()
        self.cache.check_integrity()
        if self.num_free_pages + self.num_pages_in_use != self.num_pages:
            raise AssertionError("free + in use != total")
        if page_tables:
            expected = [0] * self.num_pages
            for table in page_tables:
                for page_id in table:
                    expected[page_id] += 1
            if expected != self.pool.refcounts:
                diff = [i for i, (a, b) in enumerate(zip(expected, self.pool.refcounts)) if a != b]
                raise AssertionError(f"reference counts differ from page tables at pages {diff}")
