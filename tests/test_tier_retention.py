"""Retention (priority + TTL) in the shared tiers' own eviction: the disk tier's order with a fake clock and exact
keys; the Redis host tier against a real redis-server run with ``volatile-lru`` (retained pages survive a flood that
turns memory over several times, fall back to LRU after their TTL or an unpin, and a server full of retained pages
refuses writes without crashing anything); and pins, unpins and request retentions of an engine reaching both tiers
for pages stored before. No Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import sqlite3
import time
import uuid

import pytest
import redis

from common.types import PinPrefix, Retention
from replica.tiers.arrow_file import write_page_file
from replica.tiers.base import RetentionUpdate
from replica.tiers.disk_tier import DiskTier
from replica.tiers.redis_tier import RedisTier
from replica.tiers.seal import TierKey
from test_tiers import make_format, make_pages

T0 = 1_000_000.0
"""The fake wall clock's start (seconds)."""
VOLATILE_REDIS = ("--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru", "--maxmemory-samples", "10")
"""A server the size of ~150 test pages (16 KiB of KV each), evicting only keys with an expiry."""
LRU_TICK_S = 1.2
"""Redis' LRU clock counts whole seconds: keys used within one second are evicted in random order among themselves,
so a test waits this long for the pages it expects to go first to be older than a flood."""


class WallClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def single_pages(page_format, names: str):
    """One single-page chain per letter (no parents: every page is a leaf of the disk tier's index)."""
    return {name: make_pages(page_format, 1, seed=100 + index)[0] for index, name in enumerate(names)}


def retained(page, priority, until):
    return dataclasses.replace(page, retention_priority=priority, retain_until=until)


# ---- disk tier: priority, then TTL, then LRU; updates of stored pages -------------------------------------------------


def test_disk_retention_updates_of_stored_pages_order_eviction_priority_then_ttl_then_lru(tmp_path):
    page_format = make_format()
    pages = single_pages(page_format, "abcdefghijkl")
    tier_key = TierKey.generate()
    size, _ = write_page_file(str(tmp_path / "probe.arrow"), pages["a"], tier_key)
    clock = WallClock()
    tier = DiskTier(tmp_path / "kv", page_format, budget_bytes=int(4.5 * size), evict_to_fraction=1.0,
                    tier_key=tier_key, wall_clock=clock)

    def store(*names):
        tier.store([pages[name] for name in names])
        assert tier.flush(timeout=10)

    def present():
        return "".join(name for name, page in pages.items() if tier.lookup([page.key]))

    try:
        for name in "abcd":  # LRU order a < b < c < d, all plain
            store(name)
        # retentions given to pages already stored (as a pin or a request's retention does), recency unchanged
        tier.update_retention([RetentionUpdate(pages["a"].key, 50, T0 + 100),
                               RetentionUpdate(pages["b"].key, 20, T0 + 30),
                               RetentionUpdate(pages["c"].key, 20, T0 + 100),
                               RetentionUpdate(pages["l"].key, 90, T0 + 100)])  # l is not stored: nothing
        assert tier.flush(timeout=10)
        assert tier.stats().retention_updates == 3
        store("e")  # the only plain page (d) goes, though a, b, c are older
        assert present() == "abce"
        store("f")
        assert present() == "abcf"
        clock.now = T0 + 40  # b's retention has ended: it is plain again, and older than f
        store("g")
        assert present() == "acfg"
        store("h", "i", "j")  # three go: the plain f, g, then c (priority 20 before a's 50)
        assert present() == "ahij"
        tier.update_retention([RetentionUpdate(pages["a"].key, 0)])  # unpin: a is plain (and the oldest)
        assert tier.flush(timeout=10)
        store("k")
        assert present() == "hijk"
        assert (tier.stats().pages_evicted, tier.stats().retention_updates) == (7, 4)  # d e b f g c a; 3 + the unpin
    finally:
        tier.close()


# ---- Redis host tier under volatile-lru (a real redis-server) ----------------------------------------------------------


def flood(tier, num_pages: int, seed: int) -> None:
    """Store ``num_pages`` unique plain pages (one long chain) and wait until they are written."""
    pages = make_pages(tier.page_format, num_pages, seed=seed)
    for start in range(0, num_pages, 128):
        assert tier.store(pages[start:start + 128]) == len(pages[start:start + 128])
        assert tier.flush(timeout=30)


def present_keys(client, tier, pages) -> list[bool]:
    return [bool(client.exists(tier.redis_key(page.key))) for page in pages]


