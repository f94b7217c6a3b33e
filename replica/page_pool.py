"""Page pool: page ids, reference counts, retention (priority + TTL) and the free queue of one replica.

Eviction order: the free queue holds every page with reference count 0. ``allocate`` takes pages

1. that hold nothing worth keeping (never filled, or not in the prefix cache), most recently released first;
2. then plain cached pages (priority 0) that were never reused, least recently released first (probation);
3. then plain cached pages that were reused at least once (protected: a later request hit them, they were copied or
   fetched for a request, or the KV manager saw them computed again after their eviction), least recently released
   first;
4. then retained pages by retention priority, lowest first, and within one priority least recently released first.

Steps 2 and 3 are a segmented LRU: a page enters the cache on probation and is protected once it is reused, so a
flood of prompts seen once (or each request's own question and answer pages) is evicted before the prefixes that
requests share, instead of pushing them out. At most ``protected_fraction`` of the pool sits in the protected
queue; past that its least recently released page goes back to the tail of probation (and must be reused again to
be protected). ``protected_fraction`` 0 is plain LRU.

So a page whose retention has not expired is never evicted while a page of lower priority is free. A retained page
whose TTL passes without a hit drops to priority 0 at the head of that level (it is the first cached page to go; its
eviction is counted with reason "ttl"). A prefix-cache hit takes a page out of the middle of the queue in O(1)
(``acquire``) and restarts its TTL.

    free queue:  head -> [ 7 (no key) | 3 (p0, old) | 5 (p0) | 1 (p0, reused) | 4 (p50) | 2 (p100) ] <- tail
                 allocate(2) returns [7, 3]; page 2 goes last

Retention is soft: a retained page is still a free page (it counts in ``num_free``), so pins can never starve a running
request or deadlock the scheduler; they only decide the order. At most ``max_retained_pages`` pages hold a retention at
once (the budget flag): a new retention beyond it replaces the lowest-priority one held (if lower), else is refused.

The KV tensor itself (``[layers, 2, num_pages, page_size, kv_heads, head_dim]``) is allocated by ``allocate_kv_tensor``;
the pool only manages ids, so its logic is unit tested without touching memory (and with a fake clock).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch


class OutOfPagesError(RuntimeError):
    """Raised by ``allocate`` when fewer pages are free than asked for (the scheduler checks first)."""


@dataclass
class PageRetention:
    """A page's retention: its priority until ``expires_at`` (``math.inf``: until released by ``unretain``)."""

    priority: int
    ttl_s: float | None
    expires_at: float


@dataclass(frozen=True)
class TakenPage:
    """A page ``allocate`` handed out, with what it was before (for the eviction metrics)."""

    page_id: int
    priority: int
    """Retention priority it was evicted at (its former priority if the TTL had expired)."""
    expired: bool
    """Its retention had expired (eviction reason "ttl")."""


