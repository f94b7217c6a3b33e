"""Shared KV tiers: Redis host tier and Arrow disk tier against a real redis-server and real files."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import socket
import threading
import uuid

import pytest
import redis
import torch

from common.page_keys import compute_page_keys
from replica.tiers.arrow_file import read_page_file, write_page_file
from common.page_format import PageFormat
from replica.tiers.base import StoredPage
from replica.tiers.circuit import BackoffPolicy
from replica.tiers import codec
from replica.tiers.codec import encode_blob
from replica.tiers.disk_tier import DiskTier
from replica.tiers.redis_tier import RedisTier
from replica.tiers.seal import TierKey

PAGE_SIZE = 128


def make_format(dtype: str = "bfloat16", **overrides) -> PageFormat:
    fields = dict(model_fingerprint="tiny-llama", dtype=dtype, page_size=PAGE_SIZE, num_layers=2, num_kv_heads=2,
                  head_dim=8)
    fields.update(overrides)
    return PageFormat(**fields)


def make_kv(page_format: PageFormat, seed: int) -> torch.Tensor:
    """Random KV with awkward bit patterns (NaN, -0.0, inf, subnormal) so that only a bit-exact copy compares equal."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(page_format.kv_shape, generator=generator).to(getattr(torch, page_format.dtype))
    flat = kv.view(-1)
    flat[:4] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40]).to(getattr(torch, page_format.dtype))
    return kv


def make_pages(page_format: PageFormat, num_pages: int, seed: int = 0) -> list[StoredPage]:
    """Consecutive full pages of one prompt, with real chained page keys."""
    token_ids = [(seed * 7919 + i * 31) % 50_000 for i in range(num_pages * page_format.page_size)]
    keys = compute_page_keys(
        token_ids, page_size=page_format.page_size, model_fingerprint=page_format.model_fingerprint, salt=str(seed)
    )
    return [
        StoredPage.from_format(
            page_format,
            key,
            token_ids[i * page_format.page_size : (i + 1) * page_format.page_size],
            make_kv(page_format, seed * 1000 + i),
        )
        for i, key in enumerate(keys)
    ]


def keys_of(pages):
    return [page.key for page in pages]


def tokens_of(pages):
    return [page.token_ids for page in pages]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def assert_bit_identical(loaded, pages):
    assert len(loaded) == len(pages)
    for kv, page in zip(loaded, pages):
        assert kv.dtype == page.kv.dtype and kv.shape == page.kv.shape
        assert torch.equal(bits(kv), bits(page.kv))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def open_tiers():
    tiers = []
    yield tiers
    for tier in tiers:
        tier.close()


@pytest.fixture
def make_tier(request, tmp_path, open_tiers):
    """``make_tier(kind, page_format, **kwargs)``: a Redis tier (own key prefix) or a disk tier (own folder). A Redis
    tier's socket timeouts are 10 s unless given: the tier's 0.5 s default makes one stall of a loaded CI box a
    reconnect and an error, which these tests (of formats, loads and writes, not of outages) would count."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    tier_key = TierKey.generate()  # one cluster key per test: its tiers share pages

    def make(kind: str, page_format: PageFormat, **kwargs):
        kwargs.setdefault("tier_key", tier_key)
        if kind == "redis":
            kwargs.setdefault("socket_timeout_s", 10.0)
            tier = RedisTier(request.getfixturevalue("redis_server"), page_format, key_prefix=prefix, **kwargs)
        else:
            kwargs.setdefault("budget_bytes", 1 << 30)
            tier = DiskTier(tmp_path / "kv", page_format, **kwargs)
        open_tiers.append(tier)
        return tier

    return make


def plant_entry(tier, key: bytes, page: StoredPage) -> None:
    """Write ``page`` (any header) where ``tier`` looks for ``key``, bypassing the tier's own checks."""
    if isinstance(tier, RedisTier):
        redis.Redis.from_url(tier.url).set(tier.redis_key(key), bytes(encode_blob(page, tier.tier_key)))
    else:
        os.makedirs(os.path.dirname(tier.page_path(key)), exist_ok=True)
        write_page_file(tier.page_path(key), page, tier.tier_key)


def entry_exists(tier, key: bytes) -> bool:
    if isinstance(tier, RedisTier):
        return bool(redis.Redis.from_url(tier.url).exists(tier.redis_key(key)))
    return os.path.exists(tier.page_path(key))


KINDS = ["redis", "disk"]


# ---- round trip ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_identical(make_tier, kind, dtype):
    page_format = make_format(dtype)
    tier = make_tier(kind, page_format)
    pages = make_pages(page_format, 3)

    assert tier.store(pages) == 3
    assert tier.flush(timeout=10)
    assert tier.lookup(keys_of(pages)) == 3
    loaded = tier.load(keys_of(pages), tokens_of(pages))

    assert_bit_identical(loaded, pages)
    stats = tier.stats()
    page_bytes = page_format.page_num_bytes
    assert (stats.pages_stored, stats.bytes_stored, stats.pages_loaded, stats.bytes_loaded) == (
        3, 3 * page_bytes, 3, 3 * page_bytes)
    assert (stats.pages_dropped, stats.discarded_corrupt, stats.errors) == (0, 0, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_lookup_and_load_stop_at_the_first_missing_page(make_tier, kind):
    page_format = make_format()
    tier = make_tier(kind, page_format)
    pages = make_pages(page_format, 4)
    tier.store([pages[0], pages[1], pages[3]])
    tier.flush(timeout=10)

    assert tier.lookup(keys_of(pages)) == 2
    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages[:2])
    assert tier.lookup([]) == 0 and tier.load([], []) == []


