"""Page pool, prefix cache and KV manager: exact page ids and free-queue order (no model, no Ray)."""

import pytest

from common.events import AllPagesCleared, PagesRemoved, PagesStored
from replica.kv_manager import KVCacheManager
from common.page_keys import compute_page_keys, hash_page
from replica.page_pool import OutOfPagesError, PagePool
from replica.prefix_cache import PrefixCache

FP = "test-model"


def keys_for(tokens, page_size=128, salt=None):
    return compute_page_keys(tokens, page_size=page_size, model_fingerprint=FP, salt=salt)


def test_allocate_takes_from_head_in_id_order():
    pool = PagePool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.free_queue_order() == [2, 3]
    assert pool.refcounts == [1, 1, 0, 0]
    pool.check_integrity()


def test_release_cached_goes_to_tail_uncached_to_head():
    pool = PagePool(4)
    pool.allocate(4)
    pool.release(1, keep_contents=True)
    pool.release(3, keep_contents=True)
    pool.release(0, keep_contents=False)
    assert pool.free_queue_order() == [0, 1, 3]
    assert pool.allocate(2) == [0, 1]
    pool.check_integrity()


def test_acquire_removes_from_middle_of_free_queue():
    pool = PagePool(3)
    pool.allocate(3)
    for page_id in (0, 1, 2):
        pool.release(page_id, keep_contents=True)
    pool.acquire(1)
    assert pool.free_queue_order() == [0, 2]
    pool.acquire(1)
    assert pool.refcounts == [0, 2, 0]
    pool.release(1, keep_contents=True)
    assert pool.free_queue_order() == [0, 2]
    pool.release(1, keep_contents=True)
    assert pool.free_queue_order() == [0, 2, 1]
    pool.check_integrity()


def test_out_of_pages_and_double_release_raise():
    pool = PagePool(2)
    pool.allocate(2)
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    pool.release(0, keep_contents=False)
    with pytest.raises(RuntimeError):
        pool.release(0, keep_contents=False)


def test_page_keys_chain_salt_and_stability():
    tokens = list(range(300))
    keys = keys_for(tokens)
    assert len(keys) == 2  # 300 tokens = 2 full pages + a partial one
    assert keys[0] == hash_page(None, tokens[:128], page_size=128, model_fingerprint=FP)
    assert keys[1] == hash_page(keys[0], tokens[128:256], page_size=128, model_fingerprint=FP)
    # a different first page changes every later key (the chain)
    other = keys_for([7] + tokens[1:])
    assert other[0] != keys[0] and other[1] != keys[1]
    # salt isolates tenants; same salt agrees
    assert keys_for(tokens, salt="a")[1] != keys[1]
    assert keys_for(tokens, salt="a") == keys_for(tokens, salt="a")


def test_page_key_is_deterministic_across_processes():
    import subprocess
    import sys

    code = (
        "from common.page_keys import compute_page_keys;"
        "print(compute_page_keys(list(range(128)), page_size=128, model_fingerprint='test-model')[0].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.stdout.strip() == keys_for(list(range(128)))[0].hex()


def test_prefix_cache_match_stops_at_first_miss():
    cache = PrefixCache()
    keys = keys_for(list(range(512)))
    cache.insert(keys[0], 5, range(128))
    cache.insert(keys[2], 7, range(256, 384))
    assert cache.match(keys) == [5]
    cache.insert(keys[1], 6, range(128, 256))
    assert cache.match(keys) == [5, 6, 7]
    assert cache.remove(6) == keys[1]
    assert cache.match(keys) == [5]
    cache.check_integrity()


def test_manager_hit_evict_and_events():
    kv = KVCacheManager(num_pages=4, page_size=128)
    tokens = list(range(256))
    keys = keys_for(tokens)
    pages = kv.allocate(2)
    assert pages == [0, 1]
    kv.commit_page(0, keys[0], tokens[:128])
    kv.commit_page(1, keys[1], tokens[128:])
    kv.release(pages)
    # released last page first: page 1 is reused before page 0
    assert kv.pool.free_queue_order() == [2, 3, 1, 0]
    assert kv.match_prefix(keys) == [0, 1]
    assert kv.num_free_after_acquiring([0, 1]) == 2
    # allocating 3 pages evicts cached page 1 (after the two never-used ones)
    assert kv.allocate(3) == [2, 3, 1]
    assert kv.match_prefix(keys) == [0]
    assert kv.num_evictions == 1
    events = kv.drain_events()
    assert events == [PagesStored(seq=1, keys=(keys[0], keys[1])), PagesRemoved(seq=2, keys=(keys[1],))]
    kv.check_integrity([[2, 3, 1]])


def test_manager_commit_deduplicates_concurrent_copies():
    kv = KVCacheManager(num_pages=4, page_size=128)
    tokens = list(range(128))
    key = keys_for(tokens)[0]
    a, b = kv.allocate(1)[0], kv.allocate(1)[0]
    assert kv.commit_page(a, key, tokens).page_id == a
    result = kv.commit_page(b, key, tokens)
    assert (result.page_id, result.deduplicated) == (a, True)
    assert kv.pool.refcounts[a] == 2 and kv.pool.refcounts[b] == 0
    # the duplicate holds nothing worth keeping: it is reused first
    assert kv.pool.free_queue_order()[0] == b
    kv.check_integrity([[a], [a]])


def test_manager_caching_off_never_matches():
    kv = KVCacheManager(num_pages=2, page_size=128, enable_prefix_caching=False)
    tokens = list(range(128))
    key = keys_for(tokens)[0]
    page = kv.allocate(1)
    kv.commit_page(page[0], key, tokens)
    kv.release(page)
    assert kv.match_prefix([key]) == []
    assert kv.num_cached_pages == 0
    assert kv.drain_events() == []


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_pages=2, page_size=128)
    tokens = list(range(128))
    key = keys_for(tokens)[0]
    page = kv.allocate(1)
    kv.commit_page(page[0], key, tokens)
    assert kv.reset_prefix_cache() is False
    kv.release(page)
    assert kv.reset_prefix_cache() is True
    assert kv.match_prefix([key]) == []
    assert kv.drain_events()[-1] == AllPagesCleared(seq=2)
    kv.check_integrity()


