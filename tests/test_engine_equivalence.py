"""Greedy tokens from the paged engine equal transformers' generate on the same weights (float32), whatever the
cache state: caching off, cold, exact repeat, shared prefix, unaligned prefixes, big batches, eviction, preemption."""

import pytest

from engine_utils import TinyModel, random_prompt, run_to_completion

ARCHS = ["llama", "qwen2", "mistral"]
NUM_OUT = 6


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    return TinyModel(request.param)


def assert_matches_reference(tiny, prompts, tokens, num_out=NUM_OUT):
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == tiny.generate(prompt, num_out), request_id


def test_caching_off(tiny):
    engine = tiny.engine(enable_prefix_caching=False)
    prompt = random_prompt(300, seed=1)
    for round_ in range(2):
        tokens, finals = run_to_completion(engine, {f"r{round_}": prompt}, NUM_OUT)
        assert finals[f"r{round_}"].cached_tokens.total == 0
        assert_matches_reference(tiny, {f"r{round_}": prompt}, tokens)
    assert engine.stats().num_pages_cached == 0


def test_cold_then_exact_repeat(tiny):
    engine = tiny.engine()
    prompt = random_prompt(400, seed=2)
    tokens, finals = run_to_completion(engine, {"cold": prompt}, NUM_OUT)
    assert finals["cold"].cached_tokens.total == 0
    assert_matches_reference(tiny, {"cold": prompt}, tokens)
    tokens, finals = run_to_completion(engine, {"warm": prompt}, NUM_OUT)
    assert finals["warm"].cached_tokens.local == 384  # 3 full pages; the partial 4th is recomputed
    assert_matches_reference(tiny, {"warm": prompt}, tokens)


def test_page_aligned_exact_repeat_recomputes_last_token(tiny):
    engine = tiny.engine()
    prompt = random_prompt(256, seed=3)
    run_to_completion(engine, {"a": prompt}, NUM_OUT)
    tokens, finals = run_to_completion(engine, {"b": prompt}, NUM_OUT)
    assert finals["b"].cached_tokens.local == 128  # one token must be computed to get logits
    assert_matches_reference(tiny, {"b": prompt}, tokens)


def test_shared_prefix_new_suffix_unaligned(tiny):
    engine = tiny.engine()
    prefix = random_prompt(300, seed=4)  # more than two pages, not page aligned
    first = {"first": prefix + random_prompt(40, seed=5)}
    run_to_completion(engine, first, NUM_OUT)
    second = {"second": prefix + random_prompt(70, seed=6), "third": prefix[:290] + random_prompt(5, seed=7)}
    tokens, finals = run_to_completion(engine, second, NUM_OUT)
    assert finals["second"].cached_tokens.local == 256
    assert finals["third"].cached_tokens.local == 256
    assert_matches_reference(tiny, second, tokens)


def test_many_concurrent_requests_of_different_lengths(tiny):
    engine = tiny.engine(max_num_batched_tokens=300)  # forces chunked prefill mixed with decodes
    shared = random_prompt(150, seed=8)
    prompts = {f"r{i}": random_prompt(length, seed=100 + i) for i, length in enumerate([1, 7, 129, 260, 513, 64])}
    prompts.update({f"s{i}": shared + random_prompt(10 + 30 * i, seed=200 + i) for i in range(4)})
    tokens, _ = run_to_completion(engine, prompts, NUM_OUT)
    assert_matches_reference(tiny, prompts, tokens)


def test_eviction_and_preemption(tiny):
    # 8 pages of 128 tokens for 6 requests of ~300 tokens: pages run out mid-decode, requests are preempted and
    # recomputed, cached pages are evicted; every request still completes with the reference tokens
    engine = tiny.engine(num_pages=8, max_num_batched_tokens=512, max_model_len=1024)
    prompts = {f"r{i}": random_prompt(250 + 3 * i, seed=300 + i) for i in range(6)}
    tokens, finals = run_to_completion(engine, prompts, 12)
    assert set(finals) == set(prompts)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_evictions > 0
    assert stats.num_pages_in_use == 0 and stats.num_pages_free == 8
    assert_matches_reference(tiny, prompts, tokens, num_out=12)
