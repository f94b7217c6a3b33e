"""Retention: eviction order by (priority, LRU), TTL expiry, the retention budget, pins, usage and page-time metrics.

Exact page ids and a fake clock; no model, no Ray.
"""

import pytest

from common.page_keys import compute_page_keys
from common.types import PinPrefix, Retention, SamplingParams
from replica.kv_manager import KVCacheManager
from replica.page_pool import PagePool
from replica.scheduler import Scheduler
from replica.sequence import Sequence

FP = "test-model"
PAGE = 128


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keys_for(tokens, salt=None):
    return compute_page_keys(tokens, page_size=PAGE, model_fingerprint=FP, salt=salt)


def cached_pool(num_pages, clock, budget=None):
    """A pool whose pages 0..n-1 are all cached and released in id order (0 least recently)."""
    pool = PagePool(num_pages, max_retained_pages=budget, clock=clock)
    pool.allocate(num_pages)
    for page_id in range(num_pages):
        pool.release(page_id, keep_contents=True)
    return pool


def test_default_priority_is_plain_lru():
    clock = FakeClock()
    pool = cached_pool(4, clock)
    assert pool.free_queue_order() == [0, 1, 2, 3]
    assert pool.allocate(2) == [0, 1]
    pool.check_integrity()


def test_higher_priority_evicted_after_every_lower_one():
    clock = FakeClock()
    pool = cached_pool(6, clock)
    assert pool.retain(0, 50, ttl_s=60)
    assert pool.retain(1, 100, ttl_s=60)
    assert pool.retain(3, 50, ttl_s=60)
    # priority 0 pages (LRU: 2, 4, 5), then priority 50 (0 released before 3), then 100
    assert pool.free_queue_order() == [2, 4, 5, 0, 3, 1]
    assert pool.allocate(4) == [2, 4, 5, 0]
    assert [(t.page_id, t.priority, t.expired) for t in pool.last_taken][-1] == (0, 50, False)
    pool.check_integrity()


def test_uncached_pages_go_before_retained_ones():
    clock = FakeClock()
    pool = PagePool(3, clock=clock)
    pool.allocate(3)
    pool.release(0, keep_contents=True)
    pool.retain(0, 10, ttl_s=5)
    pool.release(1, keep_contents=False)
    pool.release(2, keep_contents=True)
    assert pool.free_queue_order() == [1, 2, 0]


def test_ttl_expiry_drops_page_to_head_of_lru_and_counts_as_ttl_eviction():
    clock = FakeClock()
    pool = cached_pool(4, clock)
    pool.retain(1, 80, ttl_s=10)
    assert pool.free_queue_order() == [0, 2, 3, 1]
    clock.now += 9.9
    assert pool.free_queue_order() == [0, 2, 3, 1]
    clock.now += 0.2
    # expired: first cached page to go, before the plain LRU ones
    assert pool.free_queue_order() == [1, 0, 2, 3]
    assert pool.allocate(1) == [1]
    assert pool.last_taken[0].expired and pool.last_taken[0].priority == 80
    assert pool.demotions["ttl"] == 1
    pool.check_integrity()


def test_hit_restarts_ttl_and_release_returns_to_its_level():
    clock = FakeClock()
    pool = cached_pool(3, clock)
    pool.retain(0, 50, ttl_s=10)
    clock.now += 8
    pool.acquire(0)
    assert pool.free_queue_order() == [1, 2]
    clock.now += 8  # 16 s after retain, 8 s after the hit
    pool.release(0, keep_contents=True)
    assert pool.free_queue_order() == [1, 2, 0]
    assert pool.priority_of(0) == 50
    clock.now += 2.5
    assert pool.priority_of(0) == 0
    assert pool.free_queue_order() == [0, 1, 2]


def test_in_use_retained_page_expiring_rejoins_plain_lru_on_release():
    clock = FakeClock()
    pool = cached_pool(3, clock)
    pool.retain(2, 50, ttl_s=1)
    pool.acquire(2)
    clock.now += 5
    pool.release(2, keep_contents=True)
    assert pool.free_queue_order() == [0, 1, 2]
    assert pool.allocate(3)[2] == 2 and not pool.last_taken[2].expired  # it expired in use: plain capacity