# ---- segmented LRU: pages reused at least once are evicted after pages never reused --------------------------------
def filled_pool(num_pages, protected_fraction, clock=None):
    """A pool whose pages all hold cached contents and were released in id order (page 0 released first)."""
    pool = PagePool(num_pages, protected_fraction=protected_fraction, **({"clock": clock} if clock else {}))
    pool.allocate(num_pages)
    for page_id in range(num_pages):
        pool.release(page_id, keep_contents=True)
    return pool


def hit(pool, *page_ids, reuse=True):
    for page_id in page_ids:
        pool.acquire(page_id, reuse=reuse)
    for page_id in page_ids:
        pool.release(page_id, keep_contents=True)


def test_reused_pages_are_evicted_after_pages_never_reused():
    pool = filled_pool(6, 0.5)
    hit(pool, 0, 1)  # a later request reused pages 0 and 1 (the oldest)
    assert pool.free_queue_order() == [2, 3, 4, 5, 0, 1]
    assert pool.allocate(4) == [2, 3, 4, 5]
    assert pool.allocate(1) == [0]  # only then the protected pages, least recently released first
    pool.check_integrity()
    # plain LRU (fraction 0): the same history evicts the reused pages in release order
    lru = filled_pool(6, 0.0)
    hit(lru, 0, 1)
    assert lru.free_queue_order() == [2, 3, 4, 5, 0, 1]
    hit(lru, 2)
    assert lru.free_queue_order() == [3, 4, 5, 0, 1, 2]
    segmented = filled_pool(6, 0.5)
    hit(segmented, 0, 1)
    hit(segmented, 2)
    assert segmented.free_queue_order() == [3, 4, 5, 0, 1, 2]
    hit(segmented, 5, reuse=False)  # a peer's export reads page 5: it stays on probation, at its tail
    assert segmented.free_queue_order() == [3, 4, 5, 0, 1, 2]
    lru.check_integrity()
    segmented.check_integrity()


def test_protected_queue_is_bounded_and_sends_its_oldest_back_to_probation():
    pool = filled_pool(8, 0.25)  # at most 2 protected pages
    hit(pool, 0)
    hit(pool, 1)
    hit(pool, 2)  # the third reused page pushes page 0, the oldest protected, back to the tail of probation
    assert pool.free_queue_order() == [3, 4, 5, 6, 7, 0, 1, 2]
    assert pool.num_protected_demoted == 1 and pool.reused[0] is False
    assert pool.allocate(6) == [3, 4, 5, 6, 7, 0]
    pool.check_integrity()
    # page 0 must be reused again to be protected again
    pool.release(0, keep_contents=True)
    assert pool.free_queue_order() == [0, 1, 2]


def test_fresh_and_dropped_contents_forget_reuse_and_mark_reused_protects():
    pool = filled_pool(4, 1.0)
    hit(pool, 0)
    assert pool.allocate(4) == [1, 2, 3, 0]  # page 0 refilled: no longer reused
    for page_id in range(4):
        pool.release(page_id, keep_contents=True)
    assert pool.free_queue_order() == [0, 1, 2, 3]
    pool.allocate(4)
    pool.mark_reused(2)  # filled from a peer or a tier for a request
    pool.acquire(1)
    pool.release(1, keep_contents=True)
    pool.release(1, keep_contents=False)  # dropped contents: head of everything, reuse forgotten
    for page_id in (0, 2, 3):
        pool.release(page_id, keep_contents=True)
    assert pool.free_queue_order() == [1, 0, 3, 2]
    assert pool.reused == [False, False, True, False]
    pool.check_integrity()


