"""The scheduler without a model: admission, chunked prefill, prefix sharing, holding back a duplicate prefix,
preemption and fetched-page imports, with exact page ids (the free queue starts as 0, 1, 2, ... from the head)."""

from __future__ import annotations

import torch

from common.page_keys import compute_page_keys
from common.types import CacheSource, SamplingParams
from replica.kv_manager import KVCacheManager
from replica.page_record import PageRecord
from replica.scheduler import Scheduler
from replica.sequence import Sequence, SequenceStatus

PAGE = 128
FINGERPRINT = "test-model"


def make_scheduler(num_pages: int, budget: int = 2048, *, caching: bool = True, max_num_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(num_pages, PAGE, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, model_fingerprint=FINGERPRINT)


def make_seq(request_id: str, prompt: list[int], arrival: int = 0) -> Sequence:
    keys = compute_page_keys(prompt, page_size=PAGE, model_fingerprint=FINGERPRINT)
    return Sequence(request_id, list(prompt), SamplingParams(max_tokens=8, temperature=0.0), arrival, page_keys=keys)


def run_step(scheduler: Scheduler):
    """One step as the engine runs it, with the model left out: compute the chunks, commit full pages, and append an
    output token to every sequence whose chunk reached its last token."""
    out = scheduler.schedule()
    for chunk in out.chunks:
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_new_tokens
        scheduler.commit_computed_pages(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)
    return out


def chunks_of(out) -> list[tuple[str, int]]:
    return [(chunk.seq.request_id, chunk.num_new_tokens) for chunk in out.chunks]


def test_chunked_prefill_under_the_token_budget():
    scheduler = make_scheduler(8, budget=200)
    a = make_seq("a", list(range(300)))
    scheduler.add(a)
    assert chunks_of(run_step(scheduler)) == [("a", 200)]
    assert a.page_ids == [0, 1]
    assert chunks_of(run_step(scheduler)) == [("a", 100)]
    assert a.page_ids == [0, 1, 2]
    assert a.num_committed_pages == 2  # pages 0 and 1 are full; page 2 holds 44 tokens
    assert chunks_of(run_step(scheduler)) == [("a", 1)]  # decode
    scheduler.kv.check_integrity([a.page_ids])


def test_a_finished_prefix_is_matched_and_its_partial_page_reused_first():
    scheduler = make_scheduler(8)
    prefix = list(range(1000, 1256))
    a = make_seq("a", prefix + list(range(44)))
    scheduler.add(a)
    run_step(scheduler)
    scheduler.finish(a, "stop")
    # released last page first: page 2 (no key) goes to the head, cached pages 1 then 0 to the tail
    assert scheduler.kv.pool.free_queue_order() == [2, 3, 4, 5, 6, 7, 1, 0]

    b = make_seq("b", prefix + list(range(500, 550)), arrival=1)
    scheduler.add(b)
    out = run_step(scheduler)
    assert chunks_of(out) == [("b", 50)]
    assert b.page_ids == [0, 1, 2]
    assert b.cached_by_source == {CacheSource.LOCAL: 256}
    assert (scheduler.num_prompt_tokens_queried, scheduler.num_prompt_tokens_hit) == (300 + 306, 256)
    assert scheduler.num_prompt_tokens_hit_local == 256  # all from its own pages


def test_a_request_waits_a_step_for_a_prefix_being_computed_then_shares_it():
    scheduler = make_scheduler(8)
    prompt = list(range(300))
    a, b = make_seq("a", prompt, 0), make_seq("b", prompt, 1)
    scheduler.add(a)
    scheduler.add(b)
    first = run_step(scheduler)
    assert chunks_of(first) == [("a", 300)]
    assert list(scheduler.waiting) == [b]
    second = run_step(scheduler)
    assert chunks_of(second) == [("a", 1), ("b", 44)]
    assert (a.page_ids, b.page_ids) == ([0, 1, 2], [0, 1, 3])
    assert scheduler.kv.pool.refcounts[:4] == [2, 2, 1, 1]
    scheduler.kv.check_integrity([a.page_ids, b.page_ids])


def test_the_newest_request_is_preempted_when_pages_run_out():
    scheduler = make_scheduler(4)
    a = make_seq("a", list(range(256)), 0)
    b = make_seq("b", list(range(1000, 1250)), 1)
    scheduler.add(a)
    scheduler.add(b)
    assert chunks_of(run_step(scheduler)) == [("a", 256), ("b", 250)]
    assert (a.page_ids, b.page_ids) == ([0, 1], [2, 3])
    out = run_step(scheduler)  # a's 257th token needs a third page: b (newest) gives its pages back
    assert out.preempted == [b]
    assert chunks_of(out) == [("a", 1)]
    assert a.page_ids == [0, 1, 3]  # b's partial page 3 went to the head of the free queue, its cached page 2 to the tail
    assert (b.status, b.page_ids, b.num_computed_tokens, b.num_preemptions) == (SequenceStatus.WAITING, [], 0, 1)
    assert list(scheduler.waiting) == [b] and scheduler.num_preemptions == 1
    assert scheduler.kv.cache.lookup(b.page_keys[0]) == 2  # still cached: b hits it when readmitted
    scheduler.kv.check_integrity([a.page_ids])


def test_fetched_pages_continuing_the_local_hit_become_imports():
    scheduler = make_scheduler(8)
    prompt = list(range(400))  # pages 0..2 are reusable, page 3 (16 tokens) is computed
    seq = make_seq("a", prompt)
    fetched = tuple(PageRecord(seq.page_keys[i], tuple(prompt[i * PAGE:(i + 1) * PAGE]), torch.zeros(1),
                               CacheSource.HOST) for i in (1, 2))
    seq.fetched, seq.first_fetched_index = fetched, 1  # page 0 was expected locally but is not there
    scheduler.add(seq)
    out = run_step(scheduler)
    assert out.imports == []  # a gap before the fetched pages: they cannot be used
    assert chunks_of(out) == [("a", 400)]

    scheduler2 = make_scheduler(8)
    seq2 = make_seq("b", prompt)
    seq2.fetched, seq2.first_fetched_index = fetched, 1
    scheduler2.kv.commit_page(scheduler2.kv.allocate(1)[0], seq2.page_keys[0], prompt[:PAGE])  # page 0 is cached
    scheduler2.kv.release([0])
    scheduler2.add(seq2)
    out2 = run_step(scheduler2)
    assert [(item.seq.request_id, item.page_index, item.page.source) for item in out2.imports] == [
        ("b", 1, CacheSource.HOST), ("b", 2, CacheSource.HOST)]
    assert chunks_of(out2) == [("b", 16)]
    assert seq2.page_ids == [0, 1, 2, 3] and seq2.fetched == ()
    assert seq2.cached_by_source == {CacheSource.LOCAL: 128, CacheSource.HOST: 256}
    assert (scheduler2.num_prompt_tokens_hit, scheduler2.num_prompt_tokens_hit_local) == (384, 128)


def test_requests_wait_a_step_for_pages_another_request_imports_then_hit_them():
    scheduler = make_scheduler(16)
    prompt = list(range(400))
    a, b, c = make_seq("a", prompt, 0), make_seq("b", prompt + [1], 1), make_seq("c", prompt + [2], 2)
    fetched = tuple(PageRecord(a.page_keys[i], tuple(prompt[i * PAGE:(i + 1) * PAGE]), torch.zeros(1),
                               CacheSource.PEER) for i in range(3))
    a.fetched = b.fetched = fetched  # one shared fetch: b carries the same pages; c (no peer hint) carries none
    for seq in (a, b, c):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [(item.seq.request_id, item.page_index) for item in out.imports] == [("a", 0), ("a", 1), ("a", 2)]
    assert chunks_of(out) == [("a", 16)] and list(scheduler.waiting) == [b, c]  # no second copy, no recompute
    for item in out.imports:  # what the engine does before the model runs
        scheduler.kv.commit_page(item.seq.page_ids[item.page_index], item.page.key, item.page.token_ids)
    a.num_computed_tokens += 16
    a.output_token_ids.append(7)
    second = run_step(scheduler)
    assert chunks_of(second) == [("a", 1), ("b", 17), ("c", 17)]
    assert a.page_ids[:3] == b.page_ids[:3] == c.page_ids[:3]
    assert b.cached_by_source == c.cached_by_source == {CacheSource.LOCAL: 3 * PAGE}
    scheduler.kv.check_integrity([a.page_ids, b.page_ids, c.page_ids])


def test_caching_off_matches_nothing_and_hashes_nothing():
    scheduler = make_scheduler(8, caching=False)
    prompt = list(range(300))
    a = Sequence("a", prompt, SamplingParams(max_tokens=4, temperature=0.0), 0)
    scheduler.add(a)
    run_step(scheduler)
    scheduler.finish(a, "stop")
    b = Sequence("b", prompt, SamplingParams(max_tokens=4, temperature=0.0), 1)
    scheduler.add(b)
    assert chunks_of(run_step(scheduler)) == [("b", 300)]
    assert (a.page_keys, b.page_keys, scheduler.kv.num_cached_pages) == ([], [], 0)


def test_a_preempted_request_readmitted_on_its_own_pages_does_not_protect_them():
    """The segmented LRU protects pages a request reuses. A preempted request that hits the pages it computed itself
    is not reusing anyone's prefix: its pages stay on probation (under the memory pressure that preempted it, they
    must not push shared prefixes out of the protected queue)."""
    kv = KVCacheManager(4, PAGE, protected_fraction=0.5)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=2048, model_fingerprint=FINGERPRINT)
    a = make_seq("a", list(range(256)), 0)
    b = make_seq("b", list(range(1000, 1250)), 1)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    assert run_step(scheduler).preempted == [b]
    scheduler.finish(a, "length")
    assert chunks_of(run_step(scheduler)) == [("b", 251 - 128)]  # readmitted: it hits its own cached page 2
    assert b.page_ids[0] == 2 and b.num_cached_prompt_tokens == 0  # counted at its first admission: nothing cached
    scheduler.finish(b, "length")
    assert not kv.pool.reused[2] and kv.pool.num_protected == 0
    kv.check_integrity()