def test_budget_replaces_lower_priority_and_refuses_otherwise():
    clock = FakeClock()
    pool = cached_pool(5, clock, budget=2)
    assert pool.retain(0, 50, ttl_s=60)
    assert pool.retain(1, 50, ttl_s=30)
    assert not pool.retain(2, 50, ttl_s=60)  # full of equal priority: refused
    assert pool.priority_of(2) == 0
    assert pool.retain(2, 90, ttl_s=60)  # replaces the lowest priority expiring first (page 1)
    assert pool.priority_of(1) == 0 and pool.priority_of(2) == 90
    assert pool.demotions["budget"] == 1
    assert pool.num_retained == 2
    assert pool.free_queue_order() == [3, 4, 1, 0, 2]  # a demoted page joins plain LRU at the tail
    pool.check_integrity()


def test_retained_pages_still_count_free_so_pins_never_block_allocation():
    clock = FakeClock()
    pool = cached_pool(3, clock)
    for page_id in range(3):
        pool.retain(page_id, 100, ttl_s=None)
    assert pool.num_free == 3
    assert pool.allocate(3) == [0, 1, 2]
    assert [t.priority for t in pool.last_taken] == [100, 100, 100]
    pool.check_integrity()


def test_unretain_moves_to_tail_of_plain_lru():
    clock = FakeClock()
    pool = cached_pool(3, clock)
    pool.retain(0, 100, ttl_s=None)
    assert pool.free_queue_order() == [1, 2, 0]
    assert pool.unretain(0)
    assert pool.free_queue_order() == [1, 2, 0]
    assert pool.priority_of(0) == 0 and pool.demotions["unpin"] == 1


# ---- KV manager: retention of cached pages, metrics, pins --------------------------------------------------------
def fill(kv, tokens):
    """Allocate, commit and release the pages of ``tokens`` (one request computing them); returns the page ids."""
    keys = keys_for(tokens)
    pages = kv.allocate(len(keys))
    for index, (page_id, key) in enumerate(zip(pages, keys)):
        pages[index] = kv.commit_page(page_id, key, tokens[index * PAGE:(index + 1) * PAGE]).page_id
    kv.release(pages)
    return pages, keys


def test_manager_metrics_lifetime_idle_reuse_and_eviction_reasons():
    clock = FakeClock()
    kv = KVCacheManager(4, PAGE, clock=clock)
    pinned_tokens = list(range(PAGE))
    (pinned,), _ = fill(kv, pinned_tokens)
    kv.retain([pinned], 60, ttl_s=20)
    clock.now += 3
    kv.acquire([pinned])  # reuse gap 3 s
    clock.now += 1
    kv.release([pinned])
    (other,), _ = fill(kv, [7] * PAGE)
    clock.now += 30  # the retention (last hit at +3 s, ttl 20 s) has expired
    kv.allocate(4)  # evicts both cached pages: the expired one (ttl) and the plain one (capacity)
    metrics = kv.kv_cache_metrics()
    assert metrics.evictions == {("ttl", 60): 1, ("capacity", 0): 1}
    assert metrics.reuse_gap.count == 1 and metrics.reuse_gap.total == pytest.approx(3.0)
    assert metrics.lifetime.count == 2 and metrics.lifetime.total == pytest.approx(34 + 30)
    assert metrics.idle_before_evict.total == pytest.approx(30 + 30)
    assert metrics.retention_demotions == {"ttl": 1}


def test_reset_counts_reset_evictions_by_priority():
    clock = FakeClock()
    kv = KVCacheManager(3, PAGE, clock=clock)
    pages, _ = fill(kv, list(range(2 * PAGE)))
    kv.retain(pages[:1], 40, ttl_s=100)
    assert kv.reset_prefix_cache()
    assert kv.kv_cache_metrics().evictions == {("reset", 40): 1, ("reset", 0): 1}
    assert kv.pool.num_retained == 0
    kv.check_integrity()


