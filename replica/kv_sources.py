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

Pages this replica computes are written to the host and disk tiers asynchronously (the tiers' bounded queues).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Protocol, Sequence

from common.page_format import PageFormat
from common.page_keys import PageKey
from common.types import FETCH_SOURCES, CacheSource, SourceStats
from replica.page_record import PageRecord
from replica.tiers.base import KVTier, StoredPage

logger = logging.getLogger(__name__)


class PeerClient(Protocol):
    """Copies pages from another replica. ``fetch`` returns the leading pages the peer holds (verified by the caller);
    it may raise on any transport failure (the fetcher catches and falls back)."""

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
    ) -> None:
        self.page_format = page_format
        self.tiers = list(tiers)
        self.peer_client = peer_client
        self.own_replica_id = own_replica_id
        self.source_to_stats: dict[CacheSource, SourceStats] = {source: SourceStats() for source in FETCH_SOURCES}

    @property
    def enabled(self) -> bool:
        return bool(self.tiers or self.peer_client)

    async def fetch(
        self,
        keys: Sequence[PageKey],
        token_ids_per_page: Sequence[Sequence[int]],
        *,
        peer_hint: str | None = None,
    ) -> list[PageRecord]:
        """The leading run of ``keys`` found in the sources, in order (peer, host, disk), verified."""
        pages: list[PageRecord] = []
        if self.peer_client is not None and peer_hint and peer_hint != self.own_replica_id:
            pages.extend(await self._fetch_from_peer(peer_hint, keys, token_ids_per_page))
        for tier in self.tiers:
            if len(pages) == len(keys):
                break
            start = len(pages)
            pages.extend(await self._fetch_from_tier(tier, keys[start:], token_ids_per_page[start:]))
        return pages

    async def _fetch_from_peer(self, peer_id, keys, token_ids_per_page) -> list[PageRecord]:
        stats = self.source_to_stats[CacheSource.PEER]
        started = time.perf_counter()
        try:
            raw = await self.peer_client.fetch(peer_id, keys)
        except Exception as exc:  # noqa: BLE001 - a peer failure means "recompute", never a failed request
            stats.errors += 1
            logger.warning("peer copy from %s failed (%s); falling back to the shared tiers", peer_id, exc)
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

    async def _fetch_from_tier(self, tier: KVTier, keys, token_ids_per_page) -> list[PageRecord]:
        stats = self.source_to_stats[tier.source]
        started = time.perf_counter()
        errors_before = tier.stats().errors
        try:
            num_present = await asyncio.to_thread(tier.lookup, keys)
            if num_present == 0:
                return []
            tensors = await asyncio.to_thread(tier.load, keys[:num_present], token_ids_per_page[:num_present])
        finally:
            stats.errors += tier.stats().errors - errors_before
        pages = [PageRecord(key, tuple(tokens), kv, tier.source)
                 for key, tokens, kv in zip(keys, token_ids_per_page, tensors)]
        return self._account(stats, pages, started)

    @staticmethod
    def _account(stats: SourceStats, pages: list[PageRecord], started: float) -> list[PageRecord]:
        stats.pages += len(pages)
        stats.bytes += sum(page.num_bytes for page in pages)
        stats.seconds += time.perf_counter() - started
        return pages

    def store(self, pages: Sequence[PageRecord]) -> None:
        """Queue newly computed pages for every tier (non-blocking; tiers copy pool views before returning)."""
        if not self.tiers or not pages:
            return
        stored = [StoredPage.from_format(self.page_format, page.key, page.token_ids, page.kv.cpu(),
                                         page.retention_priority, page.retain_until) for page in pages]
        for tier in self.tiers:
            tier.store(stored)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


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
                disk_budget_bytes: int) -> list[KVTier]:
    """The shared tiers the flags ask for, host (Redis) before disk."""
    tiers: list[KVTier] = []
    if redis_url:
        from replica.tiers.redis_tier import RedisTier

        tiers.append(RedisTier(redis_url, page_format))
    if disk_cache_dir:
        from replica.tiers.disk_tier import DiskTier

        tiers.append(DiskTier(disk_cache_dir, page_format, disk_budget_bytes))
    return tiers