class PagePool:
    """Page ids 0..num_pages-1 with reference counts, retention and a free queue (see the module docstring)."""

    def __init__(self, num_pages: int, *, max_retained_pages: int | None = None, protected_fraction: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        if not 0.0 <= protected_fraction <= 1.0:
            raise ValueError(f"protected_fraction must be within [0, 1], got {protected_fraction!r}")
        self.num_pages = num_pages
        self.max_protected_pages = int(num_pages * protected_fraction)
        self.max_retained_pages = num_pages if max_retained_pages is None else max_retained_pages
        self.clock = clock
        self.refcounts = [0] * num_pages
        self._unkept: OrderedDict[int, None] = OrderedDict((page_id, None) for page_id in range(num_pages))
        self._levels: dict[int, OrderedDict[int, None]] = {}
        """Free cached pages by effective priority; each an LRU queue (head = released longest ago). Level 0 holds the
        plain pages on probation."""
        self._protected: OrderedDict[int, None] = OrderedDict()
        """Free plain cached pages that were reused (between level 0 and the retained levels in eviction order)."""
        self.reused = [False] * num_pages
        """The page's cached contents were reused since it was filled (``acquire`` with ``reuse``, ``mark_reused``)."""
        self.num_protected_demoted = 0
        """Protected pages sent back to probation because the protected queue was full."""
        self._page_to_retention: dict[int, PageRetention] = {}
        self._expiry_heap: list[tuple[float, int]] = []
        self._page_to_expired_priority: dict[int, int] = {}
        """Free pages whose retention expired, with the priority they had (eviction reason "ttl")."""
        self.demotions: Counter[str] = Counter()
        self.last_taken: list[TakenPage] = []
        """What the latest ``allocate`` took (read by the KV manager for its eviction metrics)."""

    # ---- queries -------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages with reference count 0 (including cached and retained ones that may still be hit)."""
        return len(self._unkept) + len(self._protected) + sum(len(level) for level in self._levels.values())

    @property
    def num_protected(self) -> int:
        """Free pages in the protected queue now."""
        return len(self._protected)

    @property
    def num_retained(self) -> int:
        self.expire()
        return len(self._page_to_retention)

    def is_free(self, page_id: int) -> bool:
        return self.refcounts[page_id] == 0

    def retention_of(self, page_id: int) -> PageRetention | None:
        self.expire()
        return self._page_to_retention.get(page_id)

    def peek_retention(self, page_id: int) -> PageRetention | None:
        """The page's retention as last recorded, without expiring anything: a plain dict read, so callable from
        another thread (a peer export); it may be a moment stale."""
        return self._page_to_retention.get(page_id)

    def retentions(self) -> dict[int, PageRetention]:
        """Page id -> its retention, for every page whose retention holds now (a copy)."""
        self.expire()
        return dict(self._page_to_retention)

    def priority_of(self, page_id: int) -> int:
        retention = self.retention_of(page_id)
        return retention.priority if retention is not None else 0

    def free_queue_order(self) -> list[int]:
        """Page ids from head (reused first) to tail (reused last); for tests and debugging."""
        self.expire()
        order = list(self._unkept)
        for queue in self._cached_queues():
            order.extend(queue)
        return order

    # ---- references ----------------------------------------------------------------------------------------------
    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages from the head of the free queue, each with reference count 1; their retention
        ends (the caller overwrites them)."""
        if num_pages > self.num_free:
            raise OutOfPagesError(f"asked for {num_pages} pages, {self.num_free} free")
        self.expire()
        taken = []
        for _ in range(num_pages):
            if self._unkept:
                page_id, _ = self._unkept.popitem(last=False)
                taken.append(TakenPage(page_id, 0, False))
            elif 0 not in self._levels and self._protected:
                page_id, _ = self._protected.popitem(last=False)
                taken.append(TakenPage(page_id, 0, False))
            else:
                priority = min(self._levels)
                level = self._levels[priority]
                page_id, _ = level.popitem(last=False)
                if not level:
                    del self._levels[priority]
                expired_priority = self._page_to_expired_priority.pop(page_id, None)
                self._page_to_retention.pop(page_id, None)
                taken.append(TakenPage(page_id, priority if expired_priority is None else expired_priority,
                                       expired_priority is not None))
            self.refcounts[page_id] = 1
            self.reused[page_id] = False
        self.last_taken = taken
        return [page.page_id for page in taken]

    def acquire(self, page_id: int, *, reuse: bool = True) -> None:
        """Add a reference (a prefix hit): a free page leaves the free queue; a retention's TTL restarts. ``reuse``
        (a request reuses the contents; not a peer's export reading them): the page is protected when released."""
        self.expire()
        if self.refcounts[page_id] == 0:
            self._remove_free(page_id)
        self.refcounts[page_id] += 1
        if reuse:
            self.reused[page_id] = True
        retention = self._page_to_retention.get(page_id)
        if retention is not None and retention.ttl_s is not None:
            self._set_expiry(page_id, retention, self.clock() + retention.ttl_s)

    def release(self, page_id: int, *, keep_contents: bool) -> None:
        """Drop a reference. At zero the page joins the free queue: at the tail of its queue (its retention level; for
        a plain page probation, or the protected queue once reused) when its contents are worth keeping (it is in the
        prefix cache), at the head of everything otherwise (and its retention ends)."""
        if self.refcounts[page_id] <= 0:
            raise RuntimeError(f"page {page_id} released more often than acquired")
        self.expire()
        self.refcounts[page_id] -= 1
        if self.refcounts[page_id] > 0:
            return
        if not keep_contents:
            self._page_to_retention.pop(page_id, None)
            self._page_to_expired_priority.pop(page_id, None)
            self.reused[page_id] = False
            self._unkept[page_id] = None
            self._unkept.move_to_end(page_id, last=False)
            return
        self._queue_free(page_id, self.priority_of(page_id))

    def forget_contents(self) -> None:
        """Every page is free and holds nothing worth keeping any more (the prefix cache was reset, so no page is in
        use): all of them go to the queue of pages that hold nothing, with no reuse and no protection (a protected
        page that now holds nothing must not outlast pages that do)."""
        if any(self.refcounts):
            raise RuntimeError("forget_contents while pages are in use")
        self._unkept = OrderedDict((page_id, None) for page_id in range(self.num_pages))
        self._levels.clear()
        self._protected.clear()
        self._page_to_expired_priority.clear()
        self.reused = [False] * self.num_pages

    def mark_reused(self, page_id: int) -> None:
        """The page's contents were brought for a request (copied from a peer, fetched from a tier): protect it like
        a hit (it takes effect when the page is next released)."""
        self.reused[page_id] = True

    # ---- retention -----------------------------------------------------------------------------------------------
    def retain(self, page_id: int, priority: int, ttl_s: float | None) -> bool:
        """Give the page (it must hold cached contents) at least this priority for ``ttl_s`` seconds from now (None:
        until ``unretain``). A page keeps the higher of its current and the new priority, and the later expiry.
        False when the budget is full of retentions of this priority or higher (nothing changes then)."""
        if priority <= 0:
            return False
        self.expire()
        now = self.clock()
        expires_at = math.inf if ttl_s is None else now + ttl_s
        current = self._page_to_retention.get(page_id)
        if current is None:
            if len(self._page_to_retention) >= self.max_retained_pages and not self._make_room(priority):
                return False
            current = PageRetention(0, ttl_s, -math.inf)
            self._page_to_retention[page_id] = current
            self._page_to_expired_priority.pop(page_id, None)
        elif priority > current.priority or (priority == current.priority and expires_at > current.expires_at):
            current.ttl_s = ttl_s
        old_priority = current.priority
        current.priority = max(current.priority, priority)
        if expires_at > current.expires_at:
            self._set_expiry(page_id, current, expires_at)
        if self.refcounts[page_id] == 0 and current.priority != old_priority:
            self._move_free(page_id, current.priority)
        return True

    def unretain(self, page_id: int, reason: str = "unpin") -> bool:
        """End the page's retention now; a free page goes to the tail of probation, or of the protected queue when it
        was reused (most recently used there)."""
        retention = self._page_to_retention.pop(page_id, None)
        if retention is None:
            return False
        self.demotions[reason] += 1
        if self.refcounts[page_id] == 0:
            self._move_free(page_id, 0)
        return True

    def clear_retention(self) -> None:
        """Drop every retention (reset): free retained pages move to the tail of probation or the protected queue."""
        for page_id in list(self._page_to_retention):
            self.unretain(page_id, "reset")
        self._page_to_expired_priority.clear()

    def expire(self) -> None:
        """Retentions whose TTL has passed end: a free page moves to the head of priority 0 (the first cached page to
        be evicted, reason "ttl")."""
        if not self._expiry_heap:
            return
        now = self.clock()
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            expires_at, page_id = heapq.heappop(self._expiry_heap)
            retention = self._page_to_retention.get(page_id)
            if retention is None or retention.expires_at != expires_at:
                continue  # stale entry: the TTL was restarted or the retention ended
            del self._page_to_retention[page_id]
            self.demotions["ttl"] += 1
            if self.refcounts[page_id] == 0:
                self._move_free(page_id, 0, to_head=True)
                self._page_to_expired_priority[page_id] = retention.priority

    # ---- internals -----------------------------------------------------------------------------------------------
    def _level(self, priority: int) -> OrderedDict[int, None]:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = OrderedDict()
        return level

    def _cached_queues(self) -> list[OrderedDict[int, None]]:
        """The free queues of cached pages in eviction order: probation (level 0), protected, retained levels."""
        queues = [self._levels[0]] if 0 in self._levels else []
        queues.append(self._protected)
        queues.extend(self._levels[priority] for priority in sorted(self._levels) if priority > 0)
        return queues

    def _queue_free(self, page_id: int, priority: int) -> None:
        """A free cached page joins the tail of its queue: its priority level, or the protected queue for a reused
        plain page while the protected queue has room (when it is full, its head goes back to probation)."""
        if priority > 0 or not self.reused[page_id] or self.max_protected_pages == 0:
            self._level(priority)[page_id] = None
            return
        self._protected[page_id] = None
        while len(self._protected) > self.max_protected_pages:
            demoted, _ = self._protected.popitem(last=False)
            self.reused[demoted] = False
            self._level(0)[demoted] = None
            self.num_protected_demoted += 1

    def _remove_free(self, page_id: int) -> None:
        if page_id in self._unkept:
            del self._unkept[page_id]
            return
        if page_id in self._protected:
            del self._protected[page_id]
            return
        self._page_to_expired_priority.pop(page_id, None)
        for priority, level in self._levels.items():
            if page_id in level:
                del level[page_id]
                if not level:
                    del self._levels[priority]
                return
        raise AssertionError(f"free page {page_id} is in no queue")

    def _move_free(self, page_id: int, new_priority: int, *, to_head: bool = False) -> None:
        """A free cached page changes priority level (tail of the new level, or head with ``to_head``: an expired
        retention, the first cached page to go)."""
        self._remove_free(page_id)
        if to_head:
            target = self._level(new_priority)
            target[page_id] = None
            target.move_to_end(page_id, last=False)
        else:
            self._queue_free(page_id, new_priority)

    def _set_expiry(self, page_id: int, retention: PageRetention, expires_at: float) -> None:
        retention.expires_at = expires_at
        if expires_at != math.inf:
            heapq.heappush(self._expiry_heap, (expires_at, page_id))

    def _make_room(self, priority: int) -> bool:
        """Budget full: end the retention of the lowest-priority page held (the one expiring first among equals) if it
        is below ``priority``."""
        victim = min(self._page_to_retention.items(), key=lambda item: (item[1].priority, item[1].expires_at))
        if victim[1].priority >= priority:
            return False
        self.unretain(victim[0], "budget")
        return True

    def check_integrity(self) -> None:
        """Free queue == pages with reference count 0; no negative counts; free pages sit at their priority."""
        if any(count < 0 for count in self.refcounts):
            raise AssertionError("negative reference count")
        self.expire()
        zero = {page_id for page_id, count in enumerate(self.refcounts) if count == 0}
        queued = list(self._unkept) + list(self._protected) + [page_id for level in self._levels.values()
                                                               for page_id in level]
        if len(queued) != len(set(queued)) or zero != set(queued):
            raise AssertionError(f"free queue {sorted(queued)} differs from pages with refcount 0 {sorted(zero)}")
        for priority, level in self._levels.items():
            for page_id in level:
                retention = self._page_to_retention.get(page_id)
                if (retention.priority if retention is not None else 0) != priority:
                    raise AssertionError(f"free page {page_id} queued at priority {priority}")
        for page_id in self._protected:
            if not self.reused[page_id] or page_id in self._page_to_retention:
                raise AssertionError(f"protected page {page_id} is not a reused plain page")
        if len(self._protected) > self.max_protected_pages:
            raise AssertionError("more protected pages than the protected queue holds")
        if len(self._page_to_retention) > self.max_retained_pages:
            raise AssertionError("more retained pages than the budget")


def allocate_kv_tensor(
    *,
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """The replica's KV memory (private; replica/shared_pool.py places the same shape in shared memory)."""
    return torch.zeros(kv_tensor_shape(num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                                       num_kv_heads=num_kv_heads, head_dim=head_dim), dtype=dtype, device=device)


def kv_tensor_shape(*, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                    head_dim: int) -> tuple[int, ...]:
    """``[layers, 2 (key, value), num_pages, page_size, kv_heads, head_dim]``."""
    return (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)


def bytes_per_page(
    *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * page_size * num_kv_heads * head_dim * element_size
