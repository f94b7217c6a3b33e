"""The shared KV tier interface: what a page looks like at rest, what must match to reuse it, and the tier contract.

A tier is a cache *behind* a replica's own page pool. The engine asks it only for pages its own prefix cache missed:

    keys        | k0 | k1 | k2 | k3 | k4 |        (page keys of the prompt, chain order)
    own cache   | hit| hit|miss|    |    |        -> ask the tier from k2 on
    tier.lookup(          [k2, k3, k4]) -> 2    (probably present: k2, k3; cheap, may be wrong)
    tier.load(            [k2, k3], tokens) -> [kv2]   (k3 turned out stale: discarded, load stops there)

Everything a tier returns has been verified (stored token ids == the request's, header == the tier's
``PageFormat``); nothing a tier does raises for a missing, corrupt or unreachable store. Writes are asynchronous
and lossy by design: a full queue or an unreachable store drops pages and counts them.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from common.page_format import PageFormat, dtype_name
from common.page_keys import KEY_FORMAT_VERSION, PageKey
from common.types import CacheSource, TierStats
from replica.tiers.seal import TierKey

@dataclass(frozen=True, eq=False)
class StoredPage:
    """One full page of KV as the tiers store it: key, the tokens it holds, the KV, and the header fields.

    ``kv`` is a CPU tensor of shape ``[num_layers, 2, page_size, num_kv_heads, head_dim]``. Build one with
    :meth:`from_format`. ``store()`` writes it later on another thread, so the caller must not modify ``kv``
    afterwards (tiers clone views of larger tensors, e.g. a slice of the page pool, for you).
    """

    key: PageKey
    token_ids: tuple[int, ...]
    kv: torch.Tensor
    model_fingerprint: str
    dtype: str
    page_size: int
    key_format_version: int = KEY_FORMAT_VERSION
    parent_key: PageKey | None = None
    """The key of the page before this one in its chain (None for page 0 or when unknown): the disk tier evicts a
    chain's tail before its parents."""
    retention_priority: int = 0
    """Retention priority of the page in the replica that computed it (0: plain LRU); tiers that honour it evict
    lower priorities first while ``retain_until`` has not passed."""
    retain_until: float = 0.0
    """Wall-clock time (``time.time()``) until which ``retention_priority`` holds (``math.inf``: pinned)."""
    salted: bool = False
    """Page 0 of a chain whose keys fold in a cache salt: only the tier's KV events carry it (``("salted",)``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or not self.key:
            raise ValueError(f"a page key must be non-empty bytes, got {type(self.key).__name__}")
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if len(self.token_ids) != self.page_size:
            raise ValueError(f"only full pages are stored: {len(self.token_ids)} tokens, page_size {self.page_size}")
        if self.kv.dim() != 5 or self.kv.shape[1] != 2 or self.kv.shape[2] != self.page_size:
            raise ValueError(
                f"kv must have shape [num_layers, 2, page_size={self.page_size}, num_kv_heads, head_dim], "
                f"got {list(self.kv.shape)}"
            )
        if dtype_name(self.kv.dtype) != self.dtype:
            raise ValueError(f"kv dtype {self.kv.dtype} does not match the header dtype {self.dtype!r}")

    @classmethod
    def from_format(
        cls, page_format: PageFormat, key: PageKey, token_ids: Sequence[int], kv: torch.Tensor,
        parent_key: PageKey | None = None,
        retention_priority: int = 0, retain_until: float = 0.0, salted: bool = False,
    ) -> "StoredPage":
        """A page with the header fields of ``page_format``."""
        return cls(
            retention_priority=retention_priority,
            retain_until=retain_until,
            salted=salted,
            key=key,
            parent_key=parent_key,
            token_ids=tuple(token_ids),
            kv=kv,
            model_fingerprint=page_format.model_fingerprint,
            dtype=page_format.dtype,
            page_size=page_format.page_size,
            key_format_version=page_format.key_format_version,
        )

    @property
    def page_format(self) -> PageFormat:
        """The format this page implies (compare with a tier's ``page_format``)."""
        num_layers, _, _, num_kv_heads, head_dim = self.kv.shape
        return PageFormat(
            model_fingerprint=self.model_fingerprint,
            dtype=self.dtype,
            page_size=self.page_size,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            key_format_version=self.key_format_version,
        )


@dataclass(frozen=True)
class RetentionUpdate:
    """A change of a stored page's retention, sent to the tiers after the page was stored (an admin pin or unpin, a
    request's retention given to pages already cached, a hit that restarts a retained page's TTL).

    ``priority`` > 0 with ``retain_until`` (wall clock, ``math.inf``: pinned) merges into the page's retention the
    way a store does (the stronger stays); ``priority`` 0 releases it (unpin): the page is plain LRU again. A tier
    applies it only to pages it holds; an update for a page it lacks changes nothing (a later store carries the
    retention itself)."""

    key: PageKey
    priority: int
    retain_until: float = 0.0

    @property
    def releases(self) -> bool:
        return self.priority <= 0


def retention_of(item: "StoredPage | RetentionUpdate", max_priority: int | None = None) -> tuple[int, float]:
    """``(priority, retain_until)`` of a stored page's or an update's retention, as the tiers keep them: priority a
    non-negative int (clamped to ``max_priority`` when given), ``retain_until`` a wall-clock time (``math.inf``:
    pinned). No priority, anything malformed, or a ``retain_until`` that is not a positive number (NaN included) is
    ``(0, 0.0)``."""
    try:
        raw = item.priority if isinstance(item, RetentionUpdate) else item.retention_priority
        priority = max(0, int(raw))
        if max_priority is not None:
            priority = min(priority, max_priority)
        until = float(item.retain_until)
    except (TypeError, ValueError, OverflowError):
        return 0, 0.0
    if priority == 0 or not until > 0.0:
        return 0, 0.0
    return priority, until


def wall_time() -> float:
    """``time.time()``, looked up at each call (the tiers' default wall clock)."""
    return time.time()


class StatsRecorder:
    """Thread-safe accumulator behind ``TierStats``; tiers call ``add`` from the caller's and the writer's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: f.default for f in fields(TierStats)}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> TierStats:
        with self._lock:
            return TierStats(**self._values)


class WarningThrottle:
    """Says whether a warning of a given kind may be logged now (at most once per ``interval_s`` per kind)."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self._interval_s = interval_s
        self._kind_to_last_time: dict[str, float] = {}
        self._lock = threading.Lock()

    def should_warn(self, kind: str) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._kind_to_last_time.get(kind)
            if last is not None and now - last < self._interval_s:
                return False
            self._kind_to_last_time[kind] = now
            return True


class KVTier(abc.ABC):
    """A shared store of KV pages addressed by page key (Redis host tier, Arrow disk tier).

    Contract, for every implementation:

    - ``lookup``, ``load``, ``store`` never raise because of the store's state (missing, corrupt, foreign or
      unreachable); they raise ``ValueError`` only for programming errors in their arguments.
    - ``lookup`` mutates nothing but counters. ``load`` deletes the entries it rejects and refreshes the recency of
      the ones it returns. ``store`` only enqueues; the background writer creates entries and (disk) evicts old ones.
    - Once ``close`` is called, ``lookup``/``load`` return misses and ``store`` drops.
    """

    source: CacheSource
    """``CacheSource.HOST`` (Redis) or ``CacheSource.DISK`` (Arrow files): where reused tokens came from."""

    @property
    def name(self) -> str:
        """The source's name ("host", "disk"), for metrics and logs."""
        return self.source.value

    @property
    @abc.abstractmethod
    def page_format(self) -> PageFormat:
        """The format of every page this tier reads and writes."""

    @property
    @abc.abstractmethod
    def available(self) -> bool:
        """False while the store is unreachable, after it was refused (other key format), or after ``close``."""

    @abc.abstractmethod
    def lookup(self, keys: Sequence[PageKey]) -> int:
        """How many LEADING ``keys`` are probably present. Cheap (one round trip / a few stats); may be wrong."""

    @abc.abstractmethod
    def load(self, keys: Sequence[PageKey], token_ids_per_page: Sequence[Sequence[int]],
             out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The KV of the leading pages that are present and verified, stopping at the first miss.

        ``token_ids_per_page[i]`` are the tokens page ``keys[i]`` must hold. Each returned tensor is owned by the
        caller (CPU, shape ``page_format.kv_shape``, dtype ``page_format.dtype``, bit-identical to what was
        stored). A corrupt, foreign or mismatching entry is deleted, counted in ``discarded_corrupt``, and ends the
        load. Raises ValueError if the two sequences differ in length or a page has not ``page_size`` tokens.
        ``out``: where to put page i's KV (``out[i]``, e.g. a page of the KV pool: no copy into the pool afterwards);
        the returned tensors are then ``out``'s leading ones. ``out[i]`` past the returned pages may hold garbage;
        nothing is written into ``out`` once ``load`` has returned or raised.
        """

    @abc.abstractmethod
    def store(self, pages: Sequence[StoredPage]) -> int:
        """Enqueue ``pages`` for the background writer; returns how many were accepted (the rest are dropped).

        Never blocks on the store. Raises ValueError if a page does not match ``page_format``.
        """

    def residency(self, keys: Sequence[PageKey]) -> tuple[int, int]:
        """(how many LEADING ``keys`` the tier holds now, how many of those hold a retention now), for the admin
        listing of retained prefixes. One round trip / one query; (0, 0) while the store is unreachable. A tier
        without retention reports none."""
        return self.lookup(keys), 0

    def update_retention(self, updates: Sequence[RetentionUpdate]) -> int:
        """Enqueue retention changes of stored pages (applied by the background writer, after the stores queued
        before them); returns how many were accepted. Never blocks. A tier without retention ignores them (0)."""
        return 0

    @abc.abstractmethod
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted page has been written or dropped; False if ``timeout`` passed first."""

    @abc.abstractmethod
    def close(self, timeout: float | None = 5.0) -> None:
        """Finish queued writes (up to ``timeout``), stop the writer and release connections. Idempotent."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of this tier's counters."""


def check_load_args(
    page_format: PageFormat, keys: Sequence[PageKey], token_ids_per_page: Sequence[Sequence[int]],
    out: Sequence[torch.Tensor] | None = None,
) -> None:
    """ValueError unless ``load`` got one full page of token ids per key (and, given ``out``, one CPU tensor of the
    page's shape and dtype per key)."""
    if len(keys) != len(token_ids_per_page):
        raise ValueError(f"load got {len(keys)} keys but {len(token_ids_per_page)} token-id pages")
    for token_ids in token_ids_per_page:
        if len(token_ids) != page_format.page_size:
            raise ValueError(f"each page holds {page_format.page_size} tokens, got {len(token_ids)}")
    if out is not None:
        if len(out) != len(keys):
            raise ValueError(f"load got {len(keys)} keys but {len(out)} tensors to load into")
        dtype = getattr(torch, page_format.dtype)
        for tensor in out:
            if tuple(tensor.shape) != page_format.kv_shape or tensor.dtype != dtype or tensor.device.type != "cpu":
                raise ValueError(f"load needs CPU {page_format.dtype} tensors of shape {page_format.kv_shape} to load "
                                 f"into, got {tensor.dtype} {list(tensor.shape)} on {tensor.device}")


def prepare_pages_for_store(page_format: PageFormat, pages: Sequence[StoredPage]) -> list[StoredPage]:
    """The pages made safe to write later: on CPU, contiguous, not views into a larger tensor (those are copied).

    Raises ValueError if a page's format differs from ``page_format``.
    """
    prepared = []
    for page in pages:
        if page.page_format != page_format:
            raise ValueError(f"page format {page.page_format} does not match the tier's {page_format}")
        kv = page.kv.detach()
        if kv.device.type != "cpu":
            kv = kv.to("cpu")
        elif not owns_storage(kv):
            kv = kv.clone(memory_format=torch.contiguous_format)
        if kv is not page.kv:
            page = dataclasses.replace(page, kv=kv)
        prepared.append(page)
    return prepared


def owns_storage(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is contiguous and spans its whole storage (so no other tensor's writes can change it)."""
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


class QueuedWriteTier(KVTier):
    """The bookkeeping both shared tiers share: stores go through a ``BackgroundWriter`` (``self._writer``), counters
    live in a ``StatsRecorder`` (``self._stats``), a tier that refused the store's format (``self._refused``) drops
    every page, and ``_record_load`` accounts one ``load`` call."""

    @property
    def page_format(self) -> PageFormat:
        return self._page_format

    @property
    def tier_key(self) -> TierKey:
        """The key that names and seals this tier's pages."""
        return self._tier_key

    def store(self, pages: Sequence[StoredPage]) -> int:
        prepared = prepare_pages_for_store(self._page_format, pages)
        if self._refused:
            self._count_dropped(prepared)
            return 0
        num_accepted = self._writer.submit(prepared)
        self._count_dropped(prepared[num_accepted:])
        return num_accepted

    def update_retention(self, updates: Sequence[RetentionUpdate]) -> int:
        if self._refused or not updates:
            return 0
        num_accepted = self._writer.submit(list(updates))
        if num_accepted < len(updates):
            self._stats.add(retention_updates_dropped=len(updates) - num_accepted)
        return num_accepted

    def flush(self, timeout: float | None = None) -> bool:
        return self._writer.flush(timeout)

    def stats(self) -> TierStats:
        return self._stats.snapshot()

    # ---- KV events for outside routers (replica/tiers/events.py); off unless ``enable_events`` was called --------------
    _events = None
    """The ``TierEventTracker`` publishing this tier's stores and removals, or None."""

    def enable_events(self, sink, *, resync_interval_s: float = 60.0) -> None:
        """Publish BlockStored / BlockRemoved for the pages this tier stores and loses to ``sink(medium, events)``."""
        raise NotImplementedError(f"{type(self).__name__} publishes no KV events")

    @property
    def event_tracker(self):
        return self._events

    def _write_items(self, items: list[StoredPage | RetentionUpdate]) -> None:
        """Writer thread: the pages of a batch, then its retention updates (both in submission order; an update
        queued after a store of the same page finds the page written)."""
        pages = [item for item in items if isinstance(item, StoredPage)]
        updates = [item for item in items if isinstance(item, RetentionUpdate)]
        if pages:
            self._write_pages(pages)
        if updates:
            self._apply_retention(updates)

    def _apply_retention(self, updates: list[RetentionUpdate]) -> None:
        """Writer thread: apply retention changes to the pages stored here (tiers that honour retention)."""

    def _note_written(self, pages: Sequence[StoredPage]) -> None:
        """Writer thread, after a batch: hand it to the event tracker (a deque append; nothing when events are off)."""
        if self._events is not None:
            self._events.on_written(pages)

    def _count_events(self, num_stored: int, num_removed: int) -> None:
        self._stats.add(events_stored=num_stored, events_removed=num_removed)

    def _close_events(self) -> None:
        if self._events is not None:
            self._events.close()

    def _count_dropped(self, items: Sequence[StoredPage | RetentionUpdate]) -> None:
        num_pages = sum(1 for item in items if isinstance(item, StoredPage))
        if num_pages:
            self._stats.add(pages_dropped=num_pages)
        if len(items) > num_pages:
            self._stats.add(retention_updates_dropped=len(items) - num_pages)

    def _record_load(self, num_loaded: int, start_time: float) -> None:
        self._stats.add(
            pages_loaded=num_loaded,
            bytes_loaded=num_loaded * self._page_format.page_num_bytes,
            load_seconds=time.perf_counter() - start_time,
        )