@pytest.mark.parametrize("kind", KINDS)
def test_store_copies_views_so_later_writes_to_the_pool_do_not_leak(make_tier, kind):
    page_format = make_format()
    tier = make_tier(kind, page_format)
    page = make_pages(page_format, 1)[0]
    pool = torch.stack([page.kv, page.kv], dim=2)  # [layers, 2, num_pages, page_size, heads, dim]
    view_page = StoredPage.from_format(page_format, page.key, page.token_ids, pool[:, :, 0])

    tier.store([view_page])
    pool.zero_()  # the engine reuses the pool page right away
    tier.flush(timeout=10)

    assert_bit_identical(tier.load([page.key], [page.token_ids]), [page])


# ---- rejected entries ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_token_id_mismatch_is_a_miss_and_discards_the_entry(make_tier, kind):
    page_format = make_format()
    tier = make_tier(kind, page_format)
    page = make_pages(page_format, 1)[0]
    tier.store([page])
    tier.flush(timeout=10)
    other_tokens = (page.token_ids[0] + 1,) + page.token_ids[1:]

    assert tier.load([page.key], [other_tokens]) == []

    assert tier.stats().discarded_corrupt == 1
    assert not entry_exists(tier, page.key)
    assert tier.lookup([page.key]) == 0


FOREIGN_FORMATS = {
    "fingerprint": dict(model_fingerprint="another-model"),
    "page_size": dict(page_size=256),
    "key_format_version": dict(key_format_version=2),
    "dtype": dict(dtype="float32"),
    "kv_shape": dict(num_kv_heads=4),
}


@pytest.mark.parametrize("foreign", sorted(FOREIGN_FORMATS))
@pytest.mark.parametrize("kind", KINDS)
def test_foreign_entry_under_our_key_is_a_miss_and_discarded(make_tier, kind, foreign):
    page_format = make_format()
    tier = make_tier(kind, page_format)
    ours = make_pages(page_format, 1)[0]
    foreign_format = dataclasses.replace(page_format, **FOREIGN_FORMATS[foreign])
    theirs = make_pages(foreign_format, 1)[0]
    plant_entry(tier, ours.key, theirs)

    assert tier.lookup([ours.key]) == 1  # lookup is only a hint
    assert tier.load([ours.key], [ours.token_ids]) == []

    stats = tier.stats()
    assert (stats.discarded_corrupt, stats.pages_loaded, stats.errors) == (1, 0, 0)
    assert not entry_exists(tier, ours.key)


@pytest.mark.parametrize("kind", KINDS)
def test_other_dtype_lives_in_its_own_namespace(make_tier, kind):
    bf16_tier = make_tier(kind, make_format("bfloat16"))
    fp32_tier = make_tier(kind, make_format("float32"))
    fp32_pages = make_pages(fp32_tier.page_format, 2)
    fp32_tier.store(fp32_pages)
    fp32_tier.flush(timeout=10)

    assert bf16_tier.lookup(keys_of(fp32_pages)) == 0
    assert bf16_tier.load(keys_of(fp32_pages), tokens_of(fp32_pages)) == []
    assert bf16_tier.stats().discarded_corrupt == 0
    assert_bit_identical(fp32_tier.load(keys_of(fp32_pages), tokens_of(fp32_pages)), fp32_pages)


@pytest.mark.parametrize("kind", KINDS)
def test_tier_of_another_key_format_version_is_refused(make_tier, kind, caplog):
    current = make_tier(kind, make_format())
    newer_format = make_format(key_format_version=2)
    newer_pages = make_pages(newer_format, 2)

    with caplog.at_level(logging.ERROR):
        newer = make_tier(kind, newer_format)

    assert newer.refused and not newer.available
    assert any("REFUSED" in record.getMessage() for record in caplog.records)
    assert newer.store(newer_pages) == 0
    assert newer.lookup(keys_of(newer_pages)) == 0
    assert newer.load(keys_of(newer_pages), tokens_of(newer_pages)) == []
    assert newer.stats().pages_dropped == 2
    assert current.available and not current.refused


def test_redis_garbage_and_truncated_values_are_discarded(make_tier):
    page_format = make_format()
    tier = make_tier("redis", page_format)
    pages = make_pages(page_format, 3)
    client = redis.Redis.from_url(tier.url)
    client.set(tier.redis_key(pages[0].key), b"not a page at all")
    client.set(tier.redis_key(pages[1].key), bytes(encode_blob(pages[1], tier.tier_key))[:-100])
    client.set(tier.redis_key(pages[2].key), b"")

    for page in pages:
        assert tier.load([page.key], [page.token_ids]) == []

    assert tier.stats().discarded_corrupt == 3
    assert not any(entry_exists(tier, page.key) for page in pages)


def corrupt_truncate_half(path, data):
    return data[: len(data) // 2]


def corrupt_empty(path, data):
    return b""


def corrupt_payload_byte(path, data):
    position = len(data) // 2  # inside the sealed KV bytes: only the AES-GCM tag notices
    return data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1 :]


