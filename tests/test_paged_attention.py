"""The CPU attention path (each query row's context attended run by run in place with ATen's flash kernel, parts
merged by log-sum-exp; decode rows by the C++ decode kernel, or by ATen's kernel run by run) against the
device-generic path (SDPA over gathered K/V with masks), on the same pool, packed batch and metadata: cold and
continued prefill chunks, scattered pages, decode rows sharing a prefix and alone, grouped-query attention, sliding
windows and a padding row."""

from __future__ import annotations

import os
import time

import pytest
import torch

import replica.paged_attention as pa
from replica import cpu_kernels
from replica.paged_attention import DecodeBatch, DecodeRow, PagedAttentionMetadata, PrefillSlice, attend, slot_runs

PAGE = 8
NUM_PAGES = 40


def build_step(chunks, *, num_kv_heads, dtype, padding=0, head_dim=16):
    """``chunks``: (start_pos, num_new, page_ids). Returns (metadata, query, key, value) for one packed step whose
    contexts before ``start_pos`` are random K/V already in the pool. ``head_dim`` 16: the C++ kernel's plain loops;
    64: its vector code."""
    gen = torch.Generator().manual_seed(0)
    group = 2
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
                                         context_runs=slot_runs(page_ids, start_pos, PAGE, None),
                                         kv_runs=slot_runs(page_ids, ctx_len, PAGE, None)))
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


KERNEL = [pytest.param(False, id="aten-decode"),
          pytest.param(True, id="cpp-decode", marks=pytest.mark.skipif(not cpu_kernels.load(),
                                                                        reason="no C++ compiler here"))]


def both_paths(meta, query, key, value, window, monkeypatch, kernel=False):
    """(in-place CPU path, its pool), (generic path, its pool); ``kernel``: decode rows by the C++ kernel."""
    results = []
    monkeypatch.setattr(pa, "_CPU_DECODE_KERNEL", kernel)
    monkeypatch.setattr(pa, "_CPU_PREFILL_KERNEL", False)
    for segments in (True, False):
        monkeypatch.setattr(pa, "_CPU_SEGMENTS", segments)
        cache = meta.kv_cache.clone()
        step = PagedAttentionMetadata(cache, meta.slot_mapping, meta.prefills, meta.decode, meta.num_padding)
        results.append((attend(step, 0, query, key, value, None, window), cache))
        if segments and meta.decode is not None:  # the decode rows went where they were sent
            plan = step._step_cache[("segments", window, kernel, False)]  # float32: no AMX prefill kernel
            assert (plan.decode_kernel is not None) == kernel
            # with every part on the C++ kernels a layer stores and attends in one call (cpu_kernels.attend_layer);
            # here the prompt chunks are not (the prefill kernel is off), so only a step of decode rows does
            assert (step._step_cache[("one call", window)] is not None) == (kernel and not meta.prefills)
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


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_in_place_segments_match_the_generic_path(case, num_kv_heads, window, kernel, head_dim, monkeypatch):
    meta, query, key, value = build_step(CASES[case], num_kv_heads=num_kv_heads, dtype=torch.float32, padding=1,
                                         head_dim=head_dim)
    (segments, cache_a), (generic, cache_b) = both_paths(meta, query, key, value, window, monkeypatch, kernel)
    assert torch.equal(cache_a, cache_b)  # both wrote the step's K/V into the same slots
    torch.testing.assert_close(segments, generic, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(segments[-1]) == 0  # the padding row attends to nothing


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_bfloat16_close_to_float32(kernel, head_dim, monkeypatch):
    steps = CASES["two prefills and decodes"] + CASES["decodes sharing a prefix"][:2]
    meta, query, key, value = build_step(steps, num_kv_heads=2, dtype=torch.float32, head_dim=head_dim)
    (reference, _), _ = both_paths(meta, query, key, value, None, monkeypatch, kernel)
    meta16 = PagedAttentionMetadata(meta.kv_cache.bfloat16(), meta.slot_mapping, meta.prefills, meta.decode)
    monkeypatch.setattr(pa, "_CPU_SEGMENTS", True)
    out = attend(meta16, 0, query.bfloat16(), key.bfloat16(), value.bfloat16(), None, None)
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_only_step_in_one_call_matches_the_generic_path(dtype, monkeypatch):
    """``attend_layer`` (store + decode kernel in one call) against ATen's generic path: rows sharing a prefix, a
    row alone, a padding row; the same pool afterwards, the padding row zero."""
    meta, query, key, value = build_step(CASES["decodes sharing a prefix"], num_kv_heads=2, dtype=dtype, padding=1,
                                         head_dim=64)
    (fast, cache_a), (generic, cache_b) = both_paths(meta, query, key, value, None, monkeypatch, kernel=True)
    assert torch.equal(cache_a, cache_b)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, generic, rtol=tolerance, atol=tolerance)
    assert torch.count_nonzero(fast[-1]) == 0


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler here")
def test_attend_layer_refuses_a_slot_or_a_chunk_outside_its_bounds():
    meta, query, key, value = build_step(CASES["decodes sharing a prefix"], num_kv_heads=2, dtype=torch.float32)
    plan = pa._kernel_step_plan(meta, query, None)
    bad = meta.slot_mapping.clone()
    bad[1] = meta.kv_cache.shape[2] * meta.kv_cache.shape[3]  # pages x page size: one past the last slot
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        cpu_kernels.attend_layer(query, key, value, meta.kv_cache, 0, bad, bad.numel(), plan, 0.125)
    chunk = pa.KernelStepPlan(torch.tensor([[3, 9]]), torch.tensor([[0, 9]]), torch.tensor([0, 1]), None)
    with pytest.raises(RuntimeError, match="prompt chunk outside the step"):  # rows 3..11 of a 5-row step
        cpu_kernels.attend_layer(query, key, value, meta.kv_cache, 0, meta.slot_mapping,
                                 meta.slot_mapping.numel(), chunk, 0.125)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler here")
