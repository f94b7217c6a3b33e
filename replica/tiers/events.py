"""KV events for the shared tiers: which pages this process stored in a tier, and when they left it.

A shared tier (Redis, a disk folder) is written by every replica pointed at it and emptied by whoever evicts: the
disk tier's writers (any process sharing the folder) and Redis itself (``maxmemory``, silently to its clients). A
replica started with ``--kv-events-config`` announces, per tier, the pages *it* stored that are in the tier, and their
removal by anyone (vLLM's rule for its own offloading tiers: an engine publishes what it offloaded):

    tier writer thread --pages it wrote----------> +----------------+
                                                   | tracker thread | --BlockStored / BlockRemoved (medium)--> sink
    removal source ----storage ids removed-------> | (one per tier) |      (the ZMQ publisher's queue)
        Redis: keyevent notifications            +----------------+
               (evicted, expired, del) on pub/sub        |  asks the tier which candidates exist NOW
        disk:  the index's removal log                   v  (Redis: pipelined EXISTS; disk: the index)

Exact after quiescence, whatever the order in which the two inputs arrive: every change of a page's presence is
followed by a trigger that reaches the tracker after the change (the writer's completion after its write; a
notification or log row after a removal), and the tracker decides by asking the tier *after* taking the trigger. A
page written and evicted before the tracker looked is never announced; a page removed and written again is not
announced as removed. Lost triggers (a dropped pub/sub connection, a removal log trimmed past this reader) and
changes that make no per-key trigger (Redis ``FLUSHALL``) are repaired by a full check of the announced pages:
after a reconnection or gap at once, and every ``resync_interval_s`` in any case.

So, per replica and medium, a subscriber's rebuilt index equals "the pages this replica stored that the tier holds";
the union over replicas is what the tier holds of the pages written since those replicas started. Pages already in
the tier when a replica starts are announced only once that replica stores them again.

Contract: ``on_written`` never blocks (a bounded deque; past ``max_pending`` the oldest are forgotten and a resync is
scheduled); everything else runs on the tracker's own thread; a failing source is retried, never raised. Nothing here
writes to the tier.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Protocol, Sequence

from common.events import KVEvent, PagesRemoved, PagesStored, StoredPageInfo
from common.page_keys import PageKey

logger = logging.getLogger(__name__)

TierEventSink = Callable[[str, list[KVEvent]], None]
"""``sink(medium, events)``: the publisher's entry for tier events (``PagesStored`` with infos / ``PagesRemoved``)."""

CHECK_CHUNK = 1024
"""Storage ids asked about in one existence check (one pipelined round trip / one SQL statement)."""


class RemovalSource(Protocol):
    """Where a tracker learns that pages may have left its tier."""

    def wait_removed(self, timeout_s: float) -> list[str] | None:
        """Storage ids removed since the last call (waits up to ``timeout_s`` for the first); None when some
        removals may have been missed (a reconnection, a trimmed log): the tracker then checks every page."""

    def existing(self, storage_ids: Sequence[str]) -> set[str] | None:
        """Which of ``storage_ids`` the tier holds now; None when that cannot be known now (unreachable)."""

    def close(self) -> None:
        """Release connections; ``wait_removed`` returns promptly afterwards."""