def corrupt_footer_magic(path, data):
    return data[:-6] + b"XXXXXX"


def corrupt_header_value(path, data):
    return data.replace(b"tiny-llama", b"tiny-llamb")  # the schema is in the file twice


def corrupt_garbage(path, data):
    return os.urandom(len(data))


CORRUPTIONS = [corrupt_truncate_half, corrupt_empty, corrupt_payload_byte, corrupt_footer_magic,
               corrupt_header_value, corrupt_garbage]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.removeprefix("corrupt_"))
def test_damaged_arrow_file_is_a_miss_deleted_and_counted(make_tier, corrupt):
    page_format = make_format()
    tier = make_tier("disk", page_format)
    pages = make_pages(page_format, 2)
    tier.store(pages)
    tier.flush(timeout=10)
    path = tier.page_path(pages[1].key)
    with open(path, "rb") as file:
        data = file.read()
    with open(path, "wb") as file:  # in place, as a crash or a foreign writer would leave it
        file.write(corrupt(path, data))

    loaded = tier.load(keys_of(pages), tokens_of(pages))

    assert_bit_identical(loaded, pages[:1])
    stats = tier.stats()
    assert (stats.discarded_corrupt, stats.errors, stats.pages_loaded) == (1, 0, 1)
    assert not os.path.exists(path)
    assert os.path.exists(tier.page_path(pages[0].key))


def test_disk_load_read_side_by_side_keeps_the_leading_run_and_its_time_limit(make_tier):
    """The disk tier reads and decrypts a load's pages on several threads (``codec.load_pool``): a damaged page in the
    middle still ends the answer there (the pages after it, read meanwhile, are not returned and stay stored, the
    damaged one is deleted), every returned page is its own tensor, and a load past its time limit returns only what
    came before the limit and counts a timeout."""
    page_format = make_format()
    tier = make_tier("disk", page_format)
    pages = make_pages(page_format, 8)
    tier.store(pages)
    tier.flush(timeout=10)
    assert codec.LOAD_WORKERS >= 1
    path = tier.page_path(pages[3].key)
    with open(path, "rb") as file:
        data = file.read()
    with open(path, "wb") as file:
        file.write(corrupt_payload_byte(path, data))

    loaded = tier.load(keys_of(pages), tokens_of(pages))

    assert_bit_identical(loaded, pages[:3])
    assert len({kv.data_ptr() for kv in loaded}) == 3
    assert not os.path.exists(path)
    assert all(os.path.exists(tier.page_path(page.key)) for page in pages[4:])
    assert tier.stats().discarded_corrupt == 1

    late = make_tier("disk", page_format, load_timeout_s=1e-9)  # past its limit before the first page
    assert late.load(keys_of(pages[:3]), tokens_of(pages[:3])) == []
    assert late.stats().errors == 1


# ---- disk budget and concurrency -----------------------------------------------------------------------------------


def test_disk_budget_evicts_the_least_recently_used_file(tmp_path, open_tiers):
    page_format = make_format()
    a, b, c, d = make_pages(page_format, 4)
    file_size, _ = write_page_file(str(tmp_path / "probe.arrow"), a, TierKey.generate())
    tier = DiskTier(tmp_path / "kv", page_format, budget_bytes=int(3.5 * file_size))
    open_tiers.append(tier)
    for page in (a, b, c):
        tier.store([page])
        tier.flush(timeout=10)
    assert len(tier.load([a.key], [a.token_ids])) == 1  # a is now the most recently used

    tier.store([d])
    tier.flush(timeout=10)

    present = [page.key for page in (a, b, c, d) if os.path.exists(tier.page_path(page.key))]
    assert present == [a.key, c.key, d.key]
    assert tier.stats().pages_evicted == 1
    assert tier.total_bytes_estimate == sum(os.path.getsize(tier.page_path(key)) for key in present)


def chained(pages, priority=0, retain_until=0.0, retained_from=0):
    """``pages`` with their parent keys, pages ``retained_from`` on carrying the retention (as the fetcher stores
    them)."""
    return [dataclasses.replace(page, parent_key=pages[index - 1].key if index else None,
                                retention_priority=priority if index >= retained_from else 0,
                                retain_until=retain_until if index >= retained_from else 0.0)
            for index, page in enumerate(pages)]


def present_pages(tier, pages):
    return {page.key for page in pages if os.path.exists(tier.page_path(page.key))}


