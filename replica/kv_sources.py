"""Where a replica gets the KV of prompt pages its own prefix cache misses, before it recomputes them.

Lookup order, for the leading pages the local cache does not hold (each source continues where the previous stopped):

    keys          | k0 | k1 | k2 | k3 | k4 | k5 |
    local cache   | hit| hit|                        (the engine's own pages)
    1. peer copy            | k2 | k3 |              (the replica the router named in peer_hint; flag-gated)
    2. host tier (Redis)              | k4 |
    3. disk tier (Arrow)                   | k5 |
    4. recompute                                     (whatever is left)

Every page handed back has been verified here, once, against the request: same key, same token ids, same shape (the
tiers also check the header: key format version, model fingerprint, dtype, page size); the engine uses it as is. A
failing source (peer gone, Redis down, bad file) counts an error and the chain continues with the next one; nothing
here raises for a missing or broken source.

What goes to the shared tiers (``write_policy``): only pages worth sharing. With "reused" (the default) a page is
written when a second request uses it: a local prefix-cache hit (``share_local_hits``, the engine's pool copy of the
page) or a copy from a peer. A page computed once and never reused (every request's unique tail, its output) is not
written. A page this fetcher wrote or read from a tier is not written again for ``rewrite_after_s`` (after that a
reuse writes it again, which refreshes its recency in the tier). With "all", every newly computed page is written
(the behaviour before; ``benchmarks/tier_writes.py`` compares the two). Writes are asynchronous (the tiers' bounded
queues). Each tier load runs on one of the fetcher's own threads under ``tier_timeout_s``; past it the request
recomputes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from typing import Callable, Protocol, Sequence

from common.page_format import PageFormat
from common.page_keys import PageKey
from common.types import FETCH_SOURCES, CacheSource, SourceStats, StreamLocation
from replica.landing import LandingPages, submit_into
from replica.page_record import PageRecord
from replica.tiers.base import KVTier, RetentionUpdate, StoredPage
from replica.tiers.seal import TierKey

WRITE_POLICIES = ("reused", "all")
LOAD_THREADS = 2

logger = logging.getLogger(__name__)


class PeerClient(Protocol):
    """Copies pages from another replica. ``fetch`` returns the leading pages the peer holds (verified by the caller);
    it may raise on any transport failure (the fetcher catches and falls back). A client that can write a peer's pages
    straight into pool pages also has ``copies_into_pool(peer_id) -> bool`` and takes ``fetch(peer_id, keys,
    landing)`` (replica/peer_copy.py, replica/landing.py)."""

    async def fetch(self, peer_id: str, keys: Sequence[PageKey]) -> list[PageRecord]:
        ...


class PrefixFetcher:
    def __init__(
        self,
        page_format: PageFormat,
        *,
        tiers: Sequence[KVTier] = (),
        peer_client: PeerClient | None = None,
        own_replica_id: str = "",
        write_policy: str = "reused",
        tier_timeout_s: float = 5.0,
        rewrite_after_s: float = 30.0,
        max_known_pages: int = 65536,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.page_format = page_format
        self.tiers = list(tiers)
        self.peer_client = peer_client
        self.own_replica_id = own_replica_id
        self.write_policy = write_policy
        self.tier_timeout_s = tier_timeout_s
        self.rewrite_after_s = rewrite_after_s
        self.max_known_pages = max_known_pages
        self.source_to_stats: dict[CacheSource, SourceStats] = {source: SourceStats() for source in FETCH_SOURCES}
        self._known_lock = threading.Lock()
        self._key_to_known_until: collections.OrderedDict[PageKey, float] = collections.OrderedDict()
        self._background: set[asyncio.Future] = set()
        self.read_back: Callable[[list[PageKey]], list[PageRecord]] | None = None
        """Copies of the leading pages of the keys this replica has cached, from any thread (the engine's
        ``export_pages_concurrently``): how pages a peer copied into pool pages are read for the tiers later, when
        those pool pages may hold other KV. Without it a peer's pages come in tensors of their own."""
        self._load_executor = concurrent.futures.ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-tier-fetch")
        """Tier loads run on these few threads, not on whichever of the event loop's: the pages' memory then goes back
        to these threads' malloc arenas and the next load reuses it, already mapped in (a load's 32 MiB of fresh
        memory costs 40-80 ms of page faults on a VM: a disk-tier fetch measured 19-59 ms instead of ~20)."""

    @property
    def enabled(self) -> bool:
        return bool(self.tiers or self.peer_client)

    def learn_peer_stream(self, peer_id: str, location: StreamLocation) -> None:
        """The router named ``peer_id``'s page stream with its hint: the peer client asks there (if it can)."""
        learn = getattr(self.peer_client, "learn_stream", None)
        if learn is not None and peer_id != self.own_replica_id:
            learn(peer_id, location)

    def copies_into_pool(self, peer_id: str) -> bool:
        """True if a fetch from ``peer_id`` would copy its pages straight into landing pages (``fetch``)."""
        copies = getattr(self.peer_client, "copies_into_pool", None)
        return copies is not None and (self.read_back is not None or not self.tiers) and copies(peer_id)

    async def fetch(
        self,
        keys: Sequence[PageKey],
        token_ids_per_page: Sequence[Sequence[int]],
        *,
        peer_hint: str | None = None,
        parent_key: PageKey | None = None,
        defer_store: list | None = None,
        use_tiers: bool = True,
        landing: LandingPages | None = None,
    ) -> list[PageRecord]:
        """The leading run of ``keys`` found in the sources, in order (peer, host, disk), verified. ``parent_key``:
        the key of the page before ``keys[0]`` (None if ``keys[0]`` is page 0); pages copied from a peer are being
        reused, so they are written to the tiers: at once, or, given ``defer_store``, by a callable appended to it
        that the caller runs on the event loop when it likes (after the first token: sealing and sending them
        would take CPU from the prefill that waits for them). ``use_tiers=False``: the peer only. ``landing``: pool
        pages reserved for ``keys`` (replica/landing.py): the tiers decrypt into them, a peer's copy writes into them
        when its path can (``copies_into_pool``), and the records say so."""
        pages: list[PageRecord] = []
        if self.peer_client is not None and peer_hint and peer_hint != self.own_replica_id:
            into_pool = landing if self.copies_into_pool(peer_hint) else None
            pages.extend(await self._fetch_from_peer(peer_hint, keys, token_ids_per_page, into_pool))
            if pages and self.tiers:  # off the request's path: the copies for the writers run on a worker thread
                copied = list(pages)
                wanted = [page for page in copied if not self._is_known(page.key)]
                if any(page.landing_page is not None for page in copied):
                    # pool pages the request adopts: by the time this runs they may hold other KV, so they are read
                    # back by key (a page evicted meanwhile is only a write lost)
                    store = functools.partial(self._store_read_back, [page.key for page in wanted], parent_key, copied)
                else:
                    store = functools.partial(self._store_in_background, wanted, parent_key, copied)
                if defer_store is None:
                    store()
                else:
                    defer_store.append(store)
        for tier in self.tiers if use_tiers else ():
            if len(pages) == len(keys):
                break
            start = len(pages)
            loaded = await self._fetch_from_tier(tier, keys[start:], token_ids_per_page[start:], landing, start)
            self._mark_known(page.key for page in loaded)
            pages.extend(loaded)
        return pages

    async def _fetch_from_peer(self, peer_id, keys, token_ids_per_page,
                               landing: LandingPages | None = None) -> list[PageRecord]:
        stats = self.source_to_stats[CacheSource.PEER]
        started = time.perf_counter()
        try:
            raw = await self.peer_client.fetch(peer_id, keys, *([] if landing is None else [landing]))
        except Exception as exc:  # noqa: BLE001 - a peer failure means "recompute", never a failed request
            stats.errors += 1
            logger.warning("peer copy from %s failed (%s: %s); falling back to the shared tiers", peer_id,
                           type(exc).__name__, exc)
            return []
        pages = []
        for page, want_key, want_tokens in zip(raw, keys, token_ids_per_page):
            if (page.key != want_key or tuple(page.token_ids) != tuple(want_tokens)
                    or tuple(page.kv.shape) != self.page_format.kv_shape):
                stats.errors += 1
                logger.warning("peer %s returned a page that does not match the request; discarded", peer_id)
                break
            pages.append(page if page.source is CacheSource.PEER else dataclasses.replace(page, source=CacheSource.PEER))
        return self._account(stats, pages, started)

    async def _fetch_from_tier(self, tier: KVTier, keys, token_ids_per_page,
                               landing: LandingPages | None = None, first: int = 0) -> list[PageRecord]:
        """The tier's leading pages of ``keys``; never raises (a timeout or an error is a miss: recompute). One failed
        attempt counts one error, whether the tier reported it (its counter moved during the load; loads that overlap
        may see each other's) or the load raised or timed out. ``landing``: the fetch's pool pages, ``keys[0]`` being
        its page ``first``."""
        stats = self.source_to_stats[tier.source]
        started = time.perf_counter()
        errors_before = tier.stats().errors
        failed = False
        out = None
        try:  # no separate ``lookup``: a load stops at the first miss, and one round trip fewer is what matters here
            job, out = submit_into(self._load_executor,
                                   lambda out: tier.load(keys, token_ids_per_page, *([] if out is None else [out])),
                                   landing, first, len(keys))
            tensors = await asyncio.wait_for(asyncio.wrap_future(job), self.tier_timeout_s)
        except asyncio.TimeoutError:
            failed = True
            if out is not None:
                landing.writable = False
            logger.warning("the %s tier did not answer within %.1f s; recomputing", tier.name, self.tier_timeout_s)
            return []
        except Exception as exc:  # noqa: BLE001 - a tier failure means "recompute", never a failed request
            failed = True
            logger.warning("loading from the %s tier failed (%s: %s); recomputing", tier.name, type(exc).__name__, exc)
            return []
        finally:
            stats.errors += int(failed or tier.stats().errors > errors_before)
        landed = [None] * len(tensors) if out is None else [
            landing.page_ids[first + index] if kv is out[index] else None for index, kv in enumerate(tensors)]
        pages = [PageRecord(key, tuple(tokens), kv, tier.source, landing_page=page_id)
                 for key, tokens, kv, page_id in zip(keys, token_ids_per_page, tensors, landed)]
        return self._account(stats, pages, started)

    @staticmethod
    def _account(stats: SourceStats, pages: list[PageRecord], started: float) -> list[PageRecord]:
        stats.pages += len(pages)
        stats.bytes += sum(page.num_bytes for page in pages)
        stats.seconds += time.perf_counter() - started
        return pages

    # ---- writing to the tiers ----------------------------------------------------------------------------------
    def on_computed(self, pages: Sequence[PageRecord]) -> None:
        """The engine's page sink: pages it just computed and cached. Written only with ``write_policy="all"`` (a page
        computed once is not yet worth sharing; see the module docstring)."""
        if self.write_policy == "all":
            for page in pages:  # pages of several requests: parents unknown here
                self._store_one(page, None)

    def on_retention(self, updates: Sequence[RetentionUpdate]) -> None:
        """The engine's retention sink: retention changes of pages the tiers may already hold (a pin, an unpin, a
        request's retention given to cached pages, a hit restarting a TTL). Queued for every tier (non-blocking; a
        full queue drops them, counted by the tier)."""
        for tier in self.tiers:
            tier.update_retention(updates)

    def share_local_hits(self, keys: Sequence[PageKey], export: Callable[[list[PageKey]], list[PageRecord]]) -> int:
        """A request is reusing the leading pages ``keys`` (page 0 on) from the local cache: write the ones the tiers
        may lack. ``export(keys)`` copies them out of the pool (the engine's ``export_pages``, on the engine thread).
        Returns how many pages were queued."""
        if not self.tiers or not keys:
            return 0
        wanted = [key for key in keys if not self._is_known(key)]
        if not wanted:
            return 0
        pages = export(wanted)
        index_of = {key: index for index, key in enumerate(keys)}
        queued = 0
        for page in pages:
            index = index_of[page.key]
            queued += self._store_one(page, keys[index - 1] if index else None)
        return queued

    def store(self, pages: Sequence[PageRecord], parent_key: PageKey | None = None) -> None:
        """Queue ``pages`` (consecutive pages of one chain, ``parent_key`` before the first) for every tier,
        unconditionally (non-blocking; tiers copy pool views before returning)."""
        self._store_chain(pages, parent_key, pages)

    def _store_in_background(self, pages: Sequence[PageRecord], parent_key: PageKey | None,
                             chain: Sequence[PageRecord]) -> None:
        """``_store_chain`` on a worker thread (the tiers copy the pages before queueing them: ~1 ms per MiB that the
        request need not wait for). Never raises; a failure is logged."""
        if pages:
            self._in_background(lambda: self._store_chain(pages, parent_key, chain))

    def _store_read_back(self, keys: list[PageKey], parent_key: PageKey | None, chain: Sequence[PageRecord]) -> None:
        """``_store_in_background`` of the pages ``keys`` as this replica caches them now (``read_back``: the leading
        run of them still cached)."""
        if keys:
            self._in_background(lambda: self._store_chain(self.read_back(keys), parent_key, chain))

    def _in_background(self, store: Callable[[], None]) -> None:
        def run() -> None:
            try:
                store()
            except Exception:  # noqa: BLE001 - a lost tier write is only a lost cache entry
                logger.exception("queueing copied pages for the shared tiers failed")

        task = asyncio.get_running_loop().run_in_executor(None, run)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _store_chain(self, pages: Sequence[PageRecord], parent_key: PageKey | None,
                     chain: Sequence[PageRecord]) -> None:
        """Store ``pages``, a subset of the consecutive ``chain`` whose first page follows ``parent_key``."""
        index_of = {page.key: index for index, page in enumerate(chain)}
        for page in pages:
            index = index_of[page.key]
            self._store_one(page, chain[index - 1].key if index else parent_key)

    def _store_one(self, page: PageRecord, parent_key: PageKey | None) -> bool:
        if not self.tiers:
            return False
        stored = StoredPage.from_format(self.page_format, page.key, page.token_ids, page.kv.cpu(),
                                        parent_key=parent_key, retention_priority=page.retention_priority,
                                        retain_until=page.retain_until, salted=page.salted)
        accepted = False
        for tier in self.tiers:
            accepted |= tier.store([stored]) == 1
        if accepted:
            self._mark_known([page.key])
        return accepted

    def _is_known(self, key: PageKey) -> bool:
        """True if this fetcher wrote or read ``key`` to / from a tier within the last ``rewrite_after_s``."""
        with self._known_lock:
            until = self._key_to_known_until.get(key)
            if until is None:
                return False
            if until < time.monotonic():
                del self._key_to_known_until[key]
                return False
            return True

    def _mark_known(self, keys) -> None:
        until = time.monotonic() + self.rewrite_after_s
        with self._known_lock:
            for key in keys:
                self._key_to_known_until[key] = until
                self._key_to_known_until.move_to_end(key)
            while len(self._key_to_known_until) > self.max_known_pages:
                self._key_to_known_until.popitem(last=False)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        self._load_executor.shutdown(wait=False)
        close_peer = getattr(self.peer_client, "close", None)
        if close_peer is not None:
            close_peer()