@pytest.mark.parametrize("head_dim, group", [(32, 4), (32, 3), (64, 4)])
def test_decode_kernel_long_runs_across_blocks_and_many_rows(head_dim, group):
    """Runs longer than the kernel's key block (64) and a group of 3 rows sharing a 5-block prefix: the running
    softmax across blocks and segments matches one softmax over the gathered context. The vector code's accumulator
    tiles differ by head size (on AVX2: 2 query vectors at 32, 1 at 64); 3 query heads per kv head leave a tile
    half full."""
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, slots = 2, 2000
    k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen) * 3  # large scores: rescaling matters
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(5, num_kv_heads * group, head_dim, generator=gen)
    contexts = {0: [(100, 320), (900, 75)], 2: [(100, 320), (1500, 3)], 3: [(100, 200)], 4: [(10, 1)]}
    segments = [(100, 200, 0, 3), (300, 120, 3, 4), (900, 75, 4, 5), (300, 120, 5, 6), (1500, 3, 6, 7),
                (10, 1, 7, 8)]
    rows = [0, 2, 3, 0, 0, 2, 2, 4, 0, 2, 3, 4]
    components = [(0, 5, 8, 11), (5, 6, 11, 12)]
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    plan = as_long(segments), as_long(rows), as_long(components)
    out, plain = torch.zeros_like(query), torch.zeros_like(query)
    cpu_kernels.decode_attention(query, k_cache, v_cache, *plan, out, 0.2)  # vector code
    cpu_kernels.decode_attention(query, k_cache, v_cache, *plan, plain, 0.2, vector_code=False)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)  # summation orders differ
    for position, runs in contexts.items():
        index = torch.cat([torch.arange(start, start + length) for start, length in runs])
        k = k_cache[index].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v_cache[index].repeat_interleave(group, dim=1).transpose(0, 1)
        probs = torch.softmax(query[position][:, None] @ k.transpose(1, 2) * 0.2, dim=-1)
        torch.testing.assert_close(out[position], (probs @ v)[:, 0], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[1]) == 0  # a row in no component is not written


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler here")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the step helper needs a second CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vector_code", [True, False])
def test_decode_kernel_shares_its_items_with_the_armed_step_helper_bit_for_bit(dtype, vector_code):
    """On one torch thread with the step helper armed (a short engine step), the decode kernel's items (component,
    kv head) are taken by the caller and the helper alike: each is computed as one thread computes it, so the output
    is equal bit for bit, and the helper takes some."""
    gen = torch.Generator().manual_seed(2)
    num_kv_heads, group, head_dim, slots = 4, 2, 64, 6000
    k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(4, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    # rows 0 and 1 share a prefix (one component), rows 2 and 3 each their own context
    plan = (as_long([(0, 1500, 0, 2), (1500, 40, 2, 3), (1600, 300, 3, 4), (2000, 1800, 4, 5), (4000, 900, 5, 6)]),
            as_long([0, 1, 0, 1, 2, 3]), as_long([(0, 3, 0, 2), (3, 4, 4, 5), (4, 5, 5, 6)]))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = torch.zeros_like(query)
        cpu_kernels.decode_attention(query, k_cache, v_cache, *plan, alone, 0.125, vector_code=vector_code)
        taken, outs = cpu_kernels.step_helper_chunks(), []
        deadline = time.monotonic() + 5
        cpu_kernels.arm_step_helper(True)
        try:
            while cpu_kernels.step_helper_chunks() == taken and time.monotonic() < deadline:
                outs.append(torch.zeros_like(query))
                cpu_kernels.decode_attention(query, k_cache, v_cache, *plan, outs[-1], 0.125,
                                             vector_code=vector_code)
        finally:
            cpu_kernels.arm_step_helper(False)
    finally:
        torch.set_num_threads(before)
    assert cpu_kernels.step_helper_chunks() > taken
    assert torch.count_nonzero(alone) > 0 and all(torch.equal(out, alone) for out in outs)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler here")
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_bfloat16_decode_kernel_matches_float64_attention(head_dim):
    """bfloat16 decode rows (on AVX-512: keys scored 16 at a time, by vdpbf16ps pairs where the CPU has AVX512-BF16;
    head size 80 leaves half a pair): a group of rows sharing a 200-key run plus runs of their own (the next run's
    first block prefetched), against float64 attention on the same bfloat16 values, and against the plain loops."""
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, group, slots = 2, 2, 2000
    k_cache = (torch.randn(slots, num_kv_heads, head_dim, generator=gen) * 2).to(torch.bfloat16)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    query = torch.randn(3, num_kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    contexts = {0: [(100, 200), (900, 75)], 1: [(100, 200), (1500, 3)], 2: [(1200, 130)]}
    segments = [(100, 200, 0, 2), (900, 75, 2, 3), (1500, 3, 3, 4), (1200, 130, 4, 5)]
    rows = [0, 1, 0, 1, 2, 0, 1, 2]
    components = [(0, 3, 5, 7), (3, 4, 7, 8)]
    plan = tuple(torch.tensor(values, dtype=torch.long) for values in (segments, rows, components))
    out, plain = torch.zeros_like(query), torch.zeros_like(query)
    scale = head_dim ** -0.5
    cpu_kernels.decode_attention(query, k_cache, v_cache, *plan, out, scale)
    cpu_kernels.decode_attention(query, k_cache, v_cache, *plan, plain, scale, vector_code=False)
    torch.testing.assert_close(out.float(), plain.float(), rtol=0.008, atol=0.008)
    for position, runs in contexts.items():
        index = torch.cat([torch.arange(start, start + length) for start, length in runs])
        k = k_cache[index].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v_cache[index].double().repeat_interleave(group, dim=1).transpose(0, 1)
        probs = torch.softmax(query[position].double()[:, None] @ k.transpose(1, 2) * scale, dim=-1)
        torch.testing.assert_close(out[position].double(), (probs @ v)[:, 0], rtol=0.008, atol=0.004)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler here")
def test_decode_kernel_refuses_a_plan_outside_the_pool():
    query, cache = torch.randn(2, 2, 8), torch.randn(50, 1, 8)
    out = torch.zeros_like(query)
    as_long = lambda values: torch.tensor(values, dtype=torch.long).view(-1, 4)  # noqa: E731
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.decode_attention(query, cache, cache, as_long([45, 10, 0, 1]), torch.tensor([0]),
                                     as_long([0, 1, 0, 1]), out, 1.0)
    with pytest.raises(RuntimeError, match="outside the batch"):
        cpu_kernels.decode_attention(query, cache, cache, as_long([0, 10, 0, 1]), torch.tensor([7, 7]),
                                     as_long([0, 1, 1, 2]), out, 1.0)


LONG_CASES = {
    "cold prefill over 3 blocks": [(0, 150, list(range(0, 19)))],
    "prefill after a long cached prefix in scattered pages": [(96, 40, [30, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                                                        15, 16, 31, 33])],
    "two prefills and decodes": [(64, 20, list(range(20, 31))), (0, 9, [1, 17]), (70, 1, list(range(31, 40))),
                                 (5, 1, [18])],
}


VECTOR_CPU = {"avx2", "fma"} <= set(cpu_kernels._cpu_flags().split())
"""The float32 prefill kernel's instructions, from /proc/cpuinfo: on such a CPU a failed build fails the tests below."""


@pytest.mark.skipif(not VECTOR_CPU, reason="needs a CPU with AVX2 and FMA")
@pytest.mark.parametrize("head_dim", [32, 64, 80])
@pytest.mark.parametrize("case", sorted(LONG_CASES))
def test_float32_prefill_kernel_matches_run_by_run_attention(case, head_dim, monkeypatch):
    """float32 prompt chunks through the AVX2 kernel (one call per chunk: cached runs in scattered pages, key blocks
    cut by run ends, its own tokens causal, grouped-query heads, a head size that is not a multiple of 6 or 8)
    against the run-by-run path (ATen's flash kernel, merged by log-sum-exp) and the gathered reference."""
    assert cpu_kernels.has_vector_prefill(), cpu_kernels._state
    steps = LONG_CASES[case]
    meta, query, key, value = build_step(steps, num_kv_heads=2, dtype=torch.float32, padding=1, head_dim=head_dim)
    fresh = lambda: PagedAttentionMetadata(meta.kv_cache.clone(), meta.slot_mapping, meta.prefills, meta.decode,  # noqa: E731
                                           num_padding=1)
    monkeypatch.setattr(pa, "_CPU_SEGMENTS", False)
    reference = attend(fresh(), 0, query, key, value, None, None)
    monkeypatch.setattr(pa, "_CPU_SEGMENTS", True)
    monkeypatch.setattr(pa, "_CPU_PREFILL_KERNEL", False)
    run_by_run = attend(fresh(), 0, query, key, value, None, None)
    monkeypatch.setattr(pa, "_CPU_PREFILL_KERNEL", True)
    step = fresh()
    out = attend(step, 0, query, key, value, None, None)
    plan = step._step_cache[("segments", None, pa._decode_kernel_for(query), True)]
    assert [index for index, _ in plan.prefill_kernel] == list(range(len(meta.prefills)))  # every chunk went there
    # every part of the step on the kernels: each layer is one call (cpu_kernels.attend_layer), chunks and decode rows
    assert (step._step_cache[("one call", None)] is not None) == (not meta.decode or pa._decode_kernel_for(query))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, run_by_run, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[-1]) == 0


@pytest.mark.skipif(not VECTOR_CPU, reason="needs a CPU with AVX2 and FMA")
def test_one_call_writes_and_reads_its_own_layer_of_the_pool(monkeypatch):
    """A 2-layer pool, layer 1: the one call (prompt chunks and decode rows) stores into layer 1 only and attends over
    it, as the generic path does; layer 0 is left as it was."""
    meta, query, key, value = build_step(LONG_CASES["two prefills and decodes"], num_kv_heads=2, dtype=torch.float32,
                                         padding=1, head_dim=64)
    other = torch.randn_like(meta.kv_cache)
    outs, pools = [], []
    for segments in (True, False):
        monkeypatch.setattr(pa, "_CPU_SEGMENTS", segments)
        pool = torch.cat([other, meta.kv_cache])
        step = PagedAttentionMetadata(pool, meta.slot_mapping, meta.prefills, meta.decode, num_padding=1)
        outs.append(attend(step, 1, query, key, value, None, None))
        pools.append(pool)
        if segments:
            assert step._step_cache[("one call", None)] is not None
    assert torch.equal(pools[0], pools[1]) and torch.equal(pools[0][0], other[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not VECTOR_CPU, reason="needs a CPU with AVX2 and FMA")
@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_float32_prefill_kernel_rescales_and_masks(head_dim, threads):
    """Keys that grow along the context (a row's maximum moves block after block, so the running sums and outputs
    are rescaled), the context split into uneven runs (blocks cut short), 3 query heads per kv head (rows of one
    token in two row blocks), against one float64 softmax, causal; a run outside the pool is refused. The 9 row blocks
    of a kv head are split into items of 5 + 4 on one thread, of 2 (and one of 1) on 8 threads: each key block is shared
    by row blocks whose causal limits end at different keys."""
    assert cpu_kernels.has_vector_prefill(), cpu_kernels._state
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_rescales_and_masks(head_dim)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not VECTOR_CPU, reason="needs a CPU with AVX2 and FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [34, 64, 80])
@pytest.mark.parametrize("tokens", [35, 100])
def test_prefill_kernel_gives_the_same_bits_for_any_split_of_its_rows(head_dim, tokens, dtype):
    """A kv head's row blocks (35 or 100 tokens x 2 query heads: 5 or 13 row blocks, causal, uneven runs, key blocks
    of 64, 3 and 37 keys) are items of up to 8 on one thread, attended two row blocks at a time with AVX-512 (each key
    broadcast once for both: pairs, then one), and one row block per item on 8 threads. With 100 tokens the last key
    block is past the first 8 row blocks' causal limits, so the pairs start at an odd row block. Every sum runs in the
    same order either way: the outputs are equal bit for bit. float32 on its FMA kernel, bfloat16 on the pair-dot
    kernel (AVX512-BF16: vdpbf16ps); head size 34 ends in tiles narrower than the pairs' (6 or 8 head dims)."""
    if dtype == torch.bfloat16 and not cpu_kernels.has_bf16_dot():
        pytest.skip("needs AVX512-BF16")
    gen = torch.Generator().manual_seed(5)
    num_kv_heads, group, slots = 1, 2, 700
    k_cache = (torch.randn(slots, num_kv_heads, head_dim, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    runs = torch.tensor([[300, 131], [10, 101], [500, tokens]])
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 8):
            torch.set_num_threads(threads)
            outs.append(torch.zeros_like(query))
            torch.ops.prefixserve_cpu.prefill_attention_f32(query, k_cache, v_cache, runs, head_dim ** -0.5,
                                                            outs[-1], bf16_dot=True)
    finally:
        torch.set_num_threads(before)
    assert torch.count_nonzero(outs[0]) == outs[0].numel()
    assert torch.equal(outs[0], outs[1])


def _check_rescales_and_masks(head_dim):
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, group, context, tokens, slots = 2, 3, 150, 45, 400
    order = torch.cat([torch.arange(300, 370), torch.arange(7, 87), torch.arange(200, 245)])  # 70 + 80 cached, 45 own
    ramp = torch.ones(slots)
    ramp[order] = 1 + torch.arange(context + tokens) / 6.0
    k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen) * ramp[:, None, None]
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(tokens, num_kv_heads * group, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = torch.zeros_like(query)
    runs = torch.tensor([[300, 70], [7, 80], [200, 45]])
    cpu_kernels.prefill_attention(query, k_cache, v_cache, runs, scale, out)
    k = k_cache[order].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v_cache[order].double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, T, L]
    visible = torch.arange(context + tokens)[None, :] <= context + torch.arange(tokens)[:, None]
    top = scores.masked_fill(~visible, float("-inf")).amax(-1)
    assert (top[:, -1] - top[:, 0]).max() > 20  # the maximum does move a long way
    reference = (torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v).transpose(0, 1)
    # float32 sums of 128 products of values up to ~30 round at ~1e-5; one key dropped or added moves a row by ~0.01
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.prefill_attention(query, k_cache, v_cache, torch.tensor([[390, 20], [0, 45]]), scale, out)


AMX_CPU = cpu_kernels.AMX_CPU_FLAGS <= set(cpu_kernels._cpu_flags().split())
"""What /proc/cpuinfo says, independently of whether the kernel built: on such a CPU a failed build fails the test
below instead of skipping it."""


@pytest.mark.skipif(not AMX_CPU, reason="needs a CPU with AMX tiles (bfloat16)")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("case", sorted(LONG_CASES))
def test_amx_prefill_kernel_matches_float32_attention(case, head_dim, monkeypatch):
    """bfloat16 prompt chunks through the AMX kernel (one call per chunk: cached runs in scattered pages, blocks of
    64 keys that straddle runs or end the context, its own tokens causal, grouped-query heads) against the generic
    path in float32 on the same bfloat16 values; the decode rows of the step are left to the decode path."""
    assert cpu_kernels.has_amx(), cpu_kernels._state  # built and granted on this CPU
    steps = LONG_CASES[case]
    meta, query, key, value = build_step(steps, num_kv_heads=2, dtype=torch.bfloat16, padding=1, head_dim=head_dim)
    meta32 = PagedAttentionMetadata(meta.kv_cache.float(), meta.slot_mapping, meta.prefills, meta.decode,
                                    num_padding=1)
    monkeypatch.setattr(pa, "_CPU_SEGMENTS", False)
    reference = attend(meta32, 0, query.float(), key.float(), value.float(), None, None)
    monkeypatch.setattr(pa, "_CPU_SEGMENTS", True)
    monkeypatch.setattr(pa, "_CPU_PREFILL_KERNEL", True)
    step = PagedAttentionMetadata(meta.kv_cache.clone(), meta.slot_mapping, meta.prefills, meta.decode, num_padding=1)
    out = attend(step, 0, query, key, value, None, None)
    plan = step._step_cache[("segments", None, pa._decode_kernel_for(query), True)]
    assert [index for index, _ in plan.prefill_kernel] == list(range(len(meta.prefills)))  # every chunk went there
    # the AMX kernel is not one of attend_layer's: these steps keep the call per part
    assert step._step_cache[("one call", None)] is None
    # bfloat16 output: half a unit in the last place is 2^-9 relative; measured errors were at most ATen flash's own
    # (<= 0.0076 at |values| up to 3.7), and one key of ~100 dropped or added moves a row by ~0.01
    torch.testing.assert_close(out.float(), reference, rtol=0.004, atol=0.004)
    assert torch.count_nonzero(out[-1]) == 0
    # and a sliding window keeps the chunks on the run-by-run path
    windowed = PagedAttentionMetadata(meta.kv_cache.clone(), meta.slot_mapping, meta.prefills, meta.decode,
                                      num_padding=1)
    attend(windowed, 0, query, key, value, None, 12)
    assert not windowed._step_cache[("segments", 12, pa._decode_kernel_for(query), True)].prefill_kernel


@pytest.mark.skipif(not AMX_CPU, reason="needs a CPU with AMX tiles (bfloat16)")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_amx_prefill_kernel_rescales_when_later_keys_dominate(head_dim):
    """Keys that grow along the context, so a row's maximum score rises by far more than the kernel's slack (8)
    from block to block: the output kept in tiles (head sizes up to 64) must be rescaled each time, and the values
    are packed across a partial last block. Against one float32 softmax over the same bfloat16 values, causal."""
    assert cpu_kernels.has_amx(), cpu_kernels._state
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, group, context, tokens, slots = 2, 3, 150, 45, 400
    ramp = torch.ones(slots)
    ramp[7:7 + context + tokens] = 1 + torch.arange(context + tokens) / 6.0  # scores up to ~ +-30 sigma
    k_cache = (torch.randn(slots, num_kv_heads, head_dim, generator=gen) * ramp[:, None, None]).bfloat16()
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).bfloat16()
    query = torch.randn(tokens, num_kv_heads * group, head_dim, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    out = torch.zeros_like(query)
    cpu_kernels.prefill_attention(query, k_cache, v_cache, torch.tensor([[7, context + tokens]]), scale, out)
    k = k_cache[7:7 + context + tokens].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v_cache[7:7 + context + tokens].float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, T, L]
    visible = torch.arange(context + tokens)[None, :] <= context + torch.arange(tokens)[:, None]
    top = scores.masked_fill(~visible, float("-inf")).amax(-1)
    assert (top[:, -1] - top[:, 0]).max() > 3 * 8  # the maximum does outgrow the slack, more than once
    reference = (torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v).transpose(0, 1)
    torch.testing.assert_close(out.float(), reference, rtol=0.004, atol=0.004)


@pytest.mark.skipif(not VECTOR_CPU, reason="needs a CPU with AVX2 and FMA")
@pytest.mark.parametrize("threads", [1, 8])
def test_bfloat16_prefill_without_amx_is_the_float32_kernel_rounded_once(threads):
    """bfloat16 on a CPU without AMX tiles or AVX512-BF16 (or ``bf16_dot=False``) runs the float32 kernel on its
    inputs widened as they are read: its output is exactly the float32 kernel's on the same (bfloat16-valued) inputs,
    rounded to bfloat16 once (round to nearest even, as torch), over uneven runs, causal, GQA, one and eight threads
    (items packed for 8 + 1 row blocks and for 2)."""
    assert cpu_kernels.has_vector_prefill(), cpu_kernels._state
    query, k_cache, v_cache, runs, scale = bfloat16_prefill_case(64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.zeros_like(query)
        torch.ops.prefixserve_cpu.prefill_attention_f32(query, k_cache, v_cache, runs, scale, out, bf16_dot=False)
        wide = torch.zeros(query.shape, dtype=torch.float32)
        torch.ops.prefixserve_cpu.prefill_attention_f32(query.float(), k_cache.float(), v_cache.float(), runs, scale,
                                                        wide)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, wide.to(torch.bfloat16))
    assert out.abs().sum() > 0
    with pytest.raises(RuntimeError, match="all of one dtype"):
        torch.ops.prefixserve_cpu.prefill_attention_f32(query, k_cache.float(), v_cache, runs, scale, out)
    if not cpu_kernels.has_amx() and not cpu_kernels.has_bf16_dot():  # what the paged path calls for bfloat16 here
        routed = torch.zeros_like(query)
        cpu_kernels.prefill_attention(query, k_cache, v_cache, runs, scale, routed)
        assert torch.equal(routed, out)
        from replica.paged_attention import _prefill_kernel_for
        assert _prefill_kernel_for(query, k_cache, v_cache)


def bfloat16_prefill_case(head_dim: int, group: int = 3, tokens: int = 45):
    """A bfloat16 prompt chunk of ``tokens`` after 150 cached keys in two uneven runs (2 kv heads, ``group`` query
    heads each; large scores, so the running maximum moves)."""
    gen = torch.Generator().manual_seed(5)
    num_kv_heads, slots = 2, 400
    k_cache = (torch.randn(slots, num_kv_heads, head_dim, generator=gen) * 3).to(torch.bfloat16)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    query = torch.randn(tokens, num_kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    runs = torch.tensor([[300, 70], [7, 80], [200, tokens]])
    return query, k_cache, v_cache, runs, head_dim ** -0.5


@pytest.mark.skipif(not (VECTOR_CPU and cpu_kernels.load() and cpu_kernels.has_bf16_dot()),
                    reason="needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("head_dim,group,tokens", [(64, 3, 45), (34, 4, 33), (80, 1, 17), (128, 2, 130)])
def test_bfloat16_prefill_on_pair_dot_products_matches_float64_attention(threads, head_dim, group, tokens):
    """With AVX512-BF16 (no AMX) bfloat16 chunks run on vdpbf16ps: Q K^T of bfloat16 pairs (exact products, float32
    sums) and P V with P rounded to bfloat16. Its output is float64 attention on the same inputs up to bfloat16's
    rounding of P and of the output (causal, GQA, uneven runs, an odd count of keys in a block, head sizes that are not
    multiples of 16 or 32), no further from it than the widened float32 kernel's output but for that rounding, and
    not equal to it (so the pair path really runs); the dispatcher sends bfloat16 here."""
    query, k_cache, v_cache, runs, scale = bfloat16_prefill_case(head_dim, group, tokens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, wide, routed = torch.zeros_like(query), torch.zeros_like(query), torch.zeros_like(query)
        torch.ops.prefixserve_cpu.prefill_attention_f32(query, k_cache, v_cache, runs, scale, out)
        torch.ops.prefixserve_cpu.prefill_attention_f32(query, k_cache, v_cache, runs, scale, wide, bf16_dot=False)
        if not cpu_kernels.has_amx():
            cpu_kernels.prefill_attention(query, k_cache, v_cache, runs, scale, routed)
            assert torch.equal(routed, out)
    finally:
        torch.set_num_threads(before)
    index = torch.cat([torch.arange(start, start + length) for start, length in runs.tolist()])
    keys = k_cache[index].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    values = v_cache[index].double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ keys.transpose(1, 2) * scale
    cached = len(index) - tokens
    visible = torch.arange(len(index))[None] <= cached + torch.arange(tokens)[:, None]
    reference = (torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ values).transpose(0, 1)
    torch.testing.assert_close(out.double(), reference, rtol=0.01, atol=0.01)
    assert (out.double() - reference).abs().max() <= (wide.double() - reference).abs().max() + 0.008
    assert not torch.equal(out, wide)
    assert (out.float() - wide.float()).abs().max() <= 2.0 ** -6  # values ~1: P's rounding, then the output's


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_after_cached_context_matches_float64_attention(device, dtype):
    """The device-generic path of a prompt chunk after cached context (GQA, scattered pages). On a GPU it passes
    ``causal_lower_right`` to SDPA instead of a boolean mask (flash attention in bfloat16, keys and values not
    repeated for the groups); on the CPU, the mask."""
    g = torch.Generator().manual_seed(3)
    page, q_len, ctx_len, heads, kv_heads, dim = 16, 40, 150, 9, 3, 64
    pages = torch.randperm(16, generator=g)[: -(-ctx_len // page)]
    slots = (pages[:, None] * page + torch.arange(page)).reshape(-1)[:ctx_len]
    kv_cache = torch.randn(1, 2, 16, page, kv_heads, dim, generator=g).to(device, dtype)
    query = torch.randn(q_len, heads, dim, generator=g).to(device, dtype)
    key = torch.randn(q_len, kv_heads, dim, generator=g).to(device, dtype)
    value = torch.randn(q_len, kv_heads, dim, generator=g).to(device, dtype)
    new_slots = slots[ctx_len - q_len :].to(device)
    meta = PagedAttentionMetadata(kv_cache=kv_cache, slot_mapping=new_slots, decode=None,
                                  prefills=[PrefillSlice(0, q_len, ctx_len, slots.to(device))])
    k_cache, v_cache = pa.store_kv(kv_cache, 0, new_slots, key, value)
    got = pa._attend_prefill_masked(meta, 0, query, key, value, k_cache, v_cache, 0.125, None)
    k = k_cache.cpu().double()[slots].repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
    v = v_cache.cpu().double()[slots].repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.cpu().double(), k) * 0.125
    visible = torch.arange(ctx_len)[None, :] <= torch.arange(ctx_len - q_len, ctx_len)[:, None]
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(got.cpu().double(), expected, rtol=0, atol=1e-5 if dtype == torch.float32 else 3e-2)