def test_disk_eviction_combines_chain_tails_first_with_retention(tmp_path, open_tiers):
    import time as time_module

    page_format = make_format()
    tier_key = TierKey.generate()
    size, _ = write_page_file(str(tmp_path / "probe.arrow"), make_pages(page_format, 1)[0], tier_key)
    wall = [time_module.time()]
    tier = DiskTier(tmp_path / "kv", page_format, budget_bytes=int(8.5 * size), evict_to_fraction=1.0,
                    tier_key=tier_key, wall_clock=lambda: wall[0])
    open_tiers.append(tier)
    retained = chained(make_pages(page_format, 3, seed=1), priority=50, retain_until=wall[0] + 60)  # oldest
    plain = chained(make_pages(page_format, 3, seed=2))
    mixed = chained(make_pages(page_format, 2, seed=3), priority=50, retain_until=wall[0] + 60, retained_from=1)
    for chain in (retained, plain, mixed):  # 8 pages
        tier.store(chain)
        tier.flush(timeout=10)

    flood = chained(make_pages(page_format, 5, seed=4))
    tier.store(flood)  # 8 + 5 > 8.5: five go
    tier.flush(timeout=10)
    # the newer plain chain goes first (tail first), then the retained chain's tail (r2, r1: older than m1); the
    # plain m0 stays because its retained child m1 does (never an orphan), and r0 stays as the chain's head
    assert present_pages(tier, retained + plain + mixed) == {retained[0].key, mixed[0].key, mixed[1].key}
    assert tier.stats().pages_evicted == 5

    wall[0] += 120  # the retentions have ended: LRU over the leaves again (r0 oldest, then m1; m0 keeps its turn)
    tier.store(chained(make_pages(page_format, 2, seed=5)))  # 3 + 5 + 2 > 8.5: two go
    tier.flush(timeout=10)
    assert present_pages(tier, retained + mixed + flood) == {mixed[0].key} | set(keys_of(flood))
    assert tier.stats().pages_evicted == 7
    assert len(tier.load(keys_of(flood), tokens_of(flood))) == 5


def test_disk_restore_merges_retention_into_the_row(tmp_path, open_tiers):
    import sqlite3
    import time as time_module

    page_format = make_format()
    tier_key = TierKey.generate()
    size, _ = write_page_file(str(tmp_path / "probe.arrow"), make_pages(page_format, 1)[0], tier_key)
    tier = DiskTier(tmp_path / "kv", page_format, budget_bytes=int(3.5 * size), evict_to_fraction=1.0,
                    tier_key=tier_key)
    open_tiers.append(tier)
    a, b, c, d = make_pages(page_format, 4)  # separate chains (no parent keys): all leaves
    until = time_module.time() + 3600
    for page in (a, b, c):
        tier.store([page])
        tier.flush(timeout=10)
    tier.store([dataclasses.replace(a, retention_priority=30, retain_until=until)])  # a is there: its row changes
    tier.flush(timeout=10)
    tier.store([dataclasses.replace(a, retention_priority=20, retain_until=until + 1)])  # weaker: ignored
    tier.store([b])  # plain: b is the most recently used; a keeps its retention
    tier.flush(timeout=10)

    index = sqlite3.connect(str(tmp_path / "kv" / "index.sqlite"))
    rows = dict(((row[0], row[1:]) for row in index.execute("SELECT id, priority, retain_until FROM pages")))
    index.close()
    assert rows[tier.page_id(a.key)] == (30, until)
    assert rows[tier.page_id(b.key)] == (0, 0.0)

    tier.store([d])  # a is the least recently used but retained: c (plain, older than b) goes
    tier.flush(timeout=10)
    assert present_pages(tier, (a, b, c, d)) == {a.key, b.key, d.key}


def test_disk_index_of_an_older_schema_is_migrated_a_newer_refused_a_broken_one_recreated(tmp_path, open_tiers,
                                                                                       caplog):
    import sqlite3

    page_format = make_format()
    tier_key = TierKey.generate()
    root = tmp_path / "kv"
    pages = make_pages(page_format, 2)
    first = DiskTier(root, page_format, budget_bytes=1 << 30, tier_key=tier_key)
    first.store(pages)
    first.flush(timeout=10)
    first.close()
    index_path = str(root / "index.sqlite")
    index = sqlite3.connect(index_path, isolation_level=None)  # back to schema version 1 (no retention columns)
    index.execute("ALTER TABLE pages DROP COLUMN priority")
    index.execute("ALTER TABLE pages DROP COLUMN retain_until")
    index.execute("PRAGMA user_version = 0")
    index.close()

    migrated = DiskTier(root, page_format, budget_bytes=1 << 30, tier_key=tier_key)
    open_tiers.append(migrated)
    assert_bit_identical(migrated.load(keys_of(pages), tokens_of(pages)), pages)
    migrated.store([dataclasses.replace(make_pages(page_format, 1, seed=9)[0], retention_priority=5,
                                        retain_until=float("inf"))])
    migrated.flush(timeout=10)
    index = sqlite3.connect(index_path, isolation_level=None)
    assert index.execute("PRAGMA user_version").fetchone()[0] == 2
    assert sorted(row[0] for row in index.execute("SELECT priority FROM pages")) == [0, 0, 5]
    assert index.execute("SELECT retain_until FROM pages WHERE priority = 5").fetchone()[0] == float("inf")
    index.execute("PRAGMA user_version = 3")  # written by a newer version
    index.close()
    migrated.close()

    with caplog.at_level(logging.ERROR):
        newer = DiskTier(root, page_format, budget_bytes=1 << 30, tier_key=tier_key)
    open_tiers.append(newer)
    assert newer.refused and not newer.available and "schema version 3" in caplog.text
    assert newer.load(keys_of(pages), tokens_of(pages)) == []

    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(index_path + suffix):
            os.remove(index_path + suffix)
    with open(index_path, "wb") as garbage:
        garbage.write(b"not a database" * 100)
    recreated = DiskTier(root, page_format, budget_bytes=1 << 30, tier_key=tier_key)
    open_tiers.append(recreated)
    assert recreated.available and recreated.total_bytes_estimate == 0  # its unindexed files were deleted
    assert not os.path.exists(recreated.page_path(pages[0].key))
    recreated.store(pages)
    recreated.flush(timeout=10)
    assert_bit_identical(recreated.load(keys_of(pages), tokens_of(pages)), pages)


