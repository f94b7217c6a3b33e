"""The disk tier: one Arrow IPC file per page under a folder shared by every replica (and process) on the machine.

Layout::

    root/FORMAT.json                               {"key_format_version": 1}: claimed by the first tier to open root
    root/{dtype}/{key hex[:2]}/{key hex}.arrow     one page (see ``arrow_file``), content-addressed by page key
    root/{dtype}/{key hex[:2]}/.{name}.*.tmp       a write in progress (renamed into place when whole)

Eviction order: pages this process stored with a retention (``StoredPage.retention_priority`` until
``retain_until``) go after every lower-priority page; otherwise least recently used first, by file modification
time, which is set when a page is written and refreshed (``os.utime``) every time it is loaded. The tier keeps an
estimate of the bytes under ``root`` (scanned at start, updated on its own writes and deletes); when a write takes it
past ``budget_bytes``, the writer thread rescans ``root`` (other processes write there too) and deletes the oldest
files until the total is at most ``evict_to_fraction * budget_bytes``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from common.page_format import PageFormat
from common.page_keys import PageKey
from common.types import CacheSource
from replica.tiers.arrow_file import TEMP_SUFFIX, read_page_file, remove_quietly, write_page_file
from replica.tiers.base import (
    QueuedWriteTier,
    StatsRecorder,
    StoredPage,
    WarningThrottle,
    check_load_args,
)
from replica.tiers.codec import RejectedEntry
from replica.tiers.writer import BackgroundWriter

logger = logging.getLogger(__name__)

FORMAT_MARKER_NAME = "FORMAT.json"
PAGE_SUFFIX = ".arrow"
STALE_TEMP_AGE_S = 3600.0
"""Temporary files older than this are leftovers of a crashed writer and are deleted at start-up."""


@dataclass(frozen=True)
class PageFile:
    """One page file found by a scan of ``root``."""

    path: str
    size: int
    mtime_ns: int


class DiskTier(QueuedWriteTier):
    """Shared disk KV tier of Arrow IPC files (see the module docstring for layout and eviction order).

    Mutates: files under ``root_dir`` only (pages it writes, rejects or evicts; the format marker; stale temp files).
    Raises: OSError from the constructor if ``root_dir`` cannot be created, ValueError for bad arguments; nothing
    afterwards because of the files' state (I/O errors are counted in ``errors`` and answered with misses).
    """

    source = CacheSource.DISK

    def __init__(
        self,
        root_dir: str | os.PathLike,
        page_format: PageFormat,
        budget_bytes: int,
        *,
        queue_size: int = 256,
        fsync: bool = False,
        evict_to_fraction: float = 0.9,
        write_batch_pages: int = 16,
    ) -> None:
        if budget_bytes < 1:
            raise ValueError(f"the disk tier budget must be positive, got {budget_bytes} bytes")
        if not 0.0 <= evict_to_fraction <= 1.0:
            raise ValueError(f"evict_to_fraction must be within [0, 1], got {evict_to_fraction}")
        self._root = os.fspath(root_dir)
        self._page_format = page_format
        self._budget_bytes = budget_bytes
        self._evict_to_bytes = int(budget_bytes * evict_to_fraction)
        self._fsync = fsync
        self._stats = StatsRecorder()
        self._throttle = WarningThrottle()
        self._lock = threading.Lock()
        self._total_bytes = 0
        self._last_mtime_ns = 0
        self._path_to_retention: dict[str, tuple[int, float]] = {}
        """Retention of the retained pages this process stored: path -> (priority, retain_until wall-clock)."""
        self._closed = False
        os.makedirs(self._root, exist_ok=True)
        self._refused = not self._claim_format()
        self._total_bytes = sum(page_file.size for page_file in self._scan(remove_stale_temps=True))
        if budget_bytes < page_format.page_num_bytes:
            logger.warning(
                "disk KV tier at %s: the budget (%d bytes) is smaller than one page (%d bytes); nothing will stay",
                self._root,
                budget_bytes,
                page_format.page_num_bytes,
            )
        self._writer = BackgroundWriter(
            name="disk-tier",
            write_pages=self._write_pages,
            on_failure=self._count_dropped,
            capacity=queue_size,
            max_batch_pages=write_batch_pages,
        )

    # ---- KVTier -----------------------------------------------------------------------------------------------

    @property
    def page_format(self) -> PageFormat:
        return self._page_format

    @property
    def available(self) -> bool:
        return not self._closed and not self._refused

    @property
    def refused(self) -> bool:
        """True if ``root`` holds another key format version: the tier is disabled for good."""
        return self._refused

    @property
    def total_bytes_estimate(self) -> int:
        """Bytes of page files under ``root`` as this tier believes (exact after a scan)."""
        with self._lock:
            return self._total_bytes

    def page_path(self, key: PageKey) -> str:
        """Where page ``key`` lives (whether or not it exists)."""
        key_hex = key.hex()
        return os.path.join(self._root, self._page_format.dtype, key_hex[:2], key_hex + PAGE_SUFFIX)

    def lookup(self, keys: Sequence[PageKey]) -> int:
        """One ``stat`` per key until the first missing file."""
        if not self.available:
            return 0
        count = 0
        for key in keys:
            if not os.path.exists(self.page_path(key)):
                break
            count += 1
        return count

    def load(self, keys: Sequence[PageKey], token_ids_per_page: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Read, verify and touch each page in order; stop at the first missing or rejected one."""
        check_load_args(self._page_format, keys, token_ids_per_page)
        if not self.available:
            return []
        start_time = time.perf_counter()
        loaded: list[torch.Tensor] = []
        try:
            for key, token_ids in zip(keys, token_ids_per_page):
                kv = self._load_one(key, token_ids)
                if kv is None:
                    break
                loaded.append(kv)
        finally:
            self._record_load(len(loaded), start_time)
        return loaded

    def close(self, timeout: float | None = 5.0) -> None:
        if self._closed:
            return
        self._writer.close(timeout)
        self._closed = True

    # ---- reading ------------------------------------------------------------------------------------------------

    def _load_one(self, key: PageKey, token_ids: Sequence[int]) -> torch.Tensor | None:
        path = self.page_path(key)
        try:
            kv = read_page_file(path, self._page_format, key, token_ids)
        except FileNotFoundError:
            return None
        except RejectedEntry as exc:
            self._discard(path, str(exc))
            return None
        except OSError as exc:
            self._count_error("read", f"reading {path} failed: {exc}")
            return None
        self._touch(path)
        return kv

    def _discard(self, path: str, reason: str) -> None:
        self._stats.add(discarded_corrupt=1)
        if self._throttle.should_warn("discard"):
            logger.warning("disk KV tier: discarding %s: %s", path, reason)
        size = file_size(path)
        if remove_quietly(path):
            self._adjust_total(-size)

    def _touch(self, path: str) -> None:
        """Mark ``path`` most recently used."""
        now_ns = self._next_mtime_ns()
        try:
            os.utime(path, ns=(now_ns, now_ns))
        except OSError:
            pass  # evicted by another process meanwhile: the caller already holds its bytes

    # ---- writing and eviction (writer thread) -------------------------------------------------------------------

    def _write_pages(self, pages: list[StoredPage]) -> None:
        start_time = time.perf_counter()
        num_stored = 0
        for page in pages:
            num_stored += self._write_one(page)
        self._stats.add(
            pages_stored=num_stored,
            bytes_stored=num_stored * self._page_format.page_num_bytes,
            pages_dropped=len(pages) - num_stored,
            store_seconds=time.perf_counter() - start_time,
        )
        self._evict_if_over_budget()

    def _write_one(self, page: StoredPage) -> bool:
        """Write one page unless it is already there (then only touch it); False if it could not be written."""
        path = self.page_path(page.key)
        if page.retention_priority > 0:
            with self._lock:
                self._path_to_retention[path] = (page.retention_priority, page.retain_until)
        if os.path.exists(path):
            self._touch(path)
            return True
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            size = write_page_file(path, page, mtime_ns=self._next_mtime_ns(), fsync=self._fsync)
        except OSError as exc:
            self._count_error("write", f"writing {path} failed: {exc}")
            return False
        self._adjust_total(size)
        return True

    def _evict_if_over_budget(self) -> None:
        if self.total_bytes_estimate <= self._budget_bytes:
            return
        now = time.time()
        with self._lock:
            retention = dict(self._path_to_retention)

        def rank(page_file: PageFile) -> int:
            priority, until = retention.get(page_file.path, (0, 0.0))
            return priority if until > now else 0

        page_files = sorted(self._scan(), key=lambda f: (rank(f), f.mtime_ns, f.path))
        total_bytes = sum(f.size for f in page_files)
        num_evicted = 0
        if total_bytes > self._budget_bytes:
            for page_file in page_files:
                if total_bytes <= self._evict_to_bytes:
                    break
                num_evicted += remove_quietly(page_file.path)
                total_bytes -= page_file.size
                retention.pop(page_file.path, None)
        with self._lock:
            self._total_bytes = total_bytes
            self._path_to_retention = {path: value for path, value in self._path_to_retention.items()
                                       if path in retention and value[1] > now}
        self._stats.add(pages_evicted=num_evicted)

    # ---- bookkeeping --------------------------------------------------------------------------------------------

    def _claim_format(self) -> bool:
        """Record this tier's key format version in ``root`` if none is there; False if another one is."""
        marker_path = os.path.join(self._root, FORMAT_MARKER_NAME)
        wanted = {"key_format_version": self._page_format.key_format_version}
        if not os.path.exists(marker_path):
            create_file_exclusively(marker_path, json.dumps(wanted).encode())
        try:
            with open(marker_path, "rb") as marker:
                found = json.loads(marker.read())
        except (OSError, ValueError) as exc:
            found = f"<unreadable: {exc}>"
        if found == wanted:
            return True
        logger.error(
            "disk KV tier at %s REFUSED: it holds page-key format %r, this replica uses %r. The tier is disabled. "
            "Use another --disk-cache-dir, or empty this one once no replica of the other version is running.",
            self._root,
            found,
            wanted,
        )
        return False

    def _scan(self, *, remove_stale_temps: bool = False) -> list[PageFile]:
        """Every page file under ``root`` (all dtypes); optionally delete temp files left by crashed writers."""
        page_files = []
        stale_before = time.time() - STALE_TEMP_AGE_S
        for folder, _, names in os.walk(self._root):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    stat = os.stat(path)
                except OSError:
                    continue  # deleted meanwhile
                if name.endswith(PAGE_SUFFIX) and not name.startswith("."):
                    page_files.append(PageFile(path, stat.st_size, stat.st_mtime_ns))
                elif remove_stale_temps and name.endswith(TEMP_SUFFIX) and stat.st_mtime < stale_before:
                    remove_quietly(path)
        return page_files

    def _next_mtime_ns(self) -> int:
        """Wall-clock nanoseconds, strictly increasing within this tier (so LRU order has no ties)."""
        with self._lock:
            self._last_mtime_ns = max(time.time_ns(), self._last_mtime_ns + 1)
            return self._last_mtime_ns

    def _adjust_total(self, delta: int) -> None:
        with self._lock:
            self._total_bytes = max(0, self._total_bytes + delta)

    def _count_error(self, kind: str, message: str) -> None:
        self._stats.add(errors=1)
        if self._throttle.should_warn(kind):
            logger.warning("disk KV tier: %s", message)


def file_size(path: str) -> int:
    """Size of ``path`` in bytes, 0 if it is gone."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def create_file_exclusively(path: str, content: bytes) -> bool:
    """Create ``path`` holding ``content`` unless it exists (atomic across processes); True if this call created it."""
    folder = os.path.dirname(path)
    fd, temp_path = tempfile.mkstemp(dir=folder, prefix=".marker.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as temp:
            temp.write(content)
        os.link(temp_path, path)
        return True
    except FileExistsError:
        return False
    finally:
        remove_quietly(temp_path)
