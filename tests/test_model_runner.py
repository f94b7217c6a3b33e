"""Logits of the paged model runner equal transformers' own forward pass (float32), for fresh prefills, chunks that
continue a cached context, and batched decodes of different lengths. Logit comparison catches errors that greedy
tokens of a random model can hide."""

import pytest
import torch

from engine_utils import TinyModel, random_prompt
from replica.model_runner import ChunkInput, ModelRunner

PS = 128


@pytest.fixture(scope="module", params=["llama", "mistral"])
def tiny(request):
    return TinyModel(request.param, seed=1)


@torch.inference_mode()
def reference_last_logits(tiny, tokens):
    return tiny.reference(torch.tensor([tokens])).logits[0, -1].float()


def pages(first, count):
    return list(range(first, first + count))


def test_prefill_chunks_and_decode_batch_match_forward(tiny):
    runner = ModelRunner(tiny.served, num_pages=16, page_size=PS, device=torch.device("cpu"))
    a = random_prompt(341, seed=11)
    b = random_prompt(150, seed=12)
    a_pages, b_pages = [3, 7, 1], [9, 4]  # deliberately not contiguous nor ordered
    # step 1: A's first chunk (no sampling) packed with all of B
    logits = runner.run([
        ChunkInput(a[:200], 0, a_pages, sample=False),
        ChunkInput(b, 0, b_pages, sample=True),
    ])
    torch.testing.assert_close(logits[0], reference_last_logits(tiny, b), rtol=0, atol=2e-4)
    # step 2: the rest of A reads its first 200 tokens back from the pages
    logits = runner.run([ChunkInput(a[200:340], 200, a_pages, sample=True)])
    torch.testing.assert_close(logits[0], reference_last_logits(tiny, a[:340]), rtol=0, atol=2e-4)
    # step 3: a decode batch with contexts of 341 and 151 tokens
    logits = runner.run([
        ChunkInput(a[340:341], 340, a_pages, sample=True),
        ChunkInput([5], 150, b_pages, sample=True),
    ])
    torch.testing.assert_close(logits[0], reference_last_logits(tiny, a), rtol=0, atol=2e-4)
    torch.testing.assert_close(logits[1], reference_last_logits(tiny, b + [5]), rtol=0, atol=2e-4)


def test_reusing_another_sequences_pages(tiny):
    runner = ModelRunner(tiny.served, num_pages=8, page_size=PS, device=torch.device("cpu"))
    prefix = random_prompt(256, seed=13)
    runner.run([ChunkInput(prefix + [9], 0, [2, 5, 0], sample=True)])
    suffix = random_prompt(30, seed=14)
    # a second sequence shares pages 2 and 5 and computes only its suffix into page 6
    logits = runner.run([ChunkInput(suffix, 256, [2, 5, 6], sample=True)])
    torch.testing.assert_close(logits[0], reference_last_logits(tiny, prefix + suffix), rtol=0, atol=2e-4)
    # a wrong page in the table must change the result (the comparison is sensitive)
    wrong = runner.run([ChunkInput(suffix, 256, [2, 0, 6], sample=True)])
    assert (wrong[0] - reference_last_logits(tiny, prefix + suffix)).abs().max() > 1e-3


@pytest.mark.parametrize("page_table", [[4, 5, 6], [6, 2, 3]], ids=["consecutive-view", "scattered-gather"])
def test_chunk_continuation_reads_consecutive_and_scattered_pages(tiny, page_table):
    runner = ModelRunner(tiny.served, num_pages=8, page_size=PS, device=torch.device("cpu"))
    prompt = random_prompt(300, seed=15)
    runner.run([ChunkInput(prompt[:256], 0, page_table, sample=False)])
    logits = runner.run([ChunkInput(prompt[256:], 256, page_table, sample=True)])
    torch.testing.assert_close(logits[0], reference_last_logits(tiny, prompt), rtol=0, atol=2e-4)


def test_slot_runs_merge_consecutive_pages_and_apply_the_window():
    from replica.paged_attention import slot_runs

    pages, ctx_len = [7, 8, 9, 2, 3], 4 * PS + 64
    assert slot_runs(pages, ctx_len, PS, None) == [(7 * PS, 3 * PS), (2 * PS, PS + 64)]
    # a 100-token window only reads the last 100 slots: 36 in page 2, 64 in page 3 (consecutive: one run)
    assert slot_runs(pages, ctx_len, PS, 100) == [(2 * PS + 92, 100)]
    assert slot_runs([5], 1, PS, None) == [(5 * PS, 1)]


def test_decodes_sharing_prefix_pages_are_attended_together(tiny):
    """Three decodes whose contexts start with the same two cached pages (one of them continuing into the page right
    after them, so its first run is longer), plus one unrelated decode: each equals its own forward pass."""
    from replica.paged_attention import DecodeBatch, DecodeRow

    runner = ModelRunner(tiny.served, num_pages=16, page_size=PS, device=torch.device("cpu"))
    prefix = random_prompt(256, seed=21)
    suffixes = [random_prompt(40 + 17 * i, seed=22 + i) for i in range(3)]
    tables = [[4, 5, 6], [4, 5, 9], [4, 5, 1]]  # the first continues its shared run into page 6
    runner.run([ChunkInput(prefix, 0, [4, 5], sample=False)])
    for suffix, table in zip(suffixes, tables):
        runner.run([ChunkInput(suffix, 256, table, sample=False)])
    other = random_prompt(90, seed=30)
    runner.run([ChunkInput(other, 0, [12], sample=False)])
    batch = DecodeBatch([DecodeRow(i, 256 + len(s) + 1, t) for i, (s, t) in enumerate(zip(suffixes, tables))]
                        + [DecodeRow(3, 91, [12])], PS, torch.arange(4))
    groups, singles = batch.plan(None)
    assert [(g.rows, g.start, g.length) for g in groups] == [([0, 1, 2], 4 * PS, 2 * PS)] and singles == [3]
    steps = [ChunkInput([7 + i], 256 + len(s), t, sample=True) for i, (s, t) in enumerate(zip(suffixes, tables))]
    logits = runner.run(steps + [ChunkInput([3], 90, [12], sample=True)])
    for index, suffix in enumerate(suffixes):
        expected = reference_last_logits(tiny, prefix + suffix + [7 + index])
        torch.testing.assert_close(logits[index], expected, rtol=0, atol=2e-4)
    torch.testing.assert_close(logits[3], reference_last_logits(tiny, other + [3]), rtol=0, atol=2e-4)


def test_group_shared_runs():
    from replica.paged_attention import group_shared_runs

    runs = [
        [(0, 300), (1000, 20)],   # shares [0, 256) with rows 1 and 3; its own part starts at 256
        [(0, 256), (2000, 5)],
        [(512, 400)],             # alone
        [(0, 260)],
        [(3000, 100)],            # same start as row 5 but they share under min_shared tokens
        [(3000, 120)],
    ]
    groups, singles = group_shared_runs(runs, min_shared=128)
    assert len(groups) == 1
    group = groups[0]
    assert (group.rows, group.start, group.length) == ([0, 1, 3], 0, 256)
    assert group.private_runs == [[(256, 44), (1000, 20)], [(2000, 5)], [(256, 4)]]
    assert singles == [2, 4, 5]