def test_admin_pin_applies_now_and_to_pages_cached_later_and_unpin_releases():
    clock = FakeClock()
    kv = KVCacheManager(6, PAGE, clock=clock)
    tokens = list(range(3 * PAGE))
    keys = keys_for(tokens)
    # page 0 cached before the pin; pages 1, 2 come later
    first, _ = fill(kv, tokens[:PAGE])
    resident, retained = kv.pin_prefix(PinPrefix(tuple(keys), priority=100, ttl_s=None, label="sys"))
    assert (resident, retained) == (1, 1)
    pages, _ = fill(kv, tokens)
    assert pages[0] == first[0]  # the recomputed page 0 deduplicated onto the cached one
    cached = kv.match_prefix(keys)
    assert len(cached) == 3 and all(kv.pool.priority_of(page_id) == 100 for page_id in cached)
    # a flood of unique pages evicts everything but the pinned prefix
    for index in range(5):
        fill(kv, [1000 + index] * PAGE)
    assert kv.match_prefix(keys) == cached
    [report] = kv.prefix_reports("r0")
    assert (report.source, report.num_pages, report.num_pages_resident, report.num_pages_retained) == \
           ("admin", 3, 3, 3)
    assert kv.unpin_prefix(report.prefix_id)
    assert all(kv.pool.priority_of(page_id) == 0 for page_id in cached)
    assert kv.prefix_reports("r0") == []
    kv.check_integrity()


def test_a_failed_re_pin_is_taken_back_to_the_earlier_pin_and_a_first_pin_to_nothing():
    """The admin endpoint broadcasts a pin, then warms the prefix; when the warm-up fails it takes that pin back. An
    earlier pin of the same prefix comes back with its priority, TTL and stats, and the tiers hear a release then the
    earlier retention (they keep the stronger of two). A prefix pinned for the first time is unpinned. Of two pins in
    flight, the later stands when the earlier fails, and when both fail the prefix is as before both. After an
    unpin a take-back changes nothing."""
    clock = FakeClock()
    kv = KVCacheManager(8, PAGE, clock=clock)
    tokens = list(range(3 * PAGE))
    keys = keys_for(tokens)
    pages, _ = fill(kv, tokens[:2 * PAGE])
    prefix_id = keys[2].hex()[:32]
    assert kv.pin_prefix(PinPrefix(tuple(keys), priority=60, ttl_s=300, label="sys", pin_id="p0")) == (2, 2)
    kv.registry.observe_request(keys, 3)
    clock.now += 50
    assert kv.pin_prefix(PinPrefix(tuple(keys), priority=100, ttl_s=None, pin_id="a")) == (2, 2)
    assert [kv.pool.priority_of(page_id) for page_id in pages] == [100, 100]
    kv.drain_tier_retention()
    assert kv.take_back_pin(prefix_id, "a")
    [report] = kv.prefix_reports("r0")
    assert (report.source, report.priority, report.ttl_s, report.num_pages_retained, report.num_requests) == \
           ("admin", 60, 300, 2, 1)
    assert [kv.pool.priority_of(page_id) for page_id in pages] == [60, 60]
    assert [kv.pool.retention_of(page_id).expires_at for page_id in pages] == [clock.now + 300] * 2
    assert kv.registry.pin_for(keys[2]) == (60, 300)  # page 2, cached later, takes the earlier pin
    end = clock.now + 300
    assert kv.drain_tier_retention() == [(keys[0], 0, 0.0), (keys[1], 0, 0.0), (keys[2], 0, 0.0),
                                         (keys[0], 60, end), (keys[1], 60, end), (keys[2], 60, end)]
    assert not kv.take_back_pin(prefix_id, "a")  # taken back once
    # a first pin taken back leaves nothing
    assert kv.unpin_prefix(prefix_id)
    assert kv.pin_prefix(PinPrefix(tuple(keys), priority=100, ttl_s=None, pin_id="b")) == (2, 2)
    assert kv.take_back_pin(prefix_id, "b") and kv.prefix_reports("r0") == []
    assert [kv.pool.priority_of(page_id) for page_id in pages] == [0, 0]

    def listed() -> list:
        return [(r.priority, r.ttl_s) for r in kv.prefix_reports("r0")]

    # two pins in flight over an earlier one, both fail, in either order: the earlier one is what stays
    for first, second in (("c", "d"), ("d", "c")):
        kv.pin_prefix(PinPrefix(tuple(keys), priority=40, ttl_s=None, pin_id="e"))
        kv.pin_prefix(PinPrefix(tuple(keys), priority=70, ttl_s=None, pin_id="c"))
        kv.pin_prefix(PinPrefix(tuple(keys), priority=90, ttl_s=None, pin_id="d"))
        assert kv.take_back_pin(prefix_id, first) is (first == "d")
        assert listed() == [(70 if first == "d" else 90, None)]
        assert kv.take_back_pin(prefix_id, second)
        assert listed() == [(40, None)]
        assert [kv.pool.priority_of(page_id) for page_id in pages] == [40, 40]
        assert kv.unpin_prefix(prefix_id)
    # an unpin stands
    kv.pin_prefix(PinPrefix(tuple(keys), priority=70, ttl_s=None, pin_id="f"))
    assert kv.unpin_prefix(prefix_id)
    assert not kv.take_back_pin(prefix_id, "f") and listed() == []
    kv.check_integrity()


