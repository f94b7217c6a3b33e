"""CUDA graphs of decode steps: one graph per decode batch size, captured at start-up, replayed by the model runner.

A decode step of the compact model on a GPU launches 14-20 small kernels per layer (compiled / eager); eagerly,
launching them and the Python around them cost far more than their work for models of this size (BENCHMARKS.md
section 3b, on an H200: 6.5-17.7 ms per eager batch-1 decode step, 0.7-1.6 ms replayed). A graph replays them all
with one launch. A graph fixes its tensors' addresses and shapes, so every input of a decode step lives in one static
device buffer, filled before each replay by one host-to-device copy::

    flat (int64) | ids, positions [2 * B_max] | slots [B_max] | context lens [B_max] | page table [B_max, W] |

and the graph of batch size ``B`` reads the first ``B`` entries of each part; its ids and positions are the
contiguous ``[2, B]`` at the start of the first part (ids, then positions: the layout depends on ``B``, so that the
forward's input is a whole tensor, as a compiled forward expects). A compiled forward takes two rows or more
(``replica.compile``): its batch-1 graph runs two copies of the row, which write the same K/V into the same slot.
Attention inside the graph is ``paged_decode_attention``: each row attends over its own pages through the page
table, to the length the buffer says; nothing in it depends on the host at replay. Steps the graphs do not cover run
as before: prompt chunks, mixed steps, batches above ``max_batch``, and rows whose pages exceed the table's width
``W``.

The attention kernel (Triton, split over the context so that a lone sequence still spreads over the GPU) is in
``replica.triton_decode``; where Triton is missing, the same function runs on ATen over the whole table width
(correct, slower). Both run on the CPU too (Triton under its interpreter), where the tests compare them with a float64
reference and the static path with the runner's ordinary path (``capture=False`` runs the static buffers without
graphs).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from replica.paged_attention import store_kv

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 64
"""Decode batches up to this size are captured (one graph each, every size: no padding rows to mask)."""


def triton_available() -> bool:
    """Whether Triton is installed. This module imports it (``replica.triton_decode``) only when a graph's attention
    first runs on it (a GPU), so it imports and runs without Triton; where Triton is installed, torch's inductor loads
    it in any process that compiles."""
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class GraphDecodeMetadata:
    """The paged-attention metadata of a graphed decode step (``replica.paged_attention.attend`` hands such a step
    to ``attend``): views of the static buffers, the same objects at capture and at every replay."""

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    """[B] pool slot of each row's new token."""
    page_table: torch.Tensor
    """[B, W] int64: each row's pages in order (entries past its context are never read)."""
    context_lens: torch.Tensor
    """[B] int64: each row's context length, its new token included."""
    page_size: int
    use_triton: bool

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, window: int | None) -> torch.Tensor:
        k_cache, v_cache = store_kv(self.kv_cache, layer_idx, self.slot_mapping, key, value)
        scale = scaling if scaling is not None else key.shape[2] ** -0.5
        return paged_decode_attention(query, k_cache, v_cache, self.page_table, self.context_lens, self.page_size,
                                      scale, window or 0, use_triton=self.use_triton)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, context_lens: torch.Tensor, page_size: int, scale: float,
                           window: int, *, use_triton: bool) -> torch.Tensor:
    """One query row per sequence: query [B, H, D]; k_cache / v_cache [slots, KVH, D]; ``page_table`` [B, W] and
    ``context_lens`` [B] (int64) on the device. Row ``b`` attends to positions ``[max(0, len - window), len)`` of its
    context (``window`` 0: all). Returns [B, H, D] in the query's dtype. Static shapes, no host synchronisation."""
    if use_triton:
        from replica.triton_decode import paged_decode

        return paged_decode(query, k_cache, v_cache, page_table, context_lens, page_size, scale, window)
    return _aten_decode(query, k_cache, v_cache, page_table, context_lens, page_size, scale, window)


def _aten_decode(query, k_cache, v_cache, page_table, context_lens, page_size, scale, window):
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    width = page_table.shape[1] * page_size
    slots = (page_table[:, :, None] * page_size + torch.arange(page_size, device=query.device)).reshape(num_rows, -1)
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


class DecodeGraphs:
    """Static decode buffers of one model runner and, on CUDA, a captured graph per batch size ``1..max_batch``.

    ``forward(ids_pos, logits_index)`` is the model's (the compact model, eager or compiled: ``min_rows`` 2, the
    fewest rows it takes); ``forward_context`` is ``replica.attention_op.forward_context``. ``capture=False`` keeps
    the buffers and the static-shape forward but runs it without graphs each step (the CPU tests run the whole path
    that way)."""

    def __init__(self, forward, forward_context, kv_cache: torch.Tensor, *, page_size: int, max_batch: int,
                 max_pages_per_seq: int, capture: bool = True, use_triton: bool | None = None,
                 min_rows: int = 1) -> None:
        self.forward = forward
        self.forward_context = forward_context
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.max_batch = max_batch
        self.min_rows = min_rows
        self.width = max_pages_per_seq
        self.device = kv_cache.device
        if use_triton is None:
            use_triton = self.device.type == "cuda" and triton_available()
        self.use_triton = use_triton
        mb, width = max(max_batch, min_rows), self.width
        self.rows_capacity = mb
        size = 4 * mb + mb * width
        with torch.inference_mode():  # as the runner's own step inputs: a compiled forward guards on it
            self.flat = torch.zeros(size, dtype=torch.int64, device=self.device)
            self.logits_index = torch.arange(mb, dtype=torch.int64, device=self.device)
            self.flat[3 * mb : 4 * mb].fill_(1)  # context lengths
        pin = self.device.type == "cuda"
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._staging_np = self.staging.numpy()
        self._copied = torch.cuda.Event() if pin else None
        """Recorded after each copy out of ``staging``: the next step waits for it before writing ``staging``."""
        self.slots = self.flat[2 * mb : 3 * mb]
        self.context_lens = self.flat[3 * mb : 4 * mb]
        self.page_table = self.flat[4 * mb :].view(mb, width)
        self.captured = capture and self.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        """Steps served by the graphs (or by the static path when not captured)."""
        self.capture_seconds = 0.0
        if self.captured:
            self._capture_all()

    def metadata(self, batch: int) -> GraphDecodeMetadata:
        return GraphDecodeMetadata(self.kv_cache, self.slots[:batch], self.page_table[:batch],
                                   self.context_lens[:batch], self.page_size, self.use_triton)

    def _run_static(self, batch: int) -> torch.Tensor:
        """Logits of the first ``batch`` rows; the forward runs ``max(batch, min_rows)``."""
        rows = max(batch, self.min_rows)
        with self.forward_context(self.metadata(rows)):
            logits = self.forward(self.flat[: 2 * rows].view(2, rows), self.logits_index[:rows])
        return logits[:batch]

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
        batch, mb, ps, width = len(rows), self.rows_capacity, self.page_size, self.width
        rows = list(rows) + [rows[-1]] * (self.min_rows - batch)
        host = self._staging_np
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the staging buffer (normally long done)
        for index, (token, ctx_len, page_ids) in enumerate(rows):
            position = ctx_len - 1
            num_pages = -(-ctx_len // ps)
            host[index] = token
            host[len(rows) + index] = position
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