def test_disk_index_write_raises_the_block_s_error_after_sqlite_rolled_back_itself(tmp_path):
    """SQLite ends a transaction itself on some errors (I/O, corruption, a full disk); the error that reaches the
    caller (and the tier's log) must be that one, not a failed ROLLBACK of a transaction that no longer exists."""
    from replica.tiers.disk_tier import PageIndex

    index = PageIndex(str(tmp_path / "index.sqlite"))
    with pytest.raises(ValueError, match="the block's own error"):
        with index.write() as cursor:
            cursor.execute("ROLLBACK")  # as SQLite does on SQLITE_IOERR / SQLITE_CORRUPT / SQLITE_FULL
            raise ValueError("the block's own error")
    with index.write() as cursor:  # the index is usable afterwards
        cursor.execute("INSERT INTO pages (id, parent, size, last_used) VALUES ('a', NULL, 1, 1)")
    with pytest.raises(ValueError):
        with index.write() as cursor:
            cursor.execute("INSERT INTO pages (id, parent, size, last_used) VALUES ('b', NULL, 1, 2)")
            raise ValueError("rolled back")
    with index.write() as cursor:
        assert [row[0] for row in cursor.execute("SELECT id FROM pages")] == ["a"]


def test_disk_tier_rescans_its_folder_on_start(tmp_path, open_tiers):
    page_format = make_format()
    tier_key = TierKey.generate()
    first = DiskTier(tmp_path / "kv", page_format, budget_bytes=1 << 30, tier_key=tier_key)
    open_tiers.append(first)
    pages = make_pages(page_format, 3)
    first.store(pages)
    first.flush(timeout=10)

    second = DiskTier(tmp_path / "kv", page_format, budget_bytes=1 << 30, tier_key=tier_key)
    open_tiers.append(second)

    assert second.total_bytes_estimate == first.total_bytes_estimate > 3 * page_format.page_num_bytes
    assert_bit_identical(second.load(keys_of(pages), tokens_of(pages)), pages)


def test_threads_writing_the_same_page_leave_one_whole_file(tmp_path):
    page_format = make_format()
    page = make_pages(page_format, 1)[0]
    path = str(tmp_path / "page.arrow")
    tier_key = TierKey.generate()
    write_page_file(path, page, tier_key)
    read_failures = []

    def write_repeatedly():
        for _ in range(15):
            write_page_file(path, page, tier_key)

    def read_repeatedly():
        for _ in range(30):
            try:
                read_page_file(path, page_format, tier_key, page.key, page.token_ids)
            except Exception as exc:  # a torn file would show up here
                read_failures.append(exc)

    threads = [threading.Thread(target=write_repeatedly) for _ in range(3)] + [threading.Thread(target=read_repeatedly)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert read_failures == []
    assert os.listdir(tmp_path) == ["page.arrow"]
    assert_bit_identical([read_page_file(path, page_format, tier_key, page.key, page.token_ids)], [page])


SHARED_SECRET = b"0123456789abcdef0123456789abcdef-test-only"


def _store_in_child(root, page_format, page):
    tier = DiskTier(root, page_format, budget_bytes=1 << 30, tier_key=TierKey(SHARED_SECRET))
    tier.store([page])
    tier.flush(timeout=10)
    tier.close()
    os._exit(0 if tier.stats().pages_stored == 1 else 1)


def test_two_processes_storing_the_same_page_leave_one_readable_file(tmp_path, open_tiers):
    page_format = make_format()
    page = make_pages(page_format, 1)[0]
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_store_in_child, args=(str(tmp_path), page_format, page)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=30)

    assert [child.exitcode for child in children] == [0, 0]
    tier = DiskTier(tmp_path, page_format, budget_bytes=1 << 30, tier_key=TierKey(SHARED_SECRET))
    open_tiers.append(tier)
    folder = os.path.dirname(tier.page_path(page.key))
    assert os.listdir(folder) == [os.path.basename(tier.page_path(page.key))]
    assert_bit_identical(tier.load([page.key], [page.token_ids]), [page])


# ---- queue and lifecycle -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_full_store_queue_drops_and_counts(make_tier, kind):
    page_format = make_format()
    tier = make_tier(kind, page_format, queue_size=2)
    pages = make_pages(page_format, 5)

    assert tier.store(pages) == 2
    assert tier.flush(timeout=10)

    stats = tier.stats()
    assert (stats.pages_stored, stats.pages_dropped) == (2, 3)
    assert tier.lookup(keys_of(pages)) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_closed_tier_misses_and_drops(make_tier, kind):
    page_format = make_format()
    tier = make_tier(kind, page_format)
    pages = make_pages(page_format, 2)
    tier.store(pages)
    tier.close()

    assert tier.stats().pages_stored == 2  # close finished the queued writes
    assert not tier.available
    assert tier.lookup(keys_of(pages)) == 0
    assert tier.load(keys_of(pages), tokens_of(pages)) == []
    assert tier.store(pages) == 0
    assert tier.stats().pages_dropped == 2
    tier.close()  # idempotent