def test_retention_changes_reach_the_tier_queue_rate_limited_with_pins_and_unpins():
    import math

    clock = FakeClock()
    kv = KVCacheManager(6, PAGE, clock=clock)
    tokens = list(range(3 * PAGE))
    pages, keys = fill(kv, tokens[:2 * PAGE])
    keys = keys_for(tokens)
    assert kv.drain_tier_retention() == []  # plain pages: nothing for the tiers
    assert kv.retain(pages, 50, ttl_s=100) == 2
    assert kv.drain_tier_retention() == [(keys[0], 50, 1100.0), (keys[1], 50, 1100.0)]
    clock.now += 10
    kv.acquire(pages[:1])  # the TTL restarts (end 1110): moved less than a quarter of it, not re-sent
    kv.release(pages[:1])
    assert kv.drain_tier_retention() == []
    clock.now += 20
    kv.acquire(pages[:1])  # end 1130: 30 s after what the tiers have (>= 25 s)
    kv.release(pages[:1])
    assert kv.drain_tier_retention() == [(keys[0], 50, 1130.0)]
    # an admin pin: the cached pages take it, and page 2 (not cached here; a tier may hold it) is sent as well
    assert kv.pin_prefix(PinPrefix(tuple(keys), priority=100, ttl_s=None, label="sys")) == (2, 2)
    assert kv.drain_tier_retention() == [(keys[0], 100, math.inf), (keys[1], 100, math.inf), (keys[2], 100, math.inf)]
    kv.acquire(pages)  # a pin has no TTL to restart: nothing re-sent
    kv.release(pages)
    assert kv.drain_tier_retention() == []
    assert kv.unpin_prefix(keys[2].hex()[:32])
    assert kv.drain_tier_retention() == [(keys[0], 0, 0.0), (keys[1], 0, 0.0), (keys[2], 0, 0.0)]
    assert kv.retain(pages[:1], 30, ttl_s=10) == 1  # forgotten on unpin: a new retention is sent at once
    assert kv.drain_tier_retention() == [(keys[0], 30, clock.now + 10)]
    kv.check_integrity()


# ---- scheduler: request retention, usage accounting, budget vs running requests ----------------------------------
def make_seq(request_id, tokens, retention=None, arrival=0, max_tokens=1):
    seq = Sequence(request_id, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival,
                   page_keys=keys_for(tokens), retention=retention)
    if retention is not None:
        seq.num_retained_pages = retention.num_pages(len(tokens), PAGE)
    return seq


def run_prefill(scheduler, seq):
    """Admit ``seq``, pretend its whole prompt was computed, commit and finish it."""
    scheduler.add(seq)
    out = scheduler.schedule()
    assert [chunk.seq for chunk in out.chunks] == [seq]
    seq.num_computed_tokens += out.chunks[0].num_new_tokens
    scheduler.commit_computed_pages(seq)
    scheduler.finish(seq, "stop")


