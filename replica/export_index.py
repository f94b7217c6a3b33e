"""Export index: the committed pages a peer may copy, readable from any thread, with pins that keep a page's memory
from being reused while another thread copies it.

A peer's ``export_pages`` used to wait for the holder's engine thread to finish its step (seconds on a busy holder,
past the requester's timeout). A committed page never changes while its key is cached: the engine writes only pages
it has just allocated, and the pool hands a cached page out (evicting its key) only from the free queue. So another
thread may read a cached page as long as the page cannot be handed out meanwhile. This index guarantees that, with
one lock shared by both sides:

    engine thread                                    exporting thread
    commit a page    -> publish(key, page, tokens)
                                                     pin_prefix(keys): under the lock, the leading run of keys still
                                                       published, each page pinned
                                                     copy the pinned pages (no lock held)
    evict / reset    -> withdraw(key): no new pins
    allocate a page  -> wait_unpinned(pages): blocks  unpin(pages)   (always, in a ``finally``)
                         while a copy still reads one

A peer may also ask for a prefix this replica is computing right now (requests spread before the holder finished it):
``wait_for_computing`` waits, bounded and before pinning anything, until those pages are published (the engine
names the pages being computed each step with ``set_computing``). No pin is held while waiting, so the engine never
waits for a waiting export.

A peer on the same node copies without a pin, straight from the pool's shared memory (replica/shared_pool.py): it is
told each page's generation, which ``withdraw`` increments under the lock before the page can be reused, and keeps
only the pages whose generation had not moved when its copy ended.

A page is pinned only while its key is published, under the lock, and withdrawing a key also happens under the lock,
so once ``withdraw`` returns no new pin on that page can start; ``wait_unpinned`` then waits for the copies already
under way (a copy of a few pages: milliseconds). The engine's reference counts and free queue are untouched by an
export (they are engine-thread state), so an export never changes what is evicted or when.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterable, NamedTuple, Sequence

from common.page_keys import PageKey

logger = logging.getLogger(__name__)

REUSE_WAIT_WARN_S = 10.0
"""How often a page reuse still waiting for peer copies to unpin it is logged (copies time out after seconds: a wait
this long means a pin leaked)."""


class PinnedPage(NamedTuple):
    key: PageKey
    page_id: int
    token_ids: tuple[int, ...]


class ExportIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        """Notified when a page is unpinned or published, or the set of pages being computed changes."""
        self._key_to_page: dict[PageKey, tuple[int, tuple[int, ...]]] = {}
        self._computing: set[PageKey] = set()
        self._page_to_pins: dict[int, int] = {}
        self.generations = None
        """Per page, a count of its keys withdrawn (an int64 numpy array over the pool's shared memory,
        replica/shared_pool.py; None when the pool is private): peers that copy a page without a pin check it."""
        self.num_reuse_waits = 0
        """How often the engine had to wait for a copy before reusing a page (for tests and diagnosis)."""

    # ---- engine thread -------------------------------------------------------------------------------------------
    def publish(self, key: PageKey, page_id: int, token_ids: tuple[int, ...]) -> None:
        """``page_id`` holds the committed KV of ``key`` (the prefix cache just recorded it)."""
        with self._lock:
            self._key_to_page[key] = (page_id, token_ids)
            self._computing.discard(key)
            self._changed.notify_all()

    def withdraw(self, key: PageKey) -> None:
        """``key`` left the prefix cache: no copy may start on its page from now on (and a copy without a pin that
        is under way sees the page's generation move)."""
        with self._lock:
            found = self._key_to_page.pop(key, None)
            if found is not None and self.generations is not None:
                self.generations[found[0]] += 1

    def clear(self) -> None:
        with self._lock:
            if self.generations is not None:
                for page_id, _ in self._key_to_page.values():
                    self.generations[page_id] += 1
            self._key_to_page.clear()

    def wait_unpinned(self, page_ids: Iterable[int]) -> None:
        """Block until no copy reads any of ``page_ids`` (call before their memory is reused; their keys must have been
        withdrawn first, so no new copy can start)."""
        with self._lock:
            if not self._page_to_pins:
                return
            for page_id in page_ids:
                if page_id in self._page_to_pins:
                    self.num_reuse_waits += 1
                    started = warned = time.monotonic()
                    while page_id in self._page_to_pins:  # never reuse a page a copy still reads: wait, and say so
                        self._changed.wait(REUSE_WAIT_WARN_S)
                        now = time.monotonic()
                        if page_id in self._page_to_pins and now - warned >= REUSE_WAIT_WARN_S:
                            warned = now
                            logger.warning("page %d has waited %.0f s for %d peer copies to finish before reuse",
                                           page_id, now - started, self._page_to_pins[page_id])

    def set_computing(self, keys: Iterable[PageKey]) -> None:
        """The keys of the pages running requests are computing now (each step; empty when idle)."""
        with self._lock:
            self._computing = set(keys)
            self._changed.notify_all()

    # ---- any thread ----------------------------------------------------------------------------------------------
    def wait_for_computing(self, keys: Sequence[PageKey], timeout_s: float) -> None:
        """Wait, at most ``timeout_s`` and holding no pin, while the first of ``keys`` not yet published is a page
        being computed here (a peer asking for a prefix this replica is computing right now gets it when it is
        committed, instead of nothing)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                num_published = 0
                while num_published < len(keys) and keys[num_published] in self._key_to_page:
                    num_published += 1
                if num_published == len(keys) or keys[num_published] not in self._computing:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._changed.wait(remaining)

    def pin_prefix(self, keys: Sequence[PageKey]) -> list[PinnedPage]:
        """Pin the pages of the leading run of ``keys`` that are published; the caller must ``unpin`` them."""
        with self._lock:
            pinned = self._published_run(keys)  # every page looked up first: a bad key raises with nothing pinned
            for page in pinned:
                self._page_to_pins[page.page_id] = self._page_to_pins.get(page.page_id, 0) + 1
        return pinned

    def published_prefix(self, keys: Sequence[PageKey]) -> tuple[list[PinnedPage], list[int]]:
        """The leading run of ``keys`` that is published, with each page's generation now (no pin: for a copy that
        checks the generations afterwards; needs ``generations``)."""
        with self._lock:
            found = self._published_run(keys)
            generations = self.generations[[page.page_id for page in found]].tolist() if found else []
        return found, generations

    def _published_run(self, keys: Sequence[PageKey]) -> list[PinnedPage]:
        """The leading run of ``keys`` that is published (call under the lock)."""
        run = []
        for key in keys:
            found = self._key_to_page.get(key)
            if found is None:
                break
            run.append(PinnedPage(key, *found))
        return run

    def unpin(self, page_ids: Iterable[int]) -> None:
        with self._lock:
            for page_id in page_ids:
                count = self._page_to_pins[page_id] - 1
                if count:
                    self._page_to_pins[page_id] = count
                else:
                    del self._page_to_pins[page_id]
            self._changed.notify_all()

    @property
    def num_pinned_pages(self) -> int:
        with self._lock:
            return len(self._page_to_pins)

    def check_integrity(self, key_to_page: dict[PageKey, int]) -> None:
        """Published == the prefix cache's key -> page map (engine thread)."""
        with self._lock:
            published = {key: page_id for key, (page_id, _) in self._key_to_page.items()}
        if published != key_to_page:
            raise AssertionError("the export index differs from the prefix cache")
