"""Attention over the page pool, plugged into transformers' modeling code through its attention-function registry.

Every layer of the model calls ``paged_attention`` with the packed batch's query/key/value (RoPE applied, K/V not yet
repeated for grouped-query attention). It writes the new K/V into the pool at ``slot_mapping`` (slot = page_id *
page_size + offset), then attends each sequence's queries to its whole context read back from its pages:

    packed batch  T = | seq A chunk (q_len 3) | seq B (decode) | seq C (decode) |
    seq A context     | cached page 0 ...... | new tokens |     <- bottom-right causal: query i sees kv <= its position

Sequences with more than one query token (prefill chunks) are attended one by one; all single-token queries (decodes)
are batched into one padded SDPA call. Masks are built once per step (``PagedAttentionMetadata``) and shared by layers;
sliding windows (Mistral, Gemma3) are applied on the paged read: key j is visible to query position p when
``p - window < j <= p``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

ATTENTION_NAME = "prefixserve_paged"


@dataclass
class PrefillSlice:
    """One sequence's multi-token chunk inside the packed batch."""

    q_start: int
    q_len: int
    ctx_len: int
    kv_slots: torch.Tensor | None
    """Pool slots of the whole context [ctx_len]; None when the chunk is the whole context (nothing cached) or when
    the context lies in consecutive pages (then ``kv_start`` is set)."""
    kv_start: int | None = None
    """First pool slot when the context's pages are consecutive: K/V are read as a view, with no gather copy."""


@dataclass
class DecodeRow:
    """One single-token query: its place in the packed batch, its context length, and its page table."""

    q_index: int
    ctx_len: int
    page_ids: list[int]


@dataclass
class DecodeBatch:
    """All single-token queries of the step. Each is attended over views of its pages, one view per run of
    consecutive pages, so no K/V is copied (a gather of every context each step costs more than the attention)."""

    rows: list[DecodeRow]
    page_size: int
    q_indices: torch.Tensor  # [B] positions in the packed batch
    _runs: dict = field(default_factory=dict)

    def runs(self, row: int, window: int | None) -> list[tuple[int, int]]:
        """``(first_slot, num_tokens)`` of each run of consecutive slots holding the row's visible context."""
        cache_key = (row, window)
        if cache_key not in self._runs:
            decode_row = self.rows[row]
            self._runs[cache_key] = slot_runs(decode_row.page_ids, decode_row.ctx_len, self.page_size, window)
        return self._runs[cache_key]


def slot_runs(page_ids: Sequence[int], ctx_len: int, page_size: int, window: int | None) -> list[tuple[int, int]]:
    """Split token range [lo, ctx_len) into runs of consecutive pool slots (lo = ctx_len - window, or 0).

        pages   | 7 | 8 | 9 | 2 | 3 |     ctx_len = 4.5 pages
        runs    |  slots 7*ps .. 10*ps  | 2*ps .. 3*ps + half |
    """
    lo = max(0, ctx_len - window) if window is not None else 0
    runs: list[tuple[int, int]] = []
    pos = lo
    while pos < ctx_len:
        page_index = pos // page_size
        first_slot = page_ids[page_index] * page_size + pos % page_size
        end = min(ctx_len, (page_index + 1) * page_size)
        if runs and runs[-1][0] + runs[-1][1] == first_slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + end - pos)
        else:
            runs.append((first_slot, end - pos))
        pos = end
    return runs


@dataclass
class PagedAttentionMetadata:
    kv_cache: torch.Tensor
    """The pool's KV tensor [layers, 2, num_pages, page_size, kv_heads, head_dim]."""
    slot_mapping: torch.Tensor
    """[T] pool slot for each packed token."""
    prefills: list[PrefillSlice]
    decode: DecodeBatch | None
    _mask_cache: dict = field(default_factory=dict)

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """Bool mask [q_len, ctx_len] (True = visible) for prefill slice ``index``; None means plain causal."""
        part = self.prefills[index]
        if part.kv_slots is None and part.kv_start is None and window is None:
            return None
        cache_key = ("prefill", index, window)
        if cache_key not in self._mask_cache:
            device = self.slot_mapping.device
            q_pos = torch.arange(part.ctx_len - part.q_len, part.ctx_len, device=device)[:, None]
            kv_pos = torch.arange(part.ctx_len, device=device)[None, :]
            mask = kv_pos <= q_pos
            if window is not None:
                mask &= kv_pos > q_pos - window
            self._mask_cache[cache_key] = mask
        return self._mask_cache[cache_key]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [1, H, T, D], key/value [1, KVH, T, D] -> ([1, T, H, D], None)."""
    if paged_metadata is None:
        raise RuntimeError("paged attention called without paged_metadata; run the model through ModelRunner")
    meta = paged_metadata
    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    num_kv_heads = key.shape[1]
    layer_cache = meta.kv_cache[module.layer_idx]
    k_cache = layer_cache[0].view(-1, num_kv_heads, head_dim)
    v_cache = layer_cache[1].view(-1, num_kv_heads, head_dim)
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    output = query.new_empty(num_tokens, num_heads, head_dim)
    for index, part in enumerate(meta.prefills):
        q = query[:, :, part.q_start : part.q_start + part.q_len]
        if part.kv_start is not None:
            k = k_cache[part.kv_start : part.kv_start + part.ctx_len].transpose(0, 1)[None]
            v = v_cache[part.kv_start : part.kv_start + part.ctx_len].transpose(0, 1)[None]
        elif part.kv_slots is None:
            k = key[:, :, part.q_start : part.q_start + part.q_len]
            v = value[:, :, part.q_start : part.q_start + part.q_len]
        else:
            k = k_cache.index_select(0, part.kv_slots).transpose(0, 1)[None]
            v = v_cache.index_select(0, part.kv_slots).transpose(0, 1)[None]
        mask = meta.prefill_mask(index, sliding_window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=num_kv_heads != num_heads
        )
        output[part.q_start : part.q_start + part.q_len] = out[0].transpose(0, 1)

    if meta.decode is not None:
        batch = meta.decode
        group = num_heads // num_kv_heads
        # grouped-query trick: the `group` query heads sharing a kv head become that head's query rows
        queries = query[0].index_select(1, batch.q_indices).transpose(0, 1)  # [B, H, D]
        outs = []
        for row in range(len(batch.rows)):
            q = queries[row].view(num_kv_heads, group, head_dim)
            outs.append(_attend_runs(q, k_cache, v_cache, batch.runs(row, sliding_window), scaling))
        output.index_copy_(0, batch.q_indices, torch.stack(outs).reshape(len(outs), num_heads, head_dim))
    return output[None], None


def _attend_runs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: list[tuple[int, int]], scaling: float | None
) -> torch.Tensor:
    """One query token (as [kv_heads, group, D]) attending to every key in ``runs`` (all visible)."""
    if len(runs) == 1:
        start, length = runs[0]
        k = k_cache[start : start + length].transpose(0, 1)
        v = v_cache[start : start + length].transpose(0, 1)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scaling)[0]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.cat(
        [torch.matmul(q, k_cache[start : start + length].permute(1, 2, 0)) for start, length in runs], dim=-1
    )
    probs = torch.softmax(scores.float() * scale, dim=-1).to(q.dtype)
    out = None
    offset = 0
    for start, length in runs:
        part = torch.matmul(probs[..., offset : offset + length], v_cache[start : start + length].transpose(0, 1))
        out = part if out is None else out + part
        offset += length
    return out


def register_paged_attention() -> str:
    """Register ``paged_attention`` with transformers (idempotent); returns the name to select it by."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