def test_request_retention_covers_its_breakpoint_and_survives_a_flood():
    clock = FakeClock()
    kv = KVCacheManager(8, PAGE, clock=clock)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=4096, model_fingerprint=FP)
    system = list(range(3 * PAGE + 10))
    # breakpoint after 2.5 pages: pages 0 and 1 retained, page 2 (partly after the breakpoint) not
    seq = make_seq("a", system, Retention(priority=70, ttl_s=60, num_tokens=2 * PAGE + 64))
    run_prefill(scheduler, seq)
    assert seq.num_cache_write_tokens == 3 * PAGE
    keys = keys_for(system)
    held = kv.match_prefix(keys)
    assert [kv.pool.priority_of(page_id) for page_id in held] == [70, 70, 0]
    for index in range(6):
        run_prefill(scheduler, make_seq(f"flood{index}", [5000 + index] * (PAGE + 1), arrival=index + 1))
    assert kv.match_prefix(keys) == held[:2]
    # a plain request reusing the prefix: cached tokens, nothing new written for the reused pages
    again = make_seq("b", system + [9], arrival=10)
    run_prefill(scheduler, again)
    assert again.num_cached_prompt_tokens == 2 * PAGE
    assert again.num_cache_write_tokens == PAGE  # page 2 was recomputed and cached again
    [report] = kv.prefix_reports("r0")
    assert (report.source, report.num_requests, report.num_hits, report.cached_tokens) == ("request", 1, 1, 2 * PAGE)
    # expiry: 60 s after the last hit the prefix is plain LRU and the next flood evicts it
    clock.now += 61
    for index in range(6):
        run_prefill(scheduler, make_seq(f"late{index}", [7000 + index] * (PAGE + 1), arrival=20 + index))
    assert kv.match_prefix(keys) == []
    assert kv.kv_cache_metrics().evictions[("ttl", 70)] == 2
    kv.check_integrity()


def test_retained_pages_never_block_a_request_that_needs_the_whole_pool():
    clock = FakeClock()
    kv = KVCacheManager(4, PAGE, clock=clock, max_retained_pages=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=4096, model_fingerprint=FP)
    run_prefill(scheduler, make_seq("pin", list(range(3 * PAGE + 1)), Retention(priority=100, ttl_s=None)))
    assert kv.pool.num_retained == 3
    big = make_seq("big", [3] * (4 * PAGE - 1), arrival=1)
    scheduler.add(big)
    out = scheduler.schedule()
    assert [chunk.seq for chunk in out.chunks] == [big] and len(big.page_ids) == 4
    assert kv.kv_cache_metrics().evictions == {("capacity", 100): 3}
    kv.check_integrity([big.page_ids])


# ---- wire format: prompt_cache_retention and cache_control ---------------------------------------------------------
def test_prompt_cache_retention_values():
    from cluster.protocol import APIError, CompletionRequest, parse_request, request_retention

    def parse(value):
        return request_retention(parse_request(CompletionRequest, {"prompt": "x", "prompt_cache_retention": value}))

    assert parse(None) is None and parse("in_memory") is None and parse("in-memory") is None
    assert parse("24h") == Retention(priority=50, ttl_s=86400.0)
    assert parse({"priority": 80, "ttl": "10m"}) == Retention(priority=80, ttl_s=600.0)
    assert parse({"ttl": 30}) == Retention(priority=50, ttl_s=30.0)
    assert parse({"priority": 0}) is None
    for bad in ("forever", {"priority": 101}, {"priority": 1.5}, {"ttl": "-5m"}, {"ttl": "25h"}, {"pin": True}, 7):
        with pytest.raises(APIError) as error:
            parse(bad)
        assert error.value.status == 400 and error.value.param == "prompt_cache_retention"


def test_cache_control_breakpoints_on_messages_and_parts():
    from cluster.protocol import (APIError, ChatCompletionRequest, breakpoint_retention, cache_breakpoints,
                                  chat_messages, messages_up_to, parse_request)

    body = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "A"},
                                       {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}},
                                       {"type": "text", "text": "C"}]},
        {"role": "user", "content": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"role": "user", "content": "tail"}]}
    request = parse_request(ChatCompletionRequest, body)
    points = cache_breakpoints(request)
    assert [(p.message_index, p.part_index, p.ttl_s) for p in points] == [(0, 1, 300.0), (1, None, 3600.0)]
    messages = chat_messages(request)
    assert messages_up_to(messages, request, points[0]) == [{"role": "system", "content": "AB"}]
    assert messages_up_to(messages, request, points[1]) == messages[:2]
    assert breakpoint_retention(request, 300, 3600.0, None) == Retention(priority=50, ttl_s=3600.0, num_tokens=300)
    bad = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x",
                                                              "cache_control": {"type": "ephemeral", "ttl": "1y"}}]})
    with pytest.raises(APIError):
        cache_breakpoints(bad)