def page_format_of(engine) -> PageFormat:
    """What a shared-tier page must match to be reused by ``engine`` (an ``LLMEngine``)."""
    from common.page_format import dtype_name

    geometry = engine.runner.geometry
    return PageFormat(
        model_fingerprint=engine.model_fingerprint,
        dtype=dtype_name(engine.runner.dtype),
        page_size=engine.config.page_size,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
    )


def build_tiers(page_format: PageFormat, *, redis_url: str | None, disk_cache_dir: str | None,
                disk_budget_bytes: int, tier_key: TierKey | None = None,
                key_file: str | None = None, redis_timeout_s: float = 0.5) -> list[KVTier]:
    """The shared tiers the flags ask for, host (Redis) before disk, sealed under ``tier_key`` (default: the key in
    ``key_file``, or the machine's default key file, created on first use; see ``replica.tiers.seal``).
    ``redis_timeout_s``: the host tier's connect and read timeout (``--redis-timeout``)."""
    tiers: list[KVTier] = []
    if not (redis_url or disk_cache_dir):
        return tiers
    if tier_key is None:
        from replica.tiers.seal import resolve_key

        tier_key = resolve_key(key_file)
    if redis_url:
        from replica.tiers.redis_tier import RedisTier

        tiers.append(RedisTier(redis_url, page_format, tier_key=tier_key, socket_timeout_s=redis_timeout_s))
    if disk_cache_dir:
        from replica.tiers.disk_tier import DiskTier

        tiers.append(DiskTier(disk_cache_dir, page_format, disk_budget_bytes, tier_key=tier_key))
    return tiers
