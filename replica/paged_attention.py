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
class DecodeBatch:
    """All single-token queries of the step, padded to the longest context."""

    q_indices: torch.Tensor  # [B] positions in the packed batch
    kv_slots: torch.Tensor  # [B, max_ctx] (padding points at slot 0 and is masked)
    q_positions: torch.Tensor  # [B]
    kv_valid: torch.Tensor  # [B, max_ctx] bool


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

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """Bool mask [B, 1, 1, max_ctx] for the decode batch."""
        cache_key = ("decode", window)
        if cache_key not in self._mask_cache:
            batch = self.decode
            mask = batch.kv_valid
            if window is not None:
                kv_pos = torch.arange(mask.shape[1], device=mask.device)[None, :]
                mask = mask & (kv_pos > batch.q_positions[:, None] - window)
            self._mask_cache[cache_key] = mask[:, None, None, :]
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
        num_seqs, max_ctx = batch.kv_slots.shape
        group = num_heads // num_kv_heads
        # grouped-query trick: the `group` query heads sharing a kv head become that head's query rows
        q = query[0].index_select(1, batch.q_indices).transpose(0, 1).reshape(num_seqs, num_kv_heads, group, head_dim)
        flat_slots = batch.kv_slots.reshape(-1)
        k = k_cache.index_select(0, flat_slots).view(num_seqs, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, flat_slots).view(num_seqs, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask(sliding_window), scale=scaling)
        output.index_copy_(0, batch.q_indices, out.reshape(num_seqs, num_heads, head_dim))
    return output[None], None


def register_paged_attention() -> str:
    """Register ``paged_attention`` with transformers (idempotent); returns the name to select it by."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
