"""CUDA graphs of decode steps: one graph per decode batch size, captured at start-up, replayed by the model runner.

A decode step of the compact model on a GPU launches a few hundred small kernels (about 20 per layer); eagerly, their
launches cost more than their work for models of this size (BENCHMARKS.md section 3: ~10 ms per step on an H200 for a
512 x 8 model). A graph replays them all with one launch. A graph fixes its tensors' addresses and shapes, so every
input of a decode step lives in one static device buffer, filled before each replay by one host-to-device copy::

    flat (int64) | ids [B_max] | positions [B_max] | slots [B_max] | context lens [B_max] | block table [B_max, W] |

and the graph of batch size ``B`` reads the first ``B`` entries of each part. Attention inside the graph is
``paged_decode_attention``: each row attends over its own pages through the block table, to the length the buffer
says; nothing in it depends on the host at replay. Steps the graphs do not cover run as before: prompt chunks, mixed
steps, batches above ``max_batch``, and rows whose pages exceed the table's width ``W``.

The attention kernel (Triton, split over the context so that a lone sequence still spreads over the GPU) is written
here; where Triton is missing the same function runs on ATen over the whole table width (correct, slower). Both run
on the CPU too, where the tests compare them with the runner's ordinary path (``capture=False`` runs the static
buffers without graphs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 64
"""Decode batches up to this size are captured (one graph each, every size: no padding rows to mask)."""

try:  # optional: the GPU image carries Triton; the CPU-only install does not need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class GraphDecodeMetadata:
    """The paged-attention metadata of a graphed decode step (``replica.paged_attention.attend`` hands such a step
    to ``attend``): views of the static buffers, the same objects at capture and at every replay."""

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    """[B] pool slot of each row's new token."""
    block_table: torch.Tensor
    """[B, W] int64: each row's pages in order (entries past its context are never read)."""
    context_lens: torch.Tensor
    """[B] int64: each row's context length, its new token included."""
    page_size: int
    use_triton: bool

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, window: int | None) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        layer_cache = self.kv_cache[layer_idx]
        k_cache = layer_cache[0].view(-1, num_kv_heads, head_dim)
        v_cache = layer_cache[1].view(-1, num_kv_heads, head_dim)
        k_cache.index_copy_(0, self.slot_mapping, key)
        v_cache.index_copy_(0, self.slot_mapping, value)
        scale = scaling if scaling is not None else head_dim**-0.5
        return paged_decode_attention(query, k_cache, v_cache, self.block_table, self.context_lens, self.page_size,
                                      scale, window or 0, use_triton=self.use_triton)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor, page_size: int, scale: float,
                           window: int, *, use_triton: bool) -> torch.Tensor:
    """One query row per sequence: query [B, H, D]; k_cache / v_cache [slots, KVH, D]; ``block_table`` [B, W] and
    ``context_lens`` [B] (int64) on the device. Row ``b`` attends to positions ``[max(0, len - window), len)`` of its
    context (``window`` 0: all). Returns [B, H, D] in the query's dtype. Static shapes, no host synchronisation."""
    if use_triton:
        return _triton_decode(query, k_cache, v_cache, block_table, context_lens, page_size, scale, window)
    return _aten_decode(query, k_cache, v_cache, block_table, context_lens, page_size, scale, window)


def _aten_decode(query, k_cache, v_cache, block_table, context_lens, page_size, scale, window):
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    width = block_table.shape[1] * page_size
    slots = (block_table[:, :, None] * page_size + torch.arange(page_size, device=query.device)).reshape(num_rows, -1)
    k = k_cache.index_select(0, slots.reshape(-1)).view(num_rows, width, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, slots.reshape(-1)).view(num_rows, width, num_kv_heads, head_dim).transpose(1, 2)
    pos = torch.arange(width, device=query.device)[None, :]
    lens = context_lens[:, None]
    visible = pos < lens
    if window:
        visible = visible & (pos >= lens - window)
    out = F.scaled_dot_product_attention(query[:, :, None, :], k, v, attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out.view(num_rows, num_heads, head_dim)


BLOCK_N = 32
"""Keys per iteration of the Triton kernel."""


def _num_splits(num_rows: int, num_kv_heads: int) -> int:
    """Context splits per (row, kv head): enough programs to spread a small batch over the GPU's multiprocessors. A
    power of two, so that the graphs of all batch sizes compile the kernel for at most six values of ``SPLITS`` (a
    constant of the kernel: each value is a Triton compile at start-up)."""
    wanted = max(1, min(32, 256 // (num_rows * num_kv_heads)))
    return 1 << (wanted.bit_length() - 1)


def _triton_decode(query, k_cache, v_cache, block_table, context_lens, page_size, scale, window):
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_p = triton.next_power_of_2(head_dim)
    splits = _num_splits(num_rows, num_kv_heads)
    query = query.contiguous()
    part_max = torch.empty(num_rows, num_kv_heads, splits, group_p, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(num_rows, num_kv_heads, splits, group_p, head_p, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(num_rows, num_kv_heads, splits)](
        query, k_cache, v_cache, block_table, context_lens, part_max, part_sum, part_acc, scale,
        block_table.stride(0), page_size, num_kv_heads, group, group_p, head_dim, head_p, splits, BLOCK_N, window,
    )
    out = torch.empty_like(query)
    _decode_combine_kernel[(num_rows, num_kv_heads)](
        part_max, part_sum, part_acc, out, num_kv_heads, group, group_p, head_dim, head_p, splits,
    )
    return out


if triton is not None:

    @triton.jit
    def _decode_split_kernel(Q, K, V, BlockTable, ContextLens, PartMax, PartSum, PartAcc, scale, stride_bt,
                             PAGE: tl.constexpr, KVH: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                             HEAD: tl.constexpr, HEAD_P: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                             WINDOW: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ContextLens + row)
        if WINDOW > 0:
            first = tl.maximum(ctx - WINDOW, 0)
        else:
            first = ctx * 0
        # this split's keys: an equal share of [first, ctx), rounded up to whole blocks
        per_split = tl.cdiv(tl.cdiv(ctx - first, SPLITS), BLOCK) * BLOCK
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, ctx)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_P)
        g_ok = g < GROUP
        d_ok = d < HEAD
        heads = kv_head * GROUP + g
        q = tl.load(Q + (row * KVH * GROUP + heads)[:, None] * HEAD + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        s_sum = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_P], tl.float32)
        for start in range(lo, hi, BLOCK):
            n = start + tl.arange(0, BLOCK)
            n_ok = n < hi
            page = tl.load(BlockTable + row * stride_bt + n // PAGE, mask=n_ok, other=0)
            slot = page * PAGE + n % PAGE
            offsets = (slot * KVH + kv_head)[:, None] * HEAD + d[None, :]
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + offsets, mask=kv_ok, other=0.0).to(tl.float32)  # [BLOCK, HEAD_P]
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_P, BLOCK]
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


