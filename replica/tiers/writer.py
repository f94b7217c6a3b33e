"""The background writer of a tier: a bounded FIFO of pages drained by one daemon thread.

    store() --submit--> | p5 p6 p7 |  (pending)  --take batch--> [p3 p4] (in flight) --> write_pages(batch)
                        <------------ capacity counts pending + in flight ------------>

``submit`` never blocks: it accepts what fits under the capacity and rejects the rest (the caller counts them as
dropped). Because in-flight pages count against the capacity, how many pages one ``submit`` accepts does not depend on
the writer thread's timing. The thread runs at a lower CPU priority (``WRITER_NICE``): sealing and sending pages is
background work, and on a small machine it otherwise takes a core from the engine's next step (the prefill of the
request whose copied pages it writes).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Callable, Sequence

from replica.tiers.base import StoredPage

logger = logging.getLogger(__name__)

WRITER_NICE = 10
"""Added to the writer thread's nice value (Linux schedules threads on their own; raising it needs no privilege)."""


def lower_thread_priority(increment: int = WRITER_NICE) -> None:
    """Make the calling thread yield the CPU to the process's other threads (a no-op where unsupported)."""
    try:
        thread_id = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread_id, os.getpriority(os.PRIO_PROCESS, thread_id) + increment)
    except (AttributeError, OSError):
        pass


class BackgroundWriter:
    """Runs ``write_pages(batch)`` on its own thread for every submitted page, in submission order.

    ``write_pages`` should handle its own failures; if it raises anyway, the exception is logged and
    ``on_failure(batch)`` is called so the owner can count the batch as dropped.
    """

    def __init__(
        self,
        *,
        name: str,
        write_pages: Callable[[list], None],
        on_failure: Callable[[list], None],
        capacity: int,
        max_batch_pages: int = 16,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"the store queue must hold at least one page, got queue_size={capacity}")
        if max_batch_pages < 1:
            raise ValueError(f"max_batch_pages must be at least 1, got {max_batch_pages}")
        self._write_pages = write_pages
        self._on_failure = on_failure
        self._capacity = capacity
        self._max_batch_pages = max_batch_pages
        self._pending: collections.deque[StoredPage] = collections.deque()
        self._num_unfinished = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"{name}-writer", daemon=True)
        self._thread.start()

    @property
    def num_unfinished(self) -> int:
        """Pages accepted but not yet written (pending + in flight)."""
        with self._cond:
            return self._num_unfinished

    def submit(self, pages: Sequence[StoredPage]) -> int:
        """Enqueue as many leading ``pages`` as fit; returns how many were accepted (0 after ``close``)."""
        with self._cond:
            if self._closed:
                return 0
            num_accepted = max(0, min(len(pages), self._capacity - self._num_unfinished))
            self._pending.extend(pages[:num_accepted])
            self._num_unfinished += num_accepted
            if num_accepted:
                self._cond.notify_all()
            return num_accepted

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted page is finished; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_unfinished == 0, timeout)

    def close(self, timeout: float | None = 5.0) -> bool:
        """Stop accepting, let the thread finish what is queued (up to ``timeout``); True if it finished."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        lower_thread_priority()
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                self._write_pages(batch)
            except Exception:
                logger.exception("KV tier writer failed on %d pages; they are dropped", len(batch))
                self._on_failure(batch)
            finally:
                with self._cond:
                    self._num_unfinished -= len(batch)
                    self._cond.notify_all()

    def _take_batch(self) -> list[StoredPage] | None:
        """The next pages to write, or None once closed and drained."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closed)
            if not self._pending:
                return None
            num_taken = min(self._max_batch_pages, len(self._pending))
            return [self._pending.popleft() for _ in range(num_taken)]
