"""The disk tier: one sealed Arrow IPC file per page under a folder shared by every replica (and process) on a machine.

Layout (folders 0700, files 0600; only this user's processes read or write the tier)::

    root/FORMAT.json                        {"key_format_version": 1}: claimed by the first tier to open root
    root/index.sqlite                       which pages exist: id, parent id, size, last use, retention priority
                                            and its end (see ``PageIndex``; schema ``INDEX_VERSION``)
    root/{dtype}/{id[:2]}/{id}.arrow        one page (see ``arrow_file``); id = keyed storage id (see ``seal``)
    root/{dtype}/{id[:2]}/.{name}.*.tmp     a write in progress (renamed into place inside an index transaction)

One budget for everyone sharing root: every process takes the index's write lock (SQLite ``BEGIN IMMEDIATE``, a file
lock) to add pages, and inside that one transaction sums the sizes of the indexed pages, evicts until the new pages
fit, renames them into place and indexes them. So the page files in root never exceed ``budget_bytes`` of the
process that wrote last, whatever the number of writers (only the temporary files of writes in progress, at most one
write batch per process, are outside the count).

Eviction order: chain tails first. Only *leaves* are candidates (pages no indexed page names as its parent); a
parent becomes a candidate once its last child is gone. So a page still reachable from its chain's page 0 is never
left without its parent (the pages a load can no longer reach are not kept while reachable ones are deleted). Among
the leaves, the lowest *effective priority* goes first (a page's ``StoredPage.retention_priority`` while its
``retain_until`` has not passed, else 0), then the least recently used. So a retained page is evicted only after every
leaf of lower effective priority, and once its retention ends it is plain LRU again; retention never exempts a page
from the budget, and a retained page keeps its (plain) parents while it stays. A store of a page already indexed
marks it used and merges the new retention into its row (the stronger stays: a higher priority replaces an active
lower one, the same priority keeps the later end, an expired one is replaced); a load only marks its pages used; a
retention change of a page already stored (``update_retention``: an admin pin or unpin, a request's retention given
to cached pages) merges into its row the same way, or (unpin) sets it back to plain, without changing its recency. A
load touches its pages in chain order (parents older than children), and the parents of pages being written are never
evicted by that write.

Reads: only regular files are read (``arrow_file.read_file_safely``), and a load gives up at ``load_timeout_s``.
Anything else under a page's name (a symlink, FIFO, device, a corrupt or tampered file) is deleted and counted in
``discarded_corrupt``; a file and index row without each other (a crash between the two) are dropped at start-up.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import os
import sqlite3
import stat
import tempfile
import threading
import time
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from common.page_format import PageFormat
from common.page_keys import PageKey
from common.types import CacheSource
from replica.tiers.arrow_file import TEMP_SUFFIX, read_page_file, remove_quietly, write_page_file
from replica.tiers.base import (
    QueuedWriteTier,
    RetentionUpdate,
    StatsRecorder,
    StoredPage,
    WarningThrottle,
    check_load_args,
    retention_of,
    wall_time,
)
from replica.tiers.codec import LOAD_WORKERS, RejectedEntry, load_pool, new_page_tensors
from replica.tiers.seal import TierKey
from replica.tiers.writer import BackgroundWriter

logger = logging.getLogger(__name__)

FORMAT_MARKER_NAME = "FORMAT.json"
INDEX_NAME = "index.sqlite"
PAGE_SUFFIX = ".arrow"
STALE_TEMP_AGE_S = 3600.0
"""Temporary files older than this are leftovers of a crashed writer and are deleted at start-up."""
FOLDER_MODE = 0o700
TOUCH_WAIT_MS = 100
"""How long a load waits for the index's write lock to mark its pages recently used before it skips that."""
EVICTION_BATCH = 32
"""Leaves deleted per eviction query (then the leaves are listed again: a parent may have become one)."""


INDEX_VERSION = 2
"""The index's schema (SQLite ``user_version``). 1: ``pages(id, parent, size, last_used)``; 2: adds ``priority`` and
``retain_until``. An index of an older version is migrated in place (the new columns default to plain LRU, which
version 1 code still writes correctly); one of a newer version refuses the tier; a file that is not a SQLite database
is recreated (start-up then deletes the page files no row names)."""
REMOVAL_LOG_ROWS = 65536
"""Rows the index's removal log keeps (``PageIndex.CREATE_REMOVAL_LOG``); a reader further behind checks everything."""
MAX_PRIORITY = 1 << 31
"""Retention priorities are clamped into ``[0, MAX_PRIORITY]`` before they reach the index."""
_RESIDENCY_MAX_KEYS = 4096
"""Keys one ``residency`` query asks about (SQLite binds at most 32766 variables; a prefix of 4096 pages is 512k
tokens at page size 128)."""
TIMED_OUT = object()
"""What a page's read answers once the load has passed its time limit (the pages before it are still used)."""