@pytest.mark.parametrize("kind", KINDS)
def test_programming_errors_raise_value_error(make_tier, kind):
    page_format = make_format()
    tier = make_tier(kind, page_format)
    pages = make_pages(page_format, 2)
    with pytest.raises(ValueError):
        tier.store(make_pages(make_format(model_fingerprint="other"), 1))
    with pytest.raises(ValueError):
        tier.load(keys_of(pages), tokens_of(pages)[:1])
    with pytest.raises(ValueError):
        tier.load(keys_of(pages)[:1], [pages[0].token_ids[:5]])


# ---- Redis faults --------------------------------------------------------------------------------------------------


def test_redis_outage_answers_misses_then_recovers_on_the_same_port(redis_process_factory, open_tiers, caplog):
    server = redis_process_factory()
    clock = FakeClock()
    page_format = make_format()
    tier = RedisTier(server.url, page_format, backoff=BackoffPolicy(initial_s=1.0, max_s=1.0), clock=clock)
    open_tiers.append(tier)
    pages = make_pages(page_format, 2)
    tier.store(pages)
    tier.flush(timeout=10)
    assert tier.lookup(keys_of(pages)) == 2

    with caplog.at_level(logging.WARNING, logger="replica.tiers.redis_tier"):
        server.stop()
        assert tier.lookup(keys_of(pages)) == 0  # tries, fails: error 1, goes down
        assert not tier.available
        assert tier.load(keys_of(pages), tokens_of(pages)) == []  # backing off: no attempt
        assert tier.store(pages) == 2
        assert tier.flush(timeout=10)  # the writer drops them
        assert (tier.stats().errors, tier.stats().pages_dropped) == (1, 2)

        clock.advance(1.0)
        assert tier.lookup(keys_of(pages)) == 0  # one probe, still down: error 2
        server.start()
        assert tier.lookup(keys_of(pages)) == 0  # still backing off
        clock.advance(1.0)
        assert tier.lookup(keys_of(pages)) == 0  # reconnected; the restarted server is empty
        assert tier.available

    tier.store(pages)
    tier.flush(timeout=10)
    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages)
    stats = tier.stats()
    assert (stats.errors, stats.pages_dropped, stats.pages_stored) == (2, 2, 4)
    messages = [record.getMessage() for record in caplog.records]
    assert sum("is unreachable" in message for message in messages) == 1
    assert sum("reachable again" in message for message in messages) == 1


def test_redis_unreachable_at_start_does_not_raise(open_tiers):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    page_format = make_format()
    tier = RedisTier(f"redis://127.0.0.1:{free_port}/0", page_format, clock=FakeClock())
    open_tiers.append(tier)
    pages = make_pages(page_format, 1)

    assert not tier.available
    assert tier.lookup(keys_of(pages)) == 0
    assert tier.load(keys_of(pages), tokens_of(pages)) == []
    assert tier.store(pages) == 1 and tier.flush(timeout=10)
    stats = tier.stats()
    assert (stats.errors, stats.pages_dropped) == (1, 1)


# ---- the Redis reply reader (pages read straight off the socket) ---------------------------------------------------


def test_redis_load_with_a_gap_returns_the_leading_pages_and_keeps_its_connection(redis_process_factory, open_tiers):
    """A reply larger than the reader's buffer (values arrive in pieces, the buffer is compacted), a missing page in
    the middle (the rest of the reply is read and dropped), and the same connections serving the next loads: none is
    closed or reopened. Checked on the tier's own connection pool (each connection keeps its socket), not by the
    server's count of connections received, which also counts any other client that happens to connect (a CI run saw
    one between two counts on a server of the test's own). Socket timeouts are long and sweeps off: a timeout under a
    loaded CI box also reopens a connection, and that is not what this test is about."""
    page_format = make_format()
    tier = RedisTier(redis_process_factory().url, page_format, tier_key=TierKey.generate(), socket_timeout_s=10.0,
                     sweep_interval_s=float("inf"))
    open_tiers.append(tier)
    pages = make_pages(page_format, 6)
    tier.store(pages[:3] + pages[4:])
    assert tier.flush(timeout=10)

    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages[:3])
    sockets_before = pool_sockets(tier)
    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages[:3])
    tier.store(pages[3:4])
    assert tier.flush(timeout=10)
    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages)
    assert tier.stats().errors == 0
    sockets_after = pool_sockets(tier)
    assert all(sockets_after[connection] is sock for connection, sock in sockets_before.items())  # none reopened
    assert None not in sockets_after.values() and len(sockets_after) <= 2  # none closed; one per load thread at most


def pool_sockets(tier: RedisTier) -> dict[int, object]:
    """Each connection of the tier's pool (free or in use) and the socket it holds (None when disconnected)."""
    pool = tier._client.connection_pool
    connections = list(pool._available_connections) + list(pool._in_use_connections)
    return {id(connection): connection._sock for connection in connections}