def test_segmented_lru_with_retention_and_ttl():
    now = [0.0]
    pool = filled_pool(6, 0.5, clock=lambda: now[0])
    hit(pool, 1)
    assert pool.retain(3, 50, ttl_s=10.0)
    assert pool.free_queue_order() == [0, 2, 4, 5, 1, 3]  # probation, protected, retained
    assert pool.retain(1, 60, ttl_s=5.0)  # a protected page retained moves to its level
    assert pool.free_queue_order() == [0, 2, 4, 5, 3, 1]
    now[0] = 6.0  # page 1's TTL passes: it is the first cached page to go (reason "ttl")
    assert pool.free_queue_order() == [1, 0, 2, 4, 5, 3]
    assert pool.unretain(3)  # a never-reused retained page goes to the tail of probation
    assert pool.free_queue_order() == [1, 0, 2, 4, 5, 3]
    hit(pool, 4)
    assert pool.retain(4, 10, ttl_s=None) and pool.unretain(4)  # a reused one back to the protected tail
    assert pool.free_queue_order() == [1, 0, 2, 5, 3, 4]
    pool.check_integrity()


def test_protected_fraction_is_checked():
    with pytest.raises(ValueError, match="protected_fraction"):
        PagePool(4, protected_fraction=1.5)


def test_manager_protects_hits_and_imports_not_exports():
    kv = KVCacheManager(num_pages=6, page_size=128, protected_fraction=0.5)
    tokens = list(range(128 * 3))
    keys = keys_for(tokens)
    pages = kv.allocate(3)
    for index, page_id in enumerate(pages):
        kv.commit_page(page_id, keys[index], tokens[index * 128:(index + 1) * 128])
    kv.mark_reused(pages[2])  # as an import of a fetched page does
    kv.release(pages)
    hit_ids = kv.match_prefix(keys[:1])
    kv.acquire(hit_ids)  # a request's hit on page 0
    kv.release(hit_ids)
    export_ids = kv.match_prefix(keys[:2])
    kv.acquire(export_ids, reuse=False)  # a peer's export of pages 0 and 1
    kv.release(export_ids)
    assert kv.pool.free_queue_order() == [3, 4, 5, 1, 2, 0]
    assert kv.allocate(4) == [3, 4, 5, 1]
    kv.check_integrity([[3, 4, 5, 1]])


def test_manager_protects_a_page_computed_again_after_its_eviction():
    """The ghost list: a prefix whose uses are further apart than one turnover of probation is evicted between them,
    so no hit ever protects it; computed again under a key evicted lately, its page enters the cache protected."""
    kv = KVCacheManager(num_pages=2, page_size=128, protected_fraction=0.5)
    tokens = [list(range(start, start + 128)) for start in range(0, 128 * 5, 128)]  # page 0, then one-off pages
    keys = [keys_for(page)[0] for page in tokens]

    def compute(index):
        page_id = kv.allocate(1)[0]
        kv.commit_page(page_id, keys[index], tokens[index])
        kv.release([page_id])
        return page_id

    first = compute(0)
    compute(1)
    compute(2)  # evicts page 0's contents (probation, least recently released)
    assert kv.match_prefix(keys[:1]) == []
    again = compute(0)  # needed again: protected this time
    assert again != first and kv.pool.reused[again] and kv.pool.free_queue_order()[-1] == again
    compute(3)
    compute(4)  # one-off pages now evict around it
    assert kv.match_prefix(keys[:1]) == [again]
    kv.reset_prefix_cache()
    assert not kv._ghosts


def test_a_reset_forgets_reuse_so_empty_pages_never_outlast_cached_ones():
    kv = KVCacheManager(num_pages=6, page_size=128, protected_fraction=0.7)
    tokens = [list(range(start, start + 128)) for start in range(0, 128 * 6, 128)]
    keys = [keys_for(page)[0] for page in tokens]
    pages = kv.allocate(4)
    for index, page_id in enumerate(pages):
        kv.commit_page(page_id, keys[index], tokens[index])
    kv.release(pages)
    kv.acquire(pages)  # all four reused: protected
    kv.release(pages)
    assert kv.pool.num_protected == 4
    assert kv.reset_prefix_cache()
    assert kv.pool.num_protected == 0 and not any(kv.pool.reused)
    assert kv.pool.free_queue_order() == list(range(6))  # every page holds nothing now
    fresh = kv.allocate(2)
    for offset, page_id in enumerate(fresh):
        kv.commit_page(page_id, keys[4 + offset], tokens[4 + offset])
    kv.release(fresh)
    assert kv.allocate(4) == [2, 3, 4, 5]  # the empty pages go first, the cached ones stay
    assert kv.num_evictions == 0
    kv.check_integrity([[2, 3, 4, 5]])