class IndexVersionError(RuntimeError):
    """The index was written by a newer version of this tier (its schema is unknown here)."""


@dataclass(frozen=True)
class IndexedPage:
    page_id: str
    size: int
    last_used: int
    parent: str | None
    rank: int
    """The page's effective retention priority when it was read: ``priority`` while ``retain_until`` has not
    passed, else 0."""


class PageIndex:
    """The SQLite index every process sharing root uses: ``pages(id, parent, size, last_used, priority,
    retain_until)`` (schema ``INDEX_VERSION``).

    Thread-safe (one connection behind a lock). ``write()`` is a ``BEGIN IMMEDIATE`` transaction: it holds the
    database's write lock, across processes, until it commits. Raises ``IndexVersionError`` if the file holds a newer
    schema, ``sqlite3.Error`` if it cannot be opened.
    """

    COLUMNS = "id, size, last_used, parent"
    RANK = "CASE WHEN retain_until > ? THEN priority ELSE 0 END"
    """The effective priority of a row at the time bound to ``?``."""
    MERGE_RETENTION = (
        "UPDATE pages SET last_used = :used, "
        "priority = CASE WHEN retain_until <= :now OR :priority > priority THEN :priority ELSE priority END, "
        "retain_until = CASE WHEN retain_until <= :now OR :priority > priority THEN :until "
        "WHEN :priority = priority THEN MAX(retain_until, :until) ELSE retain_until END "
        "WHERE id = :id")
    """Mark a page used and merge a retention into its row: the stronger one stays (a higher priority replaces an
    active lower one, the same priority keeps the later deadline, an expired one is replaced)."""
    MERGE_RETENTION_ONLY = MERGE_RETENTION.replace("last_used = :used, ", "")
    """The same merge for a retention update (a pin, a request's retention of pages stored before): recency unchanged."""
    RELEASE_RETENTION = "UPDATE pages SET priority = 0, retain_until = 0 WHERE id = :id AND priority != 0"
    """An unpin: the page is plain LRU again (its recency unchanged)."""

    def __init__(self, path: str, busy_timeout_s: float = 10.0) -> None:
        self._busy_timeout_ms = int(busy_timeout_s * 1000)
        self._lock = threading.Lock()
        try:
            self._conn = self._open(path, busy_timeout_s)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):  # locked, unreadable, ...: not the file's content
                raise
            logger.warning("disk KV tier: %s is not a usable index (%s); recreating it", path, exc)
            for suffix in ("", "-wal", "-shm", "-journal"):
                remove_quietly(path + suffix)
            self._conn = self._open(path, busy_timeout_s)

    def _open(self, path: str, busy_timeout_s: float) -> sqlite3.Connection:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        self._conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")  # readers never wait for a writer
            self._conn.execute("PRAGMA synchronous=OFF")  # a cache: after a crash, start-up reconciles with the files
            with self.write() as cursor:
                version = cursor.execute("PRAGMA user_version").fetchone()[0]
                if version > INDEX_VERSION:
                    raise IndexVersionError(f"{path} has index schema version {version}; this tier knows "
                                            f"{INDEX_VERSION} and older")
                cursor.execute("CREATE TABLE IF NOT EXISTS pages (id TEXT PRIMARY KEY, parent TEXT, "
                               "size INTEGER NOT NULL, last_used INTEGER NOT NULL, "
                               "priority INTEGER NOT NULL DEFAULT 0, retain_until REAL NOT NULL DEFAULT 0) "
                               "WITHOUT ROWID")
                columns = {row[1] for row in cursor.execute("PRAGMA table_info(pages)")}
                if "priority" not in columns:  # version 1: plain LRU rows
                    cursor.execute("ALTER TABLE pages ADD COLUMN priority INTEGER NOT NULL DEFAULT 0")
                if "retain_until" not in columns:
                    cursor.execute("ALTER TABLE pages ADD COLUMN retain_until REAL NOT NULL DEFAULT 0")
                cursor.execute(self.CREATE_REMOVAL_LOG)
                cursor.execute("CREATE INDEX IF NOT EXISTS pages_by_parent ON pages(parent)")
                cursor.execute("CREATE INDEX IF NOT EXISTS pages_by_last_used ON pages(last_used)")
                if version != INDEX_VERSION:
                    cursor.execute(f"PRAGMA user_version = {INDEX_VERSION}")
        except BaseException:
            self._conn.close()
            raise
        return self._conn

    @contextlib.contextmanager
    def write(self, busy_timeout_ms: int | None = None) -> Iterator[sqlite3.Cursor]:
        """One write transaction (exclusive across processes); rolled back if the block raises. Waits up to
        ``busy_timeout_ms`` (default: the index's) for another process's transaction, then raises
        ``sqlite3.OperationalError``."""
        with self._lock:
            cursor = self._conn.cursor()
            if busy_timeout_ms is not None:
                cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            try:
                cursor.execute("BEGIN IMMEDIATE")
            finally:
                if busy_timeout_ms is not None:
                    cursor.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
            try:
                yield cursor
                cursor.execute("COMMIT")
            except BaseException:
                self._roll_back(cursor)
                raise

    def _roll_back(self, cursor: sqlite3.Cursor) -> None:
        """End a failed transaction, so the next ``BEGIN`` can start; the caller raises the error that failed it."""
        if not self._conn.in_transaction:  # SQLite rolls back itself on some errors (I/O, corruption, full disk)
            return
        try:
            cursor.execute("ROLLBACK")
        except sqlite3.Error as exc:
            logger.warning("disk KV tier: rolling back the index failed too: %s", exc)

    # ---- the removal log (KV events for outside routers: replica/tiers/events.py) -------------------------------------
    CREATE_REMOVAL_LOG = "CREATE TABLE IF NOT EXISTS removed (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL)"
    """Every page deleted from ``pages`` (evicted, discarded, reconciled away), logged in the deleting transaction,
    so every process sharing root can tell which of the pages it announced are gone. The newest ``REMOVAL_LOG_ROWS``
    are kept. Added without a schema version bump: older code neither reads nor writes it (while an older process
    shares root, its deletions are missing here; readers still catch them at their periodic full check)."""

    @staticmethod
    def delete_page(cursor: sqlite3.Cursor, page_id: str) -> None:
        """Delete ``page_id``'s row and log the removal (inside a ``write()`` transaction)."""
        if cursor.execute("DELETE FROM pages WHERE id = ?", (page_id,)).rowcount:
            cursor.execute("INSERT INTO removed (id) VALUES (?)", (page_id,))

    @staticmethod
    def trim_removal_log(cursor: sqlite3.Cursor) -> None:
        cursor.execute("DELETE FROM removed WHERE seq <= (SELECT MAX(seq) FROM removed) - ?", (REMOVAL_LOG_ROWS,))

    def last_removal_seq(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM removed").fetchone()[0]

    def removals_after(self, seq: int, limit: int = 8192) -> list[tuple[int, str]]:
        """``(seq, page id)`` of the logged removals after ``seq``, oldest first."""
        with self._lock:
            return self._conn.execute("SELECT seq, id FROM removed WHERE seq > ? ORDER BY seq LIMIT ?",
                                      (seq, limit)).fetchall()

    def existing(self, page_ids: Sequence[str]) -> set[str]:
        """Which of ``page_ids`` are indexed now."""
        if not page_ids:
            return set()
        marks = ",".join("?" * len(page_ids))
        with self._lock:
            return {row[0] for row in self._conn.execute(f"SELECT id FROM pages WHERE id IN ({marks})",
                                                         tuple(page_ids))}

    def total_bytes(self, cursor: sqlite3.Cursor | None = None) -> int:
        if cursor is not None:
            return cursor.execute("SELECT COALESCE(SUM(size), 0) FROM pages").fetchone()[0]
        with self._lock:
            return self._conn.execute("SELECT COALESCE(SUM(size), 0) FROM pages").fetchone()[0]

    def retention_rows(self, page_ids: Sequence[str], now: float) -> dict[str, int]:
        """Page id -> its effective retention priority at ``now`` (0: plain), for the ids that are indexed."""
        marks = ",".join("?" * len(page_ids))
        with self._lock:
            return dict(self._conn.execute(f"SELECT id, {self.RANK} FROM pages WHERE id IN ({marks})",
                                           (now, *page_ids)).fetchall())

    def page_ids(self) -> set[str]:
        with self._lock:
            return {row[0] for row in self._conn.execute("SELECT id FROM pages")}

    @staticmethod
    def leaves(cursor: sqlite3.Cursor, protected: Sequence[str], limit: int, now: float) -> list[IndexedPage]:
        """The first ``limit`` pages that no page names as its parent (chain tails), skipping ``protected``, in
        eviction order: lowest effective priority at ``now`` first, then least recently used.

        Plain leaves (rank 0, the lowest) are listed first along the ``last_used`` index; only if there are fewer
        than ``limit`` of them are all leaves ranked and sorted."""
        marks = ",".join("?" * len(protected)) or "''"
        is_leaf = (f"id NOT IN ({marks}) AND NOT EXISTS (SELECT 1 FROM pages AS c WHERE c.parent = p.id)")
        rows = cursor.execute(
            f"SELECT {PageIndex.COLUMNS}, 0 FROM pages AS p WHERE (priority = 0 OR retain_until <= ?) AND {is_leaf} "
            f"ORDER BY last_used, id LIMIT ?",
            (now, *protected, limit),
        ).fetchall()
        if len(rows) < limit:
            rows = cursor.execute(
                f"SELECT {PageIndex.COLUMNS}, {PageIndex.RANK} AS rank FROM pages AS p WHERE {is_leaf} "
                f"ORDER BY rank, last_used, id LIMIT ?",
                (now, *protected, limit),
            ).fetchall()
        return [IndexedPage(*row) for row in rows]

    @staticmethod
    def if_leaf(cursor: sqlite3.Cursor, page_id: str | None, protected: Sequence[str],
                now: float) -> IndexedPage | None:
        """Page ``page_id`` (ranked at ``now``) if it exists, is not ``protected`` and has no children left."""
        if page_id is None or page_id in protected:
            return None
        row = cursor.execute(
            f"SELECT {PageIndex.COLUMNS}, {PageIndex.RANK} FROM pages AS p WHERE id = ? AND NOT EXISTS "
            "(SELECT 1 FROM pages AS c WHERE c.parent = p.id)", (now, page_id)).fetchone()
        return IndexedPage(*row) if row else None

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class DiskTier(QueuedWriteTier):
    """Shared disk KV tier of sealed Arrow IPC files (see the module docstring for layout, budget and eviction order).

    Mutates: files under ``root_dir`` only (pages it writes, rejects or evicts; the index; the format marker; stale
    temp files). Raises: OSError from the constructor if ``root_dir`` cannot be created, ValueError for bad arguments;
    nothing afterwards because of the files' state (I/O errors are counted in ``errors`` and answered with misses).

    ``tier_key`` seals and names the pages; every process sharing root must use the same key to share pages (one
    built without a key generates its own: private to this instance).
    """

    source = CacheSource.DISK

    def __init__(
        self,
        root_dir: str | os.PathLike,
        page_format: PageFormat,
        budget_bytes: int,
        *,
        tier_key: TierKey | None = None,
        queue_size: int = 256,
        fsync: bool = False,
        evict_to_fraction: float = 0.9,
        write_batch_pages: int = 16,
        load_timeout_s: float = 2.0,
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        if budget_bytes < 1:
            raise ValueError(f"the disk tier budget must be positive, got {budget_bytes} bytes")
        if not 0.0 <= evict_to_fraction <= 1.0:
            raise ValueError(f"evict_to_fraction must be within [0, 1], got {evict_to_fraction}")
        if load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s must be positive, got {load_timeout_s}")
        self._root = os.fspath(root_dir)
        self._page_format = page_format
        self._tier_key = tier_key or TierKey.generate()
        self._budget_bytes = budget_bytes
        self._evict_to_bytes = int(budget_bytes * evict_to_fraction)
        self._fsync = fsync
        self._load_timeout_s = load_timeout_s
        self._wall_clock = wall_clock or wall_time
        self._stats = StatsRecorder()
        self._throttle = WarningThrottle()
        self._clock_lock = threading.Lock()
        self._last_use_ns = 0
        self._closed = False
        self._index: PageIndex | None = None
        self._refused = not self._prepare_root() or not self._claim_format()
        if not self._refused:
            try:
                self._index = PageIndex(os.path.join(self._root, INDEX_NAME))
            except IndexVersionError as exc:
                logger.error("disk KV tier at %s REFUSED: %s. The tier is disabled. Use another --disk-cache-dir, or "
                             "empty this one once no replica of the newer version is running.", self._root, exc)
                self._refused = True
        if not self._refused:
            self._reconcile()
        if budget_bytes < page_format.page_num_bytes:
            logger.warning(
                "disk KV tier at %s: the budget (%d bytes) is smaller than one page (%d bytes); nothing will stay",
                self._root,
                budget_bytes,
                page_format.page_num_bytes,
            )
        self._writer = BackgroundWriter(
            name="disk-tier",
            write_pages=self._write_items,
            on_failure=self._count_dropped,
            capacity=queue_size,
            max_batch_pages=write_batch_pages,
        )

    # ---- KVTier -----------------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return not self._closed and not self._refused

    @property
    def refused(self) -> bool:
        """True if ``root`` is unusable (another key format version, an index of a newer schema, or a folder
        another user owns)."""
        return self._refused

    @property
    def total_bytes_estimate(self) -> int:
        """Bytes of the indexed page files under ``root`` (every process's; exact)."""
        return self._index.total_bytes() if self._index is not None else 0

    def page_id(self, key: PageKey) -> str:
        """The index id of page ``key``: dtype / keyed storage id."""
        return f"{self._page_format.dtype}/{self._tier_key.storage_id(key)}"

    def page_path(self, key: PageKey) -> str:
        """Where page ``key`` lives (whether or not it exists)."""
        return self._path_of(self.page_id(key))

    def lookup(self, keys: Sequence[PageKey]) -> int:
        """One ``stat`` per key until the first missing file."""
        if not self.available:
            return 0
        count = 0
        for key in keys:
            if not os.path.lexists(self.page_path(key)):
                break
            count += 1
        return count

    def residency(self, keys: Sequence[PageKey]) -> tuple[int, int]:
        """The index's rows of the keys, in one query: leading pages indexed, and those whose retention holds now."""
        if not self.available or self._index is None or not keys:
            return 0, 0
        page_ids = [self.page_id(key) for key in keys[:_RESIDENCY_MAX_KEYS]]
        try:
            rows = self._index.retention_rows(page_ids, self._wall_clock())
        except sqlite3.Error as exc:
            self._count_error("index", f"reading the index failed: {exc}")
            return 0, 0
        num_present = num_retained = 0
        for page_id in page_ids:
            rank = rows.get(page_id)
            if rank is None:
                break
            num_present += 1
            num_retained += rank > 0
        return num_present, num_retained

    def load(self, keys: Sequence[PageKey], token_ids_per_page: Sequence[Sequence[int]],
             out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Read, verify and touch each page in order; stop at the first missing or rejected one, or at the timeout."""
        check_load_args(self._page_format, keys, token_ids_per_page, out)
        if not self.available:
            return []
        start_time = time.perf_counter()
        deadline = start_time + self._load_timeout_s
        loaded: list[torch.Tensor] = []
        pages = new_page_tensors(self._page_format, len(keys)) if out is None else out  # decrypted straight into these
        results: list[object] = [None] * len(keys)
        end = [len(keys)]  # the first page known missing, rejected or timed out: no worker starts a page past it
        end_lock = threading.Lock()
        num_workers = min(LOAD_WORKERS, len(keys))

        def load_share(first: int) -> None:
            """Pages first, first + num_workers, ... in order (each worker's share of the leading run)."""
            for index in range(first, len(keys), num_workers):
                if index >= end[0]:
                    return
                kv = (TIMED_OUT if time.perf_counter() > deadline else
                      self._load_one(keys[index], token_ids_per_page[index], pages[index]))
                results[index] = kv
                if kv is None or kv is TIMED_OUT:
                    with end_lock:
                        end[0] = min(end[0], index)
                    return

        # the pages are read and decrypted side by side (codec.load_pool), one task per worker rather than per page:
        # the per-page Python holds the GIL, and 16 hand-offs through the pool cost more than the second thread gave
        futures = []
        try:
            for first in range(num_workers):
                futures.append(load_pool().submit(load_share, first))
            for future in futures:
                future.result()
            for kv in results:
                if kv is TIMED_OUT:
                    self._count_error("timeout", f"a load passed its {self._load_timeout_s} s limit; "
                                                 f"{len(loaded)} of {len(keys)} pages read")
                if kv is None or kv is TIMED_OUT:
                    break
                loaded.append(kv)
            self._touch([self.page_id(key) for key in keys[: len(loaded)]])
        finally:
            with end_lock:
                end[0] = 0  # a worker still running (an exception above) stops at its next page
            wait(futures)  # and has stopped writing into ``pages`` before this returns (``out`` may be the pool's)
            self._record_load(len(loaded), start_time)
        return loaded

    def close(self, timeout: float | None = 5.0) -> None:
        if self._closed:
            return
        self._writer.close(timeout)
        self._close_events()
        self._closed = True
        if self._index is not None:
            self._index.close()

    def enable_events(self, sink, *, resync_interval_s: float = 60.0) -> None:
        """Publish KV events (medium "DISK") for the pages this tier stores, and their removal by any process sharing
        root (the index's removal log, see ``replica.tiers.events.DiskRemovalSource``)."""
        from common.events import MEDIUM_DISK
        from replica.tiers.events import DiskRemovalSource, TierEventTracker

        if self._events is None and self._index is not None:
            self._events = TierEventTracker(MEDIUM_DISK, DiskRemovalSource(self._index), sink, self.page_id,
                                            resync_interval_s=resync_interval_s, on_published=self._count_events)

    # ---- reading ------------------------------------------------------------------------------------------------

    def _load_one(self, key: PageKey, token_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor | None:
        page_id = self.page_id(key)
        path = self._path_of(page_id)
        try:
            return read_page_file(path, self._page_format, self._tier_key, key, token_ids, out)
        except FileNotFoundError:
            return None
        except RejectedEntry as exc:
            self._discard(page_id, str(exc))
            return None
        except OSError as exc:
            self._count_error("read", f"reading {path} failed: {exc}")
            return None

    def _discard(self, page_id: str, reason: str) -> None:
        """Delete a rejected entry and its index row (whatever it is: a bad file, a symlink, a FIFO, a device)."""
        path = self._path_of(page_id)
        self._stats.add(discarded_corrupt=1)
        if self._throttle.should_warn("discard"):
            logger.warning("disk KV tier: discarding %s: %s", path, reason)
        try:
            with self._index.write() as cursor:
                PageIndex.delete_page(cursor, page_id)
                remove_quietly(path)
        except IsADirectoryError:
            self._count_error("discard", f"{path} is a folder; remove it by hand")
        except (OSError, sqlite3.Error) as exc:
            self._count_error("discard", f"discarding {path} failed: {exc}")

    def _touch(self, page_ids: Sequence[str]) -> None:
        """Mark pages most recently used, in order (so a chain's parents stay older than its children)."""
        if not page_ids:
            return
        try:  # a reader never waits long for a writer's eviction: the recency update is only a hint
            with self._index.write(busy_timeout_ms=TOUCH_WAIT_MS) as cursor:
                cursor.executemany("UPDATE pages SET last_used = ? WHERE id = ?",
                                   [(self._next_use_ns(), page_id) for page_id in page_ids])
        except sqlite3.OperationalError:
            pass  # locked by another process: skip it (the pages stay a little older)
        except sqlite3.Error as exc:
            self._count_error("index", f"updating the index failed: {exc}")

    # ---- writing and eviction (writer thread) -------------------------------------------------------------------

    def _write_pages(self, pages: list[StoredPage]) -> None:
        start_time = time.perf_counter()
        touched: list[tuple[StoredPage, str]] = []  # already there: page, id
        written: list[tuple[StoredPage, str, str, int]] = []  # page, id, temp path, size
        for page in pages:
            page_id = self.page_id(page.key)
            path = self._path_of(page_id)
            if os.path.lexists(path):
                touched.append((page, page_id))
                continue
            try:
                self._make_folder(os.path.dirname(path))
                size, temp_path = write_page_file(path, page, self._tier_key, fsync=self._fsync, keep_temp=True)
            except OSError as exc:
                self._count_error("write", f"writing {path} failed: {exc}")
                continue
            written.append((page, page_id, temp_path, size))
        num_stored, num_evicted = len(touched), 0
        try:
            with self._index.write() as cursor:
                for page, page_id in touched:
                    self._merge_retention(cursor, page, page_id)
                protected = sorted({self.page_id(page.parent_key) for page, *_ in written if page.parent_key}
                                   | {page_id for _, page_id, _, _ in written})
                total = self._index.total_bytes(cursor)
                needed = sum(size for *_, size in written)
                if total + needed > self._budget_bytes:
                    total, num_evicted = self._evict(cursor, total, max(0, self._evict_to_bytes - needed), protected)
                for page, page_id, temp_path, size in written:
                    if os.path.lexists(self._path_of(page_id)):  # another process wrote it meanwhile
                        remove_quietly(temp_path)
                        self._merge_retention(cursor, page, page_id)
                        num_stored += 1
                        continue
                    if total + size > self._budget_bytes:  # does not fit even after eviction: dropped
                        remove_quietly(temp_path)
                        continue
                    os.replace(temp_path, self._path_of(page_id))
                    parent_id = self.page_id(page.parent_key) if page.parent_key else None
                    cursor.execute("INSERT OR REPLACE INTO pages (id, parent, size, last_used, priority, retain_until) "
                                   "VALUES (?, ?, ?, ?, ?, ?)",
                                   (page_id, parent_id, size, self._next_use_ns(), *retention_of(page, MAX_PRIORITY)))
                    total += size
                    num_stored += 1
        except (OSError, sqlite3.Error) as exc:
            self._count_error("index", f"adding pages to the index failed: {exc}")
        finally:
            for _, _, temp_path, _ in written:
                remove_quietly(temp_path)  # renamed ones are gone already
        self._stats.add(
            pages_stored=num_stored,
            bytes_stored=num_stored * self._page_format.page_num_bytes,
            pages_dropped=len(pages) - num_stored,
            pages_evicted=num_evicted,
            store_seconds=time.perf_counter() - start_time,
        )
        self._note_written(pages)

    def _merge_retention(self, cursor: sqlite3.Cursor, page: StoredPage, page_id: str) -> None:
        """Mark an indexed page most recently used and merge ``page``'s retention into its row (see
        ``PageIndex.MERGE_RETENTION``)."""
        priority, until = retention_of(page, MAX_PRIORITY)
        cursor.execute(PageIndex.MERGE_RETENTION, {"used": self._next_use_ns(), "now": self._wall_clock(),
                                                   "priority": priority, "until": until, "id": page_id})

    def _apply_retention(self, updates: list[RetentionUpdate]) -> None:
        """Writer thread: merge retentions into (or release them from) the rows of indexed pages, in one transaction;
        recency is unchanged and pages not indexed are skipped."""
        if self._index is None:
            return
        now = self._wall_clock()
        num_applied = 0
        try:
            with self._index.write() as cursor:
                for update in updates:
                    page_id = self.page_id(update.key)
                    if update.releases:
                        num_applied += cursor.execute(PageIndex.RELEASE_RETENTION, {"id": page_id}).rowcount
                        continue
                    priority, until = retention_of(update, MAX_PRIORITY)
                    if priority:
                        num_applied += cursor.execute(PageIndex.MERGE_RETENTION_ONLY, {
                            "now": now, "priority": priority, "until": until, "id": page_id}).rowcount
        except sqlite3.Error as exc:
            self._stats.add(retention_updates_dropped=len(updates))
            self._count_error("index", f"updating retention in the index failed: {exc}")
            return
        self._stats.add(retention_updates=num_applied)

    def _evict(self, cursor: sqlite3.Cursor, total: int, target: int, protected: Sequence[str]) -> tuple[int, int]:
        """Delete chain tails, lowest effective retention priority first and least recently used among equals,
        until ``total <= target`` (inside the write transaction); returns the new total and the number of pages
        deleted.

        Strict (rank, LRU) order over the current leaves: the first ``EVICTION_BATCH`` leaves in that order go into
        a heap; deleting one may turn its parent into a leaf, which joins the heap. Leaves not fetched come after
        every fetched one, so the heap is right until the fetched batch is used up; then the leaves are listed
        again. Ranks are taken at one ``now`` for the whole eviction."""
        num_evicted = 0
        now = self._wall_clock()
        while total > target:
            batch = PageIndex.leaves(cursor, protected, EVICTION_BATCH, now)
            if not batch:
                break
            heap = [(leaf.rank, leaf.last_used, leaf.page_id, leaf.size, leaf.parent) for leaf in batch]
            heapq.heapify(heap)
            num_fetched_left = len(batch)
            fetched = {leaf.page_id for leaf in batch}
            while heap and num_fetched_left and total > target:
                _, _, page_id, size, parent = heapq.heappop(heap)
                num_fetched_left -= page_id in fetched
                PageIndex.delete_page(cursor, page_id)
                remove_quietly(self._path_of(page_id))
                total -= size
                num_evicted += 1
                promoted = PageIndex.if_leaf(cursor, parent, protected, now)
                if promoted is not None:
                    heapq.heappush(heap, (promoted.rank, promoted.last_used, promoted.page_id, promoted.size,
                                          promoted.parent))
        if num_evicted:
            PageIndex.trim_removal_log(cursor)
        return total, num_evicted

    # ---- bookkeeping --------------------------------------------------------------------------------------------

    def _path_of(self, page_id: str) -> str:
        dtype, storage_id = page_id.split("/", 1)
        return os.path.join(self._root, dtype, storage_id[:2], storage_id + PAGE_SUFFIX)

    def _make_folder(self, folder: str) -> None:
        """Create ``folder`` and its parents under root, each with mode 0700 (``os.makedirs`` gives parents the
        default mode)."""
        relative = os.path.relpath(folder, self._root)
        path = self._root
        for part in relative.split(os.sep):
            path = os.path.join(path, part)
            try:
                os.mkdir(path, FOLDER_MODE)
            except FileExistsError:
                pass

    def _prepare_root(self) -> bool:
        """Create root 0700, or check an existing one: owned by this user (else refused), tightened to 0700."""
        os.makedirs(self._root, mode=FOLDER_MODE, exist_ok=True)
        info = os.stat(self._root)
        if info.st_uid != os.getuid():
            logger.error("disk KV tier at %s REFUSED: the folder belongs to uid %d, not to this user (%d); other "
                         "users could read or plant pages. Use a folder of your own (--disk-cache-dir).",
                         self._root, info.st_uid, os.getuid())
            return False
        if stat.S_IMODE(info.st_mode) & 0o077:
            logger.warning("disk KV tier at %s: the folder was mode %o; setting it to 0700",
                           self._root, stat.S_IMODE(info.st_mode))
            os.chmod(self._root, FOLDER_MODE)
        return True

    def _claim_format(self) -> bool:
        """Record this tier's key format version in ``root`` if none is there; False if another one is."""
        marker_path = os.path.join(self._root, FORMAT_MARKER_NAME)
        wanted = {"key_format_version": self._page_format.key_format_version}
        if not os.path.exists(marker_path):
            create_file_exclusively(marker_path, json.dumps(wanted).encode())
        try:
            with open(marker_path, "rb") as marker:
                found = json.loads(marker.read(4096))
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

    def _reconcile(self) -> None:
        """Make the index and the files agree (a crash may leave one without the other); drop stale temp files.
        Runs under the index's write lock, so no other process adds pages meanwhile."""
        stale_before = time.time() - STALE_TEMP_AGE_S
        with self._index.write() as cursor:
            indexed = {row[0] for row in cursor.execute("SELECT id FROM pages")}
            on_disk = set()
            for folder, _, names in os.walk(self._root):
                for name in names:
                    path = os.path.join(folder, name)
                    try:
                        info = os.lstat(path)
                    except OSError:
                        continue
                    if name.endswith(PAGE_SUFFIX) and not name.startswith("."):
                        page_id = os.path.relpath(path, self._root)
                        parts = page_id.split(os.sep)
                        page_id = f"{parts[0]}/{name[: -len(PAGE_SUFFIX)]}" if len(parts) == 3 else ""
                        if page_id in indexed and stat.S_ISREG(info.st_mode):
                            on_disk.add(page_id)
                        else:
                            remove_quietly(path)  # written by a crashed process, or not a regular file
                    elif name.endswith(TEMP_SUFFIX) and info.st_mtime < stale_before:
                        remove_quietly(path)
            missing = indexed - on_disk
            for page_id in missing:
                PageIndex.delete_page(cursor, page_id)
            PageIndex.trim_removal_log(cursor)

    def _next_use_ns(self) -> int:
        """Wall-clock nanoseconds, strictly increasing within this tier (so LRU order has no ties)."""
        with self._clock_lock:
            self._last_use_ns = max(time.time_ns(), self._last_use_ns + 1)
            return self._last_use_ns

    def _count_error(self, kind: str, message: str) -> None:
        self._stats.add(errors=1)
        if self._throttle.should_warn(kind):
            logger.warning("disk KV tier: %s", message)


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