def test_redis_load_reads_its_two_halves_on_two_connections_and_keeps_the_leading_run(redis_process_factory,
                                                                                      open_tiers):
    """A load of PARALLEL_MIN_PAGES pages or more is read in two halves at the same time (each half's GETs pipelined:
    these pages are small, so a half is asked for at once); the second half counts only after a whole first half,
    and a gap in either half ends the answer there. On a redis-server of its own: the server's GET count would also
    count other tests' clients on the session's server."""
    from replica.tiers.redis_tier import PARALLEL_MIN_PAGES

    page_format = make_format()
    tier = RedisTier(redis_process_factory().url, page_format, tier_key=TierKey.generate(), socket_timeout_s=10.0)
    open_tiers.append(tier)
    pages = make_pages(page_format, 8)
    assert PARALLEL_MIN_PAGES <= len(pages)
    tier.store(pages[:1] + pages[2:])  # page 1 (first half) missing
    assert tier.flush(timeout=10)
    server = redis.Redis.from_url(tier.url)
    server.config_resetstat()

    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages[:1])  # pages 4-7 arrived, not counted
    assert server.info("commandstats")["cmdstat_get"]["calls"] == 8
    assert tier.stats().pages_loaded == 1

    tier.store(pages[1:2])
    assert tier.flush(timeout=10)
    server.delete(tier.redis_key(pages[6].key))  # now a gap in the second half
    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages[:6])
    assert_bit_identical(tier.load(keys_of(pages[:3]), tokens_of(pages[:3])), pages[:3])  # under the minimum: one part
    assert server.info("commandstats")["cmdstat_get"]["calls"] == 8 + 8 + 3
    assert "cmdstat_mget" not in server.info("commandstats")
    assert tier.stats().errors == 0


def test_redis_load_in_four_parts_keeps_the_leading_run(redis_process_factory, open_tiers):
    """``load_connections=4``: 12 pages read as four parts of 3 at once; a gap in the third part ends the answer
    there, whatever the fourth part brought back. On a redis-server of its own (it counts the GETs)."""
    page_format = make_format()
    tier = RedisTier(redis_process_factory().url, page_format, tier_key=TierKey.generate(), socket_timeout_s=10.0,
                     load_connections=4)
    open_tiers.append(tier)
    pages = make_pages(page_format, 12)
    tier.store(pages[:7] + pages[8:])  # page 7: the third part's second page
    assert tier.flush(timeout=10)
    server = redis.Redis.from_url(tier.url)
    server.config_resetstat()
    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages[:7])
    assert server.info("commandstats")["cmdstat_get"]["calls"] == 12
    tier.store(pages[7:8])
    assert tier.flush(timeout=10)
    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages)
    assert_bit_identical(tier.load(keys_of(pages[:5]), tokens_of(pages[:5])), pages[:5])  # two parts: 3 and 2
    assert server.info("commandstats")["cmdstat_get"]["calls"] == 12 + 12 + 5
    assert tier.stats().errors == 0
    with pytest.raises(ValueError, match="load_connections"):
        RedisTier(tier.url, page_format, load_connections=0)


def test_redis_load_asks_a_window_of_values_ahead_and_drops_only_those_after_a_miss(redis_process_factory,
                                                                                    open_tiers):
    """A load asks for at most ``load_window_bytes`` of values (at least two) beyond the one it reads, not for all of
    them at once: with a window of two and page 3 of 8 missing, GETs 0-5 reach the server (5 was asked as 3 arrived),
    6 and 7 never do; the values of 4 and 5 are read and dropped, and the connection is reused."""
    page_format = make_format()
    tier = RedisTier(redis_process_factory().url, page_format, tier_key=TierKey.generate(), socket_timeout_s=10.0,
                     load_connections=1, load_window_bytes=1)
    open_tiers.append(tier)
    pages = make_pages(page_format, 8)
    tier.store(pages[:3] + pages[4:])
    assert tier.flush(timeout=10)
    server = redis.Redis.from_url(tier.url)
    server.config_resetstat()

    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages[:3])
    assert server.info("commandstats")["cmdstat_get"]["calls"] == 6
    sockets = pool_sockets(tier)
    assert len(sockets) == 1 and None not in sockets.values()
    tier.store(pages[3:4])
    assert tier.flush(timeout=10)
    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages)  # the whole run, two values ahead
    assert server.info("commandstats")["cmdstat_get"]["calls"] == 6 + 8
    assert pool_sockets(tier) == sockets  # the same connection throughout: no reply was left unread
    assert tier.stats().errors == 0


def test_redis_load_of_a_key_holding_another_type_ends_the_run_there(make_tier):
    """A key of the tier's namespace that holds a list (GET answers WRONGTYPE) ends the answer at that page, counted
    as an error; the next load works on a fresh connection."""
    page_format = make_format()
    tier = make_tier("redis", page_format)
    pages = make_pages(page_format, 3)
    tier.store(pages)
    assert tier.flush(timeout=10)
    server = redis.Redis.from_url(tier.url)
    server.delete(tier.redis_key(pages[1].key))
    server.rpush(tier.redis_key(pages[1].key), b"x")

    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages[:1])
    assert tier.stats().errors == 1
    assert_bit_identical(tier.load(keys_of(pages[:1]), tokens_of(pages[:1])), pages[:1])