class DecodeGraphs:
    """Static decode buffers of one model runner and, on CUDA, a captured graph per batch size ``1..max_batch``.

    ``forward(ids_pos, logits_index)`` is the model's (the compact model, eager); ``forward_context`` is
    ``replica.attention_op.forward_context``. ``capture=False`` keeps the buffers and the static-shape forward but
    runs it eagerly each step (the CPU tests run the whole path that way)."""

    def __init__(self, forward, forward_context, kv_cache: torch.Tensor, *, page_size: int, max_batch: int,
                 max_pages_per_seq: int, capture: bool = True, use_triton: bool | None = None) -> None:
        self.forward = forward
        self.forward_context = forward_context
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.max_batch = max_batch
        self.width = max_pages_per_seq
        self.device = kv_cache.device
        if use_triton is None:
            use_triton = triton is not None and self.device.type == "cuda"
        self.use_triton = use_triton
        mb, width = max_batch, self.width
        size = 4 * mb + mb * width
        self.flat = torch.zeros(size, dtype=torch.int64, device=self.device)
        pin = self.device.type == "cuda"
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._staging_np = self.staging.numpy()
        self._copied = torch.cuda.Event() if pin else None
        """Recorded after each copy out of ``staging``: the next step waits for it before writing ``staging``."""
        self.ids_pos = self.flat[: 2 * mb].view(2, mb)
        self.slots = self.flat[2 * mb : 3 * mb]
        self.context_lens = self.flat[3 * mb : 4 * mb]
        self.block_table = self.flat[4 * mb :].view(mb, width)
        self.logits_index = torch.arange(mb, dtype=torch.int64, device=self.device)
        self.context_lens.fill_(1)
        self.captured = capture and self.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        """Steps served by the graphs (or by the static path when not captured)."""
        self.capture_seconds = 0.0
        if self.captured:
            self._capture_all()

    def metadata(self, batch: int) -> GraphDecodeMetadata:
        return GraphDecodeMetadata(self.kv_cache, self.slots[:batch], self.block_table[:batch],
                                   self.context_lens[:batch], self.page_size, self.use_triton)

    def _run_static(self, batch: int) -> torch.Tensor:
        with self.forward_context(self.metadata(batch)):
            return self.forward(self.ids_pos[:, :batch], self.logits_index[:batch])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture the largest batch first, so that smaller graphs reuse its memory pool blocks. The throwaway steps
        write K/V into slot 0 of every layer; the pool is cleared afterwards (it holds nothing yet)."""
        start = time.perf_counter()
        pool = None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for batch in range(self.max_batch, 0, -1):
                self._run_static(batch)  # warm-up: lazy initialisation (cuBLAS handles, Triton compiles) happens here
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    self.outputs[batch] = self._run_static(batch)
                if pool is None:
                    pool = graph.pool()
                self.graphs[batch] = graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.kv_cache.zero_()
        self.capture_seconds = time.perf_counter() - start

    def covers(self, rows: Sequence[tuple[int, int, Sequence[int]]]) -> bool:
        """Whether a decode step of ``rows`` (token, context length, page ids) can run here."""
        if not rows or len(rows) > self.max_batch:
            return False
        return all(-(-ctx_len // self.page_size) <= self.width for _, ctx_len, _ in rows)

    @torch.inference_mode()
    def run(self, rows: Sequence[tuple[int, int, Sequence[int]]]) -> torch.Tensor:
        """Logits [B, vocab] (float32, a new tensor) of one decode step: each row is (token id, context length with
        the new token, page ids); its new token's position is ``context length - 1``."""
        batch, mb, ps, width = len(rows), self.max_batch, self.page_size, self.width
        host = self._staging_np
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the staging buffer (normally long done)
        for index, (token, ctx_len, page_ids) in enumerate(rows):
            position = ctx_len - 1
            num_pages = -(-ctx_len // ps)
            host[index] = token
            host[mb + index] = position
            host[2 * mb + index] = page_ids[position // ps] * ps + position % ps
            host[3 * mb + index] = ctx_len
            table = 4 * mb + index * width
            host[table : table + num_pages] = page_ids[:num_pages]
        self.flat.copy_(self.staging, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.replays += 1
        if not self.captured:
            return self._run_static(batch).clone()
        self.graphs[batch].replay()
        return self.outputs[batch].clone()
