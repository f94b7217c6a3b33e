"""The Triton kernels of ``replica.cuda_graphs``: paged decode attention for CUDA graphs, split over the context
(flash-decoding), one query row per sequence, its keys and values read through the page table. Imported only where
a graph's attention runs on Triton (a GPU), or by the tests under Triton's interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEY_TILE = 32
"""Keys per iteration of the Triton kernel."""


def _num_splits(num_rows: int, num_kv_heads: int) -> int:
    """Context splits per (row, kv head): enough programs to spread a small batch over the GPU's multiprocessors. A
    power of two, so that the graphs of all batch sizes compile the kernel for at most six values of ``SPLITS`` (a
    constant of the kernel: each value is a Triton compile at start-up)."""
    wanted = max(1, min(32, 256 // (num_rows * num_kv_heads)))
    return 1 << (wanted.bit_length() - 1)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 context_lens: torch.Tensor, page_size: int, scale: float, window: int) -> torch.Tensor:
    """``replica.cuda_graphs.paged_decode_attention`` on Triton: one program per (row, kv head, split) computes the
    split's partial softmax (max, sum, weighted values), and a second kernel combines the splits. The query may be a
    strided view (rows and heads of any stride, the head dimension contiguous): the compact model's rotated q and k
    share one tensor on a GPU."""
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_p = triton.next_power_of_2(head_dim)
    splits = _num_splits(num_rows, num_kv_heads)
    if query.stride(2) != 1:
        query = query.contiguous()
    part_max = torch.empty(num_rows, num_kv_heads, splits, group_p, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(num_rows, num_kv_heads, splits, group_p, head_p, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(num_rows, num_kv_heads, splits)](
        query, k_cache, v_cache, page_table, context_lens, part_max, part_sum, part_acc, scale,
        query.stride(0), query.stride(1), page_table.stride(0), page_size, num_kv_heads, group, group_p, head_dim,
        head_p, splits, KEY_TILE, window,
    )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _decode_combine_kernel[(num_rows, num_kv_heads)](
        part_max, part_sum, part_acc, out, num_kv_heads, group, group_p, head_dim, head_p, splits,
    )
    return out



@triton.jit
def _decode_split_kernel(Q, K, V, PageTable, ContextLens, PartMax, PartSum, PartAcc, scale, stride_qr, stride_qh,
                         stride_pt,
                         PAGE: tl.constexpr, KVH: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                         HEAD: tl.constexpr, HEAD_P: tl.constexpr, SPLITS: tl.constexpr, TILE: tl.constexpr,
                         WINDOW: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ContextLens + row)
    if WINDOW > 0:
        first = tl.maximum(ctx - WINDOW, 0)
    else:
        first = ctx * 0
    # this split's keys: an equal share of [first, ctx), rounded up to whole tiles
    per_split = tl.cdiv(tl.cdiv(ctx - first, SPLITS), TILE) * TILE
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, ctx)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_P)
    g_ok = g < GROUP
    d_ok = d < HEAD
    heads = kv_head * GROUP + g
    q = tl.load(Q + row * stride_qr + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    s_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_P], tl.float32)
    for start in range(lo, hi, TILE):
        n = start + tl.arange(0, TILE)
        n_ok = n < hi
        page = tl.load(PageTable + row * stride_pt + n // PAGE, mask=n_ok, other=0)
        slot = page * PAGE + n % PAGE
        offsets = (slot * KVH + kv_head)[:, None] * HEAD + d[None, :]
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + offsets, mask=kv_ok, other=0.0).to(tl.float32)  # [TILE, HEAD_P]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_P, TILE]
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(V + offsets, mask=kv_ok, other=0.0).to(tl.float32)
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    base = (row * KVH + kv_head) * SPLITS + split
    tl.store(PartMax + base * GROUP_P + g, m)
    tl.store(PartSum + base * GROUP_P + g, s_sum)
    tl.store(PartAcc + (base * GROUP_P + g)[:, None] * HEAD_P + d[None, :], acc)

@triton.jit
def _decode_combine_kernel(PartMax, PartSum, PartAcc, Out, KVH: tl.constexpr, GROUP: tl.constexpr,
                           GROUP_P: tl.constexpr, HEAD: tl.constexpr, HEAD_P: tl.constexpr,
                           SPLITS: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_P)
    base = (row * KVH + kv_head) * SPLITS
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    for split in range(SPLITS):
        m = tl.maximum(m, tl.load(PartMax + (base + split) * GROUP_P + g))
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_P], tl.float32)
    for split in range(SPLITS):
        part_m = tl.load(PartMax + (base + split) * GROUP_P + g)
        weight = tl.where(part_m == float("-inf"), 0.0, tl.exp(part_m - m))  # an empty split weighs nothing
        total += tl.load(PartSum + (base + split) * GROUP_P + g) * weight
        acc += tl.load(PartAcc + ((base + split) * GROUP_P + g)[:, None] * HEAD_P + d[None, :]) * weight[:, None]
    out = acc / total[:, None]
    heads = kv_head * GROUP + g
    tl.store(Out + (row * KVH * GROUP + heads)[:, None] * HEAD + d[None, :], out.to(Out.dtype.element_ty),
             mask=(g < GROUP)[:, None] & (d < HEAD)[None, :])