# ---- disk tier: retained pages are evicted after plain ones until their retention ends ----------------------------
def test_disk_tier_evicts_retained_pages_last_until_they_expire(tmp_path, monkeypatch):
    import dataclasses
    import os
    import time as time_module

    import torch

    from common.page_format import PageFormat
    from replica.tiers.arrow_file import write_page_file
    from replica.tiers.base import StoredPage
    from replica.tiers.disk_tier import DiskTier
    from replica.tiers.seal import TierKey

    page_format = PageFormat(model_fingerprint=FP, dtype="float32", page_size=PAGE, num_layers=1, num_kv_heads=1,
                             head_dim=4)
    tokens = list(range(5 * PAGE))
    pages = [StoredPage.from_format(page_format, key, tokens[i * PAGE:(i + 1) * PAGE],
                                    torch.full(page_format.kv_shape, float(i)))
             for i, key in enumerate(keys_for(tokens))]
    wall = [time_module.time()]
    monkeypatch.setattr("replica.tiers.disk_tier.time.time", lambda: wall[0])
    tier_key = TierKey.generate()
    size, _ = write_page_file(str(tmp_path / "probe.arrow"), pages[0], tier_key)
    tier = DiskTier(tmp_path / "kv", page_format, budget_bytes=int(3.5 * size), evict_to_fraction=1.0,
                    tier_key=tier_key)
    try:
        retained = dataclasses.replace(pages[0], retention_priority=80, retain_until=wall[0] + 60)
        for page in (retained, pages[1], pages[2], pages[3]):  # the retained page is the oldest file
            tier.store([page])
            tier.flush(timeout=10)
            wall[0] += 1
        present = [i for i, page in enumerate(pages) if os.path.exists(tier.page_path(page.key))]
        assert present == [0, 2, 3]  # plain LRU page 1 went, not the older retained page 0
        wall[0] += 120  # the retention has ended: page 0 is plain LRU again (and the oldest)
        tier.store([pages[4]])
        tier.flush(timeout=10)
        present = [i for i, page in enumerate(pages) if os.path.exists(tier.page_path(page.key))]
        assert present == [2, 3, 4]
    finally:
        tier.close()


# ---- the engine: a retained prefix is reused after a flood, with greedy output equal to the reference ---------------
def test_engine_retained_prefix_survives_flood_and_output_matches_reference():
    import math

    from common.types import EngineRequest
    from tests.engine_utils import TinyModel, greedy, random_prompt

    model = TinyModel("llama")
    engine = model.engine(num_pages=8, kv_cache_retention_budget=0.5, enforce_eager=True)
    sunk = []
    engine.page_sink = sunk.extend
    system = random_prompt(2 * PAGE, seed=1)

    def run(request_id, prompt, retention=None):
        engine.add_request(EngineRequest(request_id, prompt, greedy(3), retention=retention))
        tokens, final = [], None
        while engine.has_work():
            for output in engine.step():
                tokens.extend(output.new_token_ids)
                final = output
            engine.check_integrity()
        return tokens, final

    first_prompt = system + random_prompt(40, seed=2)
    _, first = run("first", first_prompt, Retention(priority=90, ttl_s=None, num_tokens=2 * PAGE))
    assert (first.cached_tokens.total, first.cache_write_tokens) == (0, 2 * PAGE)
    assert [(record.retention_priority, record.retain_until) for record in sunk] == [(90, math.inf)] * 2
    for index in range(4):  # 4 x 3 pages of unique prompts through an 8-page pool
        _, flood = run(f"flood{index}", random_prompt(3 * PAGE + 1, seed=100 + index))
        assert flood.cache_write_tokens == 3 * PAGE
    prompt = system + random_prompt(50, seed=3)
    tokens, final = run("again", prompt)
    assert final.cached_tokens.total == 2 * PAGE
    assert tokens == model.generate(prompt, 3)
    assert engine.stats().kv_cache.evictions[("capacity", 0)] > 0
    assert ("capacity", 90) not in engine.stats().kv_cache.evictions
