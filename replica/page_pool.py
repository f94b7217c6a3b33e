"""Page pool: page ids, reference counts and the free queue of one replica.

Eviction order: the free queue holds every page with reference count 0, least recently released at the head.
``allocate`` takes pages from the head, so a cached page released long ago is reused (its KV overwritten) first and a
cached page released just now is reused last. Pages that hold nothing worth keeping (never filled, or not in the prefix
cache) are put at the head on release, so they are reused before any cached page. A prefix-cache hit takes a page out
of the middle of the queue in O(1) (``acquire``).

    free queue:  head -> [ 7 (no key) | 3 (cached, old) | 5 (cached) | 1 (cached, newest) ] <- tail
                 allocate(2) returns [7, 3]

The KV tensor itself (``[layers, 2, num_pages, page_size, kv_heads, head_dim]``) is allocated by ``allocate_kv_tensor``;
the pool only manages ids, so its logic is unit tested without touching memory.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class OutOfPagesError(RuntimeError):
    """Raised by ``allocate`` when fewer pages are free than asked for (the scheduler checks first)."""


class PagePool:
    """Page ids 0..num_pages-1 with reference counts and an LRU free queue (see the module docstring)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.refcounts = [0] * num_pages
        self._free_queue: OrderedDict[int, None] = OrderedDict((page_id, None) for page_id in range(num_pages))

    @property
    def num_free(self) -> int:
        """Pages with reference count 0 (including cached ones that may still be hit)."""
        return len(self._free_queue)

    def is_free(self, page_id: int) -> bool:
        return self.refcounts[page_id] == 0

    def free_queue_order(self) -> list[int]:
        """Page ids from head (reused first) to tail (reused last); for tests and debugging."""
        return list(self._free_queue)

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages from the head of the free queue, each with reference count 1."""
        if num_pages > len(self._free_queue):
            raise OutOfPagesError(f"asked for {num_pages} pages, {len(self._free_queue)} free")
        page_ids = []
        for _ in range(num_pages):
            page_id, _ = self._free_queue.popitem(last=False)
            self.refcounts[page_id] = 1
            page_ids.append(page_id)
        return page_ids

    def acquire(self, page_id: int) -> None:
        """Add a reference (a prefix hit); a free page leaves the free queue."""
        if self.refcounts[page_id] == 0:
            del self._free_queue[page_id]
        self.refcounts[page_id] += 1

    def release(self, page_id: int, *, keep_contents: bool) -> None:
        """Drop a reference. At zero the page joins the free queue: at the tail when its contents are worth keeping
        (it is in the prefix cache), at the head otherwise."""
        if self.refcounts[page_id] <= 0:
            raise RuntimeError(f"page {page_id} released more often than acquired")
        self.refcounts[page_id] -= 1
        if self.refcounts[page_id] == 0:
            self._free_queue[page_id] = None
            if not keep_contents:
                self._free_queue.move_to_end(page_id, last=False)

    def check_integrity(self) -> None:
        """Free queue == pages with reference count 0; no negative counts."""
        if any(count < 0 for count in self.refcounts):
            raise AssertionError("negative reference count")
        zero = {page_id for page_id, count in enumerate(self.refcounts) if count == 0}
        if zero != set(self._free_queue):
            raise AssertionError(
                f"free queue {sorted(self._free_queue)} differs from pages with refcount 0 {sorted(zero)}"
            )


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
    """The replica's KV memory: ``[layers, 2 (key, value), num_pages, page_size, kv_heads, head_dim]``."""
    return torch.zeros(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def bytes_per_page(
    *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * page_size * num_kv_heads * head_dim * element_size