def test_redis_retained_pages_survive_a_flood_until_their_ttl_or_unpin(redis_process_factory):
    server = redis_process_factory(extra_args=VOLATILE_REDIS)
    client = redis.Redis.from_url(server.url)
    page_format = make_format()
    clock = WallClock()
    tier = RedisTier(server.url, page_format, wall_clock=clock, sweep_interval_s=0.0)
    try:
        kept = [retained(page, 50, T0 + 60) for page in make_pages(page_format, 3, seed=1)]  # a TTL'd retention
        pinned = make_pages(page_format, 1, seed=2)[0]  # stored plain; pinned afterwards (an admin pin)
        control = list(single_pages(page_format, "abcdefghijklmnopqrst").values())  # 20 plain pages
        tier.store(kept + [pinned] + control)
        assert tier.flush(timeout=10)
        tier.update_retention([RetentionUpdate(pinned.key, 100, math.inf)])
        assert tier.flush(timeout=10)
        assert tier.retention_of_page(pinned.key) == (100, math.inf)
        assert tier.retention_of_page(kept[0].key) == (50, T0 + 60)
        assert client.ttl(tier.redis_key(kept[0].key)) == -1  # retained: no expiry, so volatile-lru never evicts it
        assert 0 < client.ttl(tier.redis_key(control[0].key)) <= 86400

        time.sleep(LRU_TICK_S)
        flood(tier, 600, seed=10)  # ~4x the server's memory
        assert client.info("stats")["evicted_keys"] > 300
        assert present_keys(client, tier, kept + [pinned]) == [True] * 4
        assert present_keys(client, tier, control) == [False] * 20
        assert tier.load([page.key for page in kept], [page.token_ids for page in kept])  # still whole and valid

        clock.now = T0 + 61  # kept's retention ended: the writer sweeps before its next write (at most every
        flood(tier, 1, seed=13)  # sweep_interval_s) and gives them their expiry back; a sweep touches a key's LRU
        assert [client.ttl(tier.redis_key(page.key)) > 0 for page in kept] == [True] * 3  # time, so wait a tick
        time.sleep(LRU_TICK_S)
        flood(tier, 600, seed=11)
        assert present_keys(client, tier, kept) == [False] * 3
        assert present_keys(client, tier, [pinned]) == [True]
        assert tier.retention_of_page(kept[0].key) is None
        tier.update_retention([RetentionUpdate(pinned.key, 0)])  # unpin
        assert tier.flush(timeout=10)
        assert tier.retention_of_page(pinned.key) is None and client.ttl(tier.redis_key(pinned.key)) > 0
        time.sleep(LRU_TICK_S)
        flood(tier, 400, seed=12)
        assert present_keys(client, tier, [pinned]) == [False]
        stats = tier.stats()
        assert (stats.retention_expired, stats.retention_updates, stats.oom_refused, stats.errors) == (3, 2, 0, 0)
    finally:
        tier.close()


def test_redis_retention_merges_like_the_other_tiers_and_a_plain_restore_keeps_it(redis_server):
    page_format = make_format()
    clock = WallClock()
    tier = RedisTier(redis_server, page_format, key_prefix=f"test-{uuid.uuid4().hex[:8]}:", wall_clock=clock,
                     sweep_interval_s=3600.0)
    client = redis.Redis.from_url(redis_server)
    a, missing = make_pages(page_format, 2, seed=3)

    def update(priority, until=0.0, page=a):
        tier.update_retention([RetentionUpdate(page.key, priority, until)])
        assert tier.flush(timeout=10)
        return tier.retention_of_page(page.key)

    try:
        tier.store([a])
        assert tier.flush(timeout=10)
        assert tier.retention_of_page(a.key) is None and client.ttl(tier.redis_key(a.key)) > 0
        assert update(30, T0 + 100) == (30, T0 + 100)
        assert client.ttl(tier.redis_key(a.key)) == -1
        assert update(20, T0 + 500) == (30, T0 + 100)  # weaker while 30 holds: ignored
        assert update(30, T0 + 200) == (30, T0 + 200)  # same priority: the later end
        tier.store([a])  # a plain re-store (a reuse) neither drops the retention nor gives the page an expiry
        assert tier.flush(timeout=10)
        assert tier.retention_of_page(a.key) == (30, T0 + 200) and client.ttl(tier.redis_key(a.key)) == -1
        tier.store([retained(a, 40, T0 + 50)])  # a store carrying a higher priority replaces it
        assert tier.flush(timeout=10)
        assert tier.retention_of_page(a.key) == (40, T0 + 50)
        clock.now = T0 + 60  # ended (not swept yet): any new retention replaces it
        assert update(10, T0 + 70) == (10, T0 + 70)
        clock.now = T0 + 80
        assert tier.sweep() == 1
        assert tier.retention_of_page(a.key) is None and client.ttl(tier.redis_key(a.key)) > 0
        assert update(10, T0 + 90) == (10, T0 + 90)
        assert update(0) is None and client.ttl(tier.redis_key(a.key)) > 0  # unpin
        assert update(50, T0 + 100, page=missing) is None  # a page the tier lacks: nothing is created
        assert not client.exists(tier.redis_key(missing.key))
    finally:
        tier.close()