def test_redis_oversized_value_is_discarded_without_reading_it(make_tier):
    page_format = make_format()
    tier = make_tier("redis", page_format)
    pages = make_pages(page_format, 3)
    tier.store(pages)
    assert tier.flush(timeout=10)
    redis.Redis.from_url(tier.url).set(tier.redis_key(pages[1].key), b"\0" * (4 << 20))

    assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages[:1])
    assert tier.stats().discarded_corrupt == 1 and not entry_exists(tier, pages[1].key)
    assert_bit_identical(tier.load(keys_of(pages[:1]), tokens_of(pages[:1])), pages[:1])  # a fresh connection


def reply_reader_over(data: bytes, buffer_bytes: int = 64, chunk: int = 3):
    """A ReplyReader over a socket pair whose other end sends ``data`` ``chunk`` bytes at a time."""
    from replica.tiers.redis_tier import ReplyReader

    ours, theirs = socket.socketpair()
    ours.settimeout(5)

    def send() -> None:
        for start in range(0, len(data), chunk):
            theirs.sendall(data[start : start + chunk])

    sender = threading.Thread(target=send)
    sender.start()
    return ReplyReader(ours, bytearray(buffer_bytes)), sender, (ours, theirs)


def test_reply_reader_parses_resp2_and_resp3_nulls_across_partial_reads():
    from replica.tiers.redis_tier import OVERSIZED

    data = b"*5\r\n$5\r\nhello\r\n$-1\r\n_\r\n$0\r\n\r\n$40\r\n" + b"x" * 40 + b"\r\n"
    reader, sender, sockets = reply_reader_over(data)
    try:
        assert reader.array_length() == 5
        assert bytes(reader.bulk(32)) == b"hello"
        assert reader.bulk(32) is None and reader.bulk(32) is None
        assert bytes(reader.bulk(32)) == b""
        assert reader.bulk(32) is OVERSIZED  # longer than the caller accepts: not read
    finally:
        sender.join()
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize("data, error", [
    (b"-WRONGTYPE Operation against a key\r\n", redis.ResponseError),
    (b"+OK\r\n", ValueError),
    (b"*1\r\n:12\r\n", ValueError),
    (b"*1\r\n$3\r\nabcXY", ValueError),  # no CRLF after the value
    (b"*1\r\n$" + b"9" * 80 + b"\r\n", ValueError),  # header line too long
])
def test_reply_reader_rejects_what_is_not_an_mget_reply(data, error):
    reader, sender, sockets = reply_reader_over(data)
    try:
        with pytest.raises(error):
            reader.array_length()
            reader.bulk(32)
    finally:
        sender.join()
        for sock in sockets:
            sock.close()


def test_reply_reader_raises_when_the_server_closes_mid_reply():
    reader, sender, (ours, theirs) = reply_reader_over(b"*1\r\n$10\r\nabc")
    sender.join()
    theirs.close()
    try:
        assert reader.array_length() == 1
        with pytest.raises(ConnectionError):
            reader.bulk(32)
    finally:
        ours.close()


def test_the_tier_writer_thread_yields_the_cpu_to_the_engine():
    """Sealing and sending pages runs below the process's other threads (nice + WRITER_NICE)."""
    import os
    import threading

    from replica.tiers.writer import WRITER_NICE, BackgroundWriter

    seen = []

    def write_pages(batch):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    writer = BackgroundWriter(name="test", write_pages=write_pages, on_failure=lambda batch: None, capacity=4)
    try:
        assert writer.submit(["page"]) == 1 and writer.flush(10)
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert seen == [min(own + WRITER_NICE, 19)]
    finally:
        writer.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_load_into_pool_pages_writes_those_pages_and_nothing_else(make_tier, kind, dtype):
    """``load(..., out=...)`` with pages of a KV pool (views whose layers lie apart, replica/landing.py): the pages
    found are decrypted there, bit-identical, and returned as those very tensors; the load stops at an entry with
    other tokens; no other byte of the pool changes. Five pages: Redis reads them in two parts at once."""
    page_format = make_format(dtype)
    tier = make_tier(kind, page_format)
    pages = make_pages(page_format, 5)
    tier.store(pages[:4])
    assert tier.flush(timeout=10)
    plant_entry(tier, pages[4].key, make_pages(page_format, 1, seed=9)[0])  # page 4's key, other tokens
    num_layers, _, page_size, num_kv_heads, head_dim = page_format.kv_shape
    pool = torch.full((num_layers, 2, 12, page_size, num_kv_heads, head_dim), 7.0, dtype=getattr(torch, dtype))
    slots = [9, 2, 5, 0, 11]
    out = [pool[:, :, slot] for slot in slots]
    assert not out[0].is_contiguous()

    loaded = tier.load(keys_of(pages), tokens_of(pages), out)

    assert len(loaded) == 4 and all(kv is view for kv, view in zip(loaded, out))
    assert_bit_identical([pool[:, :, slot] for slot in slots[:4]], pages[:4])
    untouched = [slot for slot in range(12) if slot not in slots]
    assert bool((pool[:, :, untouched] == 7.0).all())
    assert bool((pool[:, :, slots[4]] == 7.0).all())  # the entry with other tokens is rejected before decrypting
    with pytest.raises(ValueError, match="tensors to load into"):
        tier.load(keys_of(pages), tokens_of(pages), out[:2])
    with pytest.raises(ValueError, match="shape"):
        tier.load(keys_of(pages[:1]), tokens_of(pages[:1]), [pool[:1, :, 0]])