class TierEventTracker:
    """The pages one process announced for one tier (``announced``: storage id -> page key) and the thread that keeps
    them equal to the tier's contents (module docstring). ``storage_id(key)`` names a page as the source does."""

    POLL_S = 0.1

    def __init__(self, medium: str, source: RemovalSource, sink: TierEventSink,
                 storage_id: Callable[[PageKey], str], *, resync_interval_s: float = 60.0,
                 max_pending: int = 65536, on_published: Callable[[int, int], None] | None = None) -> None:
        """``on_published(num_stored, num_removed)``: called after each published round (the tier's counters)."""
        self.medium = medium
        self.announced: dict[str, PageKey] = {}
        self.num_checks = 0
        self._source = source
        self._sink = sink
        self._storage_id = storage_id
        self._on_published = on_published
        self._resync_interval_s = resync_interval_s
        self._pending: collections.deque[tuple[str, PageKey, StoredPageInfo]] = collections.deque(maxlen=max_pending)
        self._lock = threading.Lock()
        self._resync = False
        self._idle = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tier-events-{medium.lower()}", daemon=True)
        self._thread.start()

    def on_written(self, pages: Sequence) -> None:
        """A tier's writer handled ``pages`` (``StoredPage``s; stored or not: the tracker checks). Never blocks."""
        with self._lock:
            if len(self._pending) + len(pages) > (self._pending.maxlen or 0):
                self._resync = True  # the oldest pending pages are forgotten; announced ones get re-checked
            for page in pages:
                self._pending.append((self._storage_id(page.key), page.key,
                                      StoredPageInfo(page.parent_key, tuple(page.token_ids),
                                                     getattr(page, "salted", False) and page.parent_key is None)))
            self._idle.clear()

    def wait_idle(self, timeout_s: float) -> bool:
        """Tests: wait until the tracker has processed every trigger given so far (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        self._idle.clear()
        while time.monotonic() < deadline:
            if self._idle.wait(0.05):
                return True
        return False

    def close(self, timeout_s: float = 2.0) -> None:
        self._stopped.set()
        self._source.close()
        self._thread.join(timeout_s)

    # ---- the tracker thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_resync = time.monotonic() + self._resync_interval_s
        while not self._stopped.is_set():
            try:
                removed = self._source.wait_removed(self.POLL_S)
                with self._lock:
                    written = list(self._pending)
                    self._pending.clear()
                    resync, self._resync = self._resync or removed is None, False
                if time.monotonic() >= next_resync:
                    resync, next_resync = True, time.monotonic() + self._resync_interval_s
                if not self._reconcile(written, removed or [], resync):
                    with self._lock:  # the tier cannot answer now: keep the triggers for the next round
                        self._pending.extendleft(reversed(written))
                        self._resync = self._resync or resync
                    self._stopped.wait(self.POLL_S)
                    continue
                with self._lock:
                    if not self._pending and not self._resync:
                        self._idle.set()
            except Exception:  # noqa: BLE001 - events are an add-on: never take the replica down
                logger.exception("%s tier events: a round failed; the next one checks every page", self.medium)
                with self._lock:
                    self._resync = True
                self._stopped.wait(1.0)

    def _reconcile(self, written: list[tuple[str, PageKey, StoredPageInfo]], removed: list[str],
                   resync: bool) -> bool:
        """Ask the tier about every candidate; announce new pages and removals. False if the tier could not answer."""
        candidates = dict.fromkeys(storage_id for storage_id, _, _ in written)
        candidates.update(dict.fromkeys(i for i in (self.announced if resync else removed) if i in self.announced))
        if not candidates:
            return True
        present: set[str] = set()
        ids = list(candidates)
        for start in range(0, len(ids), CHECK_CHUNK):
            found = self._source.existing(ids[start : start + CHECK_CHUNK])
            if found is None:
                return False
            present |= found
        self.num_checks += 1
        gone = [storage_id for storage_id in ids if storage_id in self.announced and storage_id not in present]
        removed_keys = tuple(self.announced.pop(storage_id) for storage_id in gone)
        stored_keys, stored_infos = [], []
        for storage_id, key, info in written:
            if storage_id in present and storage_id not in self.announced:
                self.announced[storage_id] = key
                stored_keys.append(key)
                stored_infos.append(info)
        events: list[KVEvent] = []
        if removed_keys:
            events.append(PagesRemoved(0, removed_keys))
        if stored_keys:
            events.append(PagesStored(0, tuple(stored_keys), tuple(stored_infos)))
        if events:
            self._sink(self.medium, events)
            if self._on_published is not None:
                self._on_published(len(stored_keys), len(removed_keys))
        return True


# ---- removal sources -----------------------------------------------------------------------------------------------
REDIS_REMOVAL_EVENTS = ("evicted", "expired", "del")
"""Keyevent notifications that remove a key (``UNLINK`` also reports ``del``)."""
REDIS_NEEDED_FLAGS = "Egxe"
"""``notify-keyspace-events`` flags they need: E keyevent channel, g generic (del), x expired, e evicted."""


def missing_notify_flags(flags: str) -> str:
    """The flags of ``REDIS_NEEDED_FLAGS`` that ``flags`` (a ``notify-keyspace-events`` value) lacks."""
    have = set(flags)
    if "A" in have:  # alias for g$lshzxetd
        have |= set("g$lshzxetd")
    return "".join(flag for flag in REDIS_NEEDED_FLAGS if flag not in have)


class RedisRemovalSource:
    """Removals from a Redis tier: keyevent notifications on a pub/sub connection of the tier's own client.

    The server must publish them: ``notify-keyspace-events`` has to include ``Egxe`` (deploy/redis.conf sets it). When
    it does not, the source adds the missing flags with ``CONFIG SET`` (keeping the others); where CONFIG is disabled
    (managed servers) it warns once and removals are seen only by the periodic full check. Storage ids are Redis key
    names; keys outside ``key_prefix`` are ignored."""

    RECONNECT_S = 1.0

    def __init__(self, client, key_prefix: str, run: Callable, url: str | None = None) -> None:
        self._client = client
        self._url = url
        self._key_prefix = key_prefix
        self._run = run  # the tier's guarded call: run(operation, default)
        db = client.connection_pool.connection_kwargs.get("db", 0)
        self._channels = [f"__keyevent@{db}__:{event}" for event in REDIS_REMOVAL_EVENTS]
        self._pubsub = None
        self._subscriber = None
        self._ever_subscribed = False
        self._closed = False
        self._warned = False

    def wait_removed(self, timeout_s: float) -> list[str] | None:
        if self._closed:
            time.sleep(timeout_s)
            return []
        if self._pubsub is None:
            resubscribed = self._subscribe()
            if self._pubsub is None:
                time.sleep(min(timeout_s * 10, self.RECONNECT_S))
                return []
            if resubscribed:
                return None  # notifications may have been missed while we were away: check everything
        removed: list[str] = []
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                message = self._pubsub.get_message(ignore_subscribe_messages=True,
                                                   timeout=max(0.0, deadline - time.monotonic()))
                if message is None:
                    if removed or time.monotonic() >= deadline:
                        return removed
                    continue
                if message.get("type") != "message":
                    continue
                name = message["data"].decode() if isinstance(message["data"], bytes) else str(message["data"])
                if name.startswith(self._key_prefix):
                    removed.append(name)
        except Exception as exc:  # noqa: BLE001 - the connection dropped: resubscribe, then check everything
            if self._closed:
                return []
            logger.warning("Redis KV tier events: the notification connection failed (%s: %s); resubscribing",
                           type(exc).__name__, exc)
            self._drop_pubsub()
            return None

    def existing(self, storage_ids: Sequence[str]) -> set[str] | None:
        def probe(client) -> list[int]:
            pipe = client.pipeline(transaction=False)
            for name in storage_ids:
                pipe.exists(name)
            return pipe.execute()

        flags = self._run(probe, default=None)
        if flags is None:
            return None
        return {name for name, flag in zip(storage_ids, flags) if flag}

    def close(self) -> None:
        self._closed = True
        self._drop_pubsub()

    def _subscribe(self) -> bool:
        """Enable the notifications and subscribe; True when this is a re-subscription."""
        try:
            self._enable_notifications()
            self._subscriber = self._pubsub_client()  # held: a collected client closes its connections
            pubsub = self._subscriber.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(*self._channels)
        except Exception as exc:  # noqa: BLE001 - unreachable: try again later
            logger.debug("Redis KV tier events: subscribing failed: %s", exc)
            return False
        self._pubsub = pubsub
        resubscribed, self._ever_subscribed = self._ever_subscribed, True
        return resubscribed

    def _pubsub_client(self):
        """A client of its own for the subscription: no read timeout (the tier's 0.5 s one would drop an idle
        subscription), same address, credentials and TLS (from the URL)."""
        if self._url is None:
            return self._client
        import redis

        return redis.Redis.from_url(self._url, socket_connect_timeout=1.0, socket_timeout=None,
                                    health_check_interval=30)

    def _enable_notifications(self) -> None:
        try:
            flags = self._client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
            flags = flags.decode() if isinstance(flags, bytes) else str(flags)
            missing = missing_notify_flags(flags)
            if missing:
                self._client.config_set("notify-keyspace-events", flags + missing)
                logger.info("Redis KV tier events: notify-keyspace-events %r -> %r", flags, flags + missing)
        except Exception as exc:  # noqa: BLE001 - CONFIG disabled (managed servers): only the periodic check sees them
            import redis

            if not isinstance(exc, redis.ResponseError):
                raise
            if not self._warned:
                self._warned = True
                logger.warning("Redis KV tier events: cannot enable keyevent notifications (%s); set "
                               "notify-keyspace-events %s on the server, or evictions are published only at the "
                               "periodic full check", exc, REDIS_NEEDED_FLAGS)

    def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        subscriber, self._subscriber = self._subscriber, None
        for closable in (pubsub, subscriber if subscriber is not self._client else None):
            if closable is not None:
                try:
                    closable.close()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    pass


class DiskRemovalSource:
    """Removals from a disk tier: the index's removal log (``PageIndex.removals_after``), read every poll from where
    this reader stopped; a reader that fell behind the log's trimmed start checks everything."""

    def __init__(self, index) -> None:
        self._index = index
        self._cursor = index.last_removal_seq()
        self._closed = threading.Event()

    def wait_removed(self, timeout_s: float) -> list[str] | None:
        if self._closed.wait(timeout_s):
            return []
        rows = self._index.removals_after(self._cursor)
        if not rows:
            return []
        gap = rows[0][0] != self._cursor + 1
        self._cursor = rows[-1][0]
        return None if gap else [page_id for _, page_id in rows]

    def existing(self, storage_ids: Sequence[str]) -> set[str] | None:
        try:
            return self._index.existing(storage_ids)
        except Exception:  # noqa: BLE001 - the index is busy or gone: later
            return None

    def close(self) -> None:
        self._closed.set()