def test_redis_full_of_retained_pages_refuses_writes_cleanly_and_ends_the_lowest_retentions(
        redis_process_factory, caplog):
    server = redis_process_factory(extra_args=VOLATILE_REDIS)
    client = redis.Redis.from_url(server.url)
    page_format = make_format()
    tier = RedisTier(server.url, page_format, wall_clock=WallClock(), queue_size=1024)
    caplog.set_level(logging.WARNING, logger="replica.tiers.redis_tier")
    try:
        vip = retained(make_pages(page_format, 1, seed=4)[0], 90, math.inf)
        tier.store([vip])
        assert tier.flush(timeout=10)
        fill = [retained(page, 10, math.inf) for page in make_pages(page_format, 400, seed=5)]
        num_sent = 0
        while tier.stats().oom_refused == 0 and num_sent < len(fill):  # until Redis refuses: nothing evictable left
            tier.store(fill[num_sent:num_sent + 16])
            num_sent += 16
            assert tier.flush(timeout=10)
        stats = tier.stats()
        assert stats.oom_refused > 0, "the server never filled up"
        assert stats.pages_dropped == stats.oom_refused and stats.errors == 0
        assert stats.retention_expired >= 8  # the lowest-priority retentions ended so later writes fit
        assert any("refused" in record.getMessage() for record in caplog.records)

        before = tier.stats().pages_stored
        flood(tier, 64, seed=6)  # plain pages are written again (Redis evicts the demoted pages, then older plain)
        assert tier.stats().pages_stored - before == 64
        assert tier.stats().oom_refused == stats.oom_refused
        assert present_keys(client, tier, [vip]) == [True]
        assert tier.retention_of_page(vip.key) == (90, math.inf)  # the highest priority was never demoted
    finally:
        tier.close()


# ---- an engine's pins, unpins and request retentions reach both tiers for pages stored before -------------------------


def index_retention(tier: DiskTier, key) -> tuple[int, float]:
    index = sqlite3.connect(str(tier._root) + "/index.sqlite")
    try:
        return index.execute("SELECT priority, retain_until FROM pages WHERE id = ?", (tier.page_id(key),)).fetchone()
    finally:
        index.close()


def test_engine_pin_unpin_and_request_retention_reach_both_tiers(redis_server, tmp_path):
    from common.types import EngineRequest
    from engine_utils import TinyModel, greedy, random_prompt
    from replica.async_engine import AsyncEngine
    from replica.kv_sources import PrefixFetcher, page_format_of

    engine = TinyModel("llama", seed=7).engine(num_pages=16, enforce_eager=True)
    page_format = page_format_of(engine)
    tier_key = TierKey.generate()
    host = RedisTier(redis_server, page_format, key_prefix=f"test-{uuid.uuid4().hex[:8]}:", tier_key=tier_key)
    disk = DiskTier(tmp_path / "kv", page_format, 1 << 30, tier_key=tier_key)
    async_engine = AsyncEngine(engine, PrefixFetcher(page_format, tiers=[host, disk], write_policy="all"))
    system = random_prompt(2 * 128, seed=20)
    other = random_prompt(2 * 128, seed=21)
    system_keys, other_keys = engine.page_keys(system), engine.page_keys(other)

    async def ask(request_id, prompt, retention=None):
        async for _ in async_engine.generate(EngineRequest(request_id, prompt + [5, 6], greedy(1),
                                                           retention=retention)):
            pass

    def flush():
        assert host.flush(timeout=10) and disk.flush(timeout=10)

    def retention(key):
        return host.retention_of_page(key), index_retention(disk, key)

    try:
        asyncio.run(ask("s", system))
        asyncio.run(ask("o", other))
        flush()  # both prompts' pages are in both tiers, plain
        assert [retention(key) for key in system_keys + other_keys] == [(None, (0, 0.0))] * 4

        asyncio.run(async_engine.pin_prefix(PinPrefix(tuple(system_keys), priority=100, ttl_s=None, label="sys")))
        flush()
        assert [retention(key) for key in system_keys] == [((100, math.inf), (100, math.inf))] * 2
        # the admin listing's report says where the pinned prefix lives in the tiers (and carries no keys out)
        [report] = asyncio.run(async_engine.prefix_reports())
        assert report.tiers == (("host", 2, 2), ("disk", 2, 2)) and report.page_keys == ()
        assert host.residency(other_keys) == (2, 0) and disk.residency(other_keys) == (2, 0)
        assert host.residency([other_keys[0], b"\0" * 32, other_keys[1]]) == (1, 0)
        assert disk.residency([b"\0" * 32] + other_keys) == (0, 0)

        asyncio.run(ask("o2", other, Retention(priority=50, ttl_s=600.0)))  # a hit on the stored pages, retained
        flush()
        for key in other_keys:
            (priority, until), (disk_priority, disk_until) = retention(key)
            assert (priority, disk_priority) == (50, 50)
            assert until == pytest.approx(time.time() + 600, abs=60) and disk_until == pytest.approx(until, abs=1e-3)

        assert asyncio.run(async_engine.unpin_prefix(system_keys[-1].hex()[:32]))
        flush()
        assert [retention(key) for key in system_keys] == [(None, (0, 0.0))] * 2
        assert host.residency(system_keys) == (2, 0) and disk.residency(system_keys) == (2, 0)
        assert [retention(key)[0][0] for key in other_keys] == [50, 50]  # the request's retention stays
    finally:
        async_engine.shutdown()
