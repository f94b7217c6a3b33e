"""The CPU attention path (each query row's context attended run by run in place with ATen's flash kernel, parts
merged by log-sum-exp) against the device-generic path (SDPA over gathered K/V with masks), on the same pool, packed
batch and metadata: cold and continued prefill chunks, scattered pages, decode rows sharing a prefix and alone, grouped
-query attention, sliding windows and a padding row."""

from __future__ import annotations

import pytest
import torch

import replica.paged_attention as pa
from replica.paged_attention import DecodeBatch, DecodeRow, PagedAttentionMetadata, PrefillSlice, attend, slot_runs

PAGE = 8
NUM_PAGES = 40


def build_step(chunks, *, num_kv_heads, dtype, padding=0):
    """``chunks``: (start_pos, num_new, page_ids). Returns (metadata, query, key, value) for one packed step whose
    contexts before ``start_pos`` are random K/V already in the pool."""
    gen = torch.Generator().manual_seed(0)
    head_dim, group = 16, 2
    kv_cache = torch.randn(1, 2, NUM_PAGES, PAGE, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots, prefills, decode_rows = [], [], []
    offset = 0
    for start_pos, num_new, page_ids in chunks:
        ctx_len = start_pos + num_new
        for first, length in slot_runs(page_ids, ctx_len, PAGE, None, start=start_pos):
            slots.extend(range(first, first + length))
        if num_new == 1:
            decode_rows.append(DecodeRow(offset, ctx_len, list(page_ids)))
        else:
            prefills.append(PrefillSlice(offset, num_new, ctx_len, None,
                                         context_runs=slot_runs(page_ids, start_pos, PAGE, None)))
        offset += num_new
    total = offset + padding
    query = torch.randn(total, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    decode = None
    if decode_rows:
        decode = DecodeBatch(decode_rows, PAGE, torch.tensor([row.q_index for row in decode_rows]))
    meta = PagedAttentionMetadata(kv_cache, torch.tensor(slots), prefills, decode, num_padding=padding)
    return meta, query, key, value


def both_paths(meta, query, key, value, window, monkeypatch):
    results = []
    for segments in (True, False):
        monkeypatch.setattr(pa, "_CPU_SEGMENTS", segments)
        cache = meta.kv_cache.clone()
        step = PagedAttentionMetadata(cache, meta.slot_mapping, meta.prefills, meta.decode, meta.num_padding)
        results.append((attend(step, 0, query, key, value, None, window), cache))
    return results


SHARED = [0, 1, 2, 3]  # 4 pages = 32 tokens shared by decode rows a and b
CASES = {
    "cold prefill": [(0, 21, [5, 6, 7])],
    "prefill over scattered cached pages": [(24, 13, [9, 3, 4, 20, 21])],
    "two prefills and decodes": [(0, 10, [30, 31]), (16, 9, [11, 12, 13, 14]), (37, 1, [15, 16, 17, 18, 19]),
                                  (5, 1, [22])],
    "fragmented pages": [(40, 1, [3, 9, 1, 30, 12, 7]), (43, 5, [33, 2, 35, 4, 37, 6])],
    "decodes sharing a prefix": [(35, 1, SHARED + [24]), (39, 1, SHARED + [25]), (33, 1, SHARED + [26]),
                                 (17, 1, [27, 28, 29])],
}


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_in_place_segments_match_the_generic_path(case, num_kv_heads, window, monkeypatch):
    meta, query, key, value = build_step(CASES[case], num_kv_heads=num_kv_heads, dtype=torch.float32, padding=1)
    (segments, cache_a), (generic, cache_b) = both_paths(meta, query, key, value, window, monkeypatch)
    assert torch.equal(cache_a, cache_b)  # both wrote the step's K/V into the same slots
    torch.testing.assert_close(segments, generic, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(segments[-1]) == 0  # the padding row attends to nothing


def test_bfloat16_close_to_float32(monkeypatch):
    steps = CASES["two prefills and decodes"] + CASES["decodes sharing a prefix"][:2]
    meta, query, key, value = build_step(steps, num_kv_heads=2, dtype=torch.float32)
    (reference, _), _ = both_paths(meta, query, key, value, None, monkeypatch)
    meta16 = PagedAttentionMetadata(meta.kv_cache.bfloat16(), meta.slot_mapping, meta.prefills, meta.decode)
    monkeypatch.setattr(pa, "_CPU_SEGMENTS", True)
    out = attend(meta16, 0, query.bfloat16(), key.bfloat16(), value.bfloat16(), None, None)
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)
