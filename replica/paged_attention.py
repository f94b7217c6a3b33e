"""Attention over the page pool, plugged into transformers' modeling code through its attention-function registry.

Every layer of the model calls ``paged_attention`` with the packed batch's query/key/value (RoPE applied, K/V not yet
repeated for grouped-query attention). It writes the new K/V into the pool at ``slot_mapping`` (slot = page_id *
page_size + offset), then attends each sequence's queries to its whole context read back from its pages:

    packed batch  T = | seq A chunk (q_len 3) | seq B (decode) | seq C (decode) |
    seq A context     | cached page 0 ...... | new tokens |     <- bottom-right causal: query i sees kv <= its position

Sequences with more than one query token (prefill chunks) are attended one by one. Single-token queries (decodes) read
their context as views of runs of consecutive pages (no gather copy). Decodes whose contexts begin with the same pool
slots — requests sharing a cached prefix — are attended together over that shared run: one matmul of all their queries
against its keys and one against its values, so the shared prefix's K/V are read once per layer instead of once per
request; each request's own pages are attended separately and the softmax spans both parts:

    rows a, b, c   | shared prefix pages (same slots) | own pages |
    scores         | [q_a; q_b; q_c] @ K_shared^T     | q_x @ K_own^T per row |  -> softmax per row over the concatenation
    output         | P_shared @ V_shared (one matmul) + P_own @ V_own per row |

On CPU (``_attend_segments``) no context is gathered and no mask is built: every query row's context is a few runs
of consecutive pool slots, each run is attended in place by ATen's flash kernel (which also returns each row's
log-sum-exp), and the parts are merged exactly by their log-sum-exp; rows sharing a prefix run attend it in one call.
A chunk with nothing before it is one causal SDPA call. Decode rows (and one-token chunks) go to one C++ kernel call
per layer instead when it is built (``replica.cpu_kernels``): every row's runs in one pass, with the running softmax
kept inside the kernel, and rows sharing a prefix run read it once. The gathered/masked SDPA path below is the device-generic
one (GPU, and CPU prefill chunks longer than a sliding window).

``attend`` is the whole computation, token-major; it is called by ``paged_attention`` (transformers' attention
function interface) and by the custom op ``prefixserve::paged_attention`` (``replica.attention_op``) that the compact,
compiled model code uses (``replica.llama``). Masks are built once per step (``PagedAttentionMetadata``) and shared by
layers; sliding windows (Mistral, Gemma3) are applied on the paged read: key j is visible to query position p when
``p - window < j <= p``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from replica import cpu_kernels

ATTENTION_NAME = "prefixserve_paged"
_CPU_SEGMENTS = True
"""CPU steps use ``_attend_segments``; False runs the device-generic path on CPU too (tests compare the two)."""
_CPU_DECODE_KERNEL = True
"""CPU decode rows use the C++ kernel when it is built; False keeps ATen's flash kernel per run (tests compare)."""
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CPU_PREFILL_KERNEL = True
"""bfloat16 prompt chunks (without a sliding window) are attended by the AMX kernel when the CPU and the build have
it; False keeps ATen's flash kernel run by run (tests and benchmarks compare)."""


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
    context_runs: list[tuple[int, int]] = field(default_factory=list)
    """``(first_slot, num_tokens)`` runs of the context before the chunk (cached or computed by earlier chunks): the
    CPU path attends the chunk's queries to each run in place (see ``_attend_segments``)."""
    kv_runs: list[tuple[int, int]] = field(default_factory=list)
    """The same for the whole context, the chunk's own tokens included (CPU): the AMX prefill kernel's keys."""


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

    def gather_plan(self, rows: list[int], window: int | None) -> "GatherPlan":
        """Slots and padding mask of ``rows``' visible contexts (see ``_attend_gathered``), built once per step."""
        cache_key = ("gather", tuple(rows), window)
        if cache_key not in self._runs:
            self._runs[cache_key] = gather_plan([self.runs(row, window) for row in rows], self.q_indices.device)
        return self._runs[cache_key]

    def plan(self, window: int | None) -> tuple[list[SharedRunGroup], list[int]]:
        """Rows grouped by a shared leading run (see ``group_shared_runs``), and the rows attended alone. Sharing one
        page gains nothing measurable (benchmarks/decode_attention.py), so a group must share two or more."""
        cache_key = ("plan", window)
        if cache_key not in self._runs:
            self._runs[cache_key] = group_shared_runs(
                [self.runs(row, window) for row in range(len(self.rows))], min_shared=2 * self.page_size
            )
        return self._runs[cache_key]


@dataclass(frozen=True)
class SharedRunGroup:
    """Decode rows whose visible contexts all begin with the slots ``[start, start + length)``."""

    rows: list[int]
    start: int
    length: int
    private_runs: list[list[tuple[int, int]]]
    """Per row (same order as ``rows``): the runs after the shared part (may be empty)."""


def group_shared_runs(
    runs_per_row: Sequence[list[tuple[int, int]]], min_shared: int
) -> tuple[list[SharedRunGroup], list[int]]:
    """Group rows whose first run starts at the same slot; the group shares the shortest of those first runs.

    Same slot = same memory, so the shared keys and values are identical for every row of the group (positions were
    applied when they were written). Groups sharing fewer than ``min_shared`` tokens, and rows alone, are returned as
    single rows.
    """
    by_start: dict[int, list[int]] = {}
    for row, runs in enumerate(runs_per_row):
        if runs:
            by_start.setdefault(runs[0][0], []).append(row)
    groups: list[SharedRunGroup] = []
    singles: list[int] = [row for row, runs in enumerate(runs_per_row) if not runs]
    for start, rows in by_start.items():
        length = min(runs_per_row[row][0][1] for row in rows)
        if len(rows) < 2 or length < min_shared:
            singles.extend(rows)
            continue
        private = []
        for row in rows:
            (_, first_len), *rest = runs_per_row[row]
            head = [(start + length, first_len - length)] if first_len > length else []
            private.append(head + list(rest))
        groups.append(SharedRunGroup(rows, start, length, private))
    return groups, sorted(singles)


def slot_runs(
    page_ids: Sequence[int], ctx_len: int, page_size: int, window: int | None, start: int = 0
) -> list[tuple[int, int]]:
    """Split token range [lo, ctx_len) into runs of consecutive pool slots (lo = ``start``, or ctx_len - window when
    that is later).

        pages   | 7 | 8 | 9 | 2 | 3 |     ctx_len = 4.5 pages
        runs    |  slots 7*ps .. 10*ps  | 2*ps .. 3*ps + half |
    """
    lo = max(start, ctx_len - window) if window is not None else start
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
    """[T - num_padding] pool slot for each packed token."""
    prefills: list[PrefillSlice]
    decode: DecodeBatch | None
    num_padding: int = 0
    """Trailing packed rows that are padding (not in ``slot_mapping``: their K/V are not written); they attend to
    nothing and their output rows are zeros."""
    _step_cache: dict = field(default_factory=dict)
    """Built once per step and shared by every layer: prefill masks (device-generic path), segment plans (CPU)."""

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor | CausalBias | None:
        """Bool mask [q_len, ctx_len] (True = visible) for prefill slice ``index``; None means plain causal. On a GPU
        a chunk after cached context without a window gets ``causal_lower_right`` (causal aligned bottom-right), which
        SDPA runs on flash attention (bfloat16 / float16) without building the mask; where neither flash nor the
        memory-efficient kernel can take it (float32 with GQA), SDPA builds the mask itself."""
        part = self.prefills[index]
        if part.ctx_len == part.q_len and window is None:
            return None
        if window is None and self.slot_mapping.is_cuda:
            return causal_lower_right(part.q_len, part.ctx_len)
        cache_key = ("prefill", index, window)
        if cache_key not in self._step_cache:
            device = self.slot_mapping.device
            q_pos = torch.arange(part.ctx_len - part.q_len, part.ctx_len, device=device)[:, None]
            kv_pos = torch.arange(part.ctx_len, device=device)[None, :]
            mask = kv_pos <= q_pos
            if window is not None:
                mask &= kv_pos > q_pos - window
            self._step_cache[cache_key] = mask
        return self._step_cache[cache_key]


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
    output = attend(
        paged_metadata, module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        scaling, sliding_window,
    )
    return output[None], None


def store_kv(kv_cache: torch.Tensor, layer_idx: int, slot_mapping: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one layer's new keys and values ([N, KVH, D]) into the pool at ``slot_mapping`` [N]; returns that layer's
    pool as K and V views ``[slots, KVH, D]``."""
    layer_cache = kv_cache[layer_idx]
    k_cache = layer_cache[0].view(-1, key.shape[1], key.shape[2])
    v_cache = layer_cache[1].view(-1, key.shape[1], key.shape[2])
    k_cache.index_copy_(0, slot_mapping, key)
    v_cache.index_copy_(0, slot_mapping, value)
    return k_cache, v_cache


def attend(
    meta: PagedAttentionMetadata,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """One layer's attention for the packed batch, token-major: query [T, H, D], key/value [T, KVH, D] (RoPE
    applied, K/V not repeated for GQA) -> a new tensor [T, H, D]. Writes key/value into the pool at
    ``meta.slot_mapping`` first."""
    if not isinstance(meta, PagedAttentionMetadata):  # a graphed decode step (replica.cuda_graphs)
        return meta.attend(layer_idx, query, key, value, scaling, sliding_window)
    num_tokens, num_heads, head_dim = query.shape
    num_real = num_tokens - meta.num_padding
    one_call = _kernel_step_plan(meta, query, sliding_window)
    if one_call is not None:  # every part on the C++ kernels (the usual step): store and attend in one call
        return cpu_kernels.attend_layer(query, key, value, meta.kv_cache, layer_idx, meta.slot_mapping, num_real,
                                        one_call, head_dim**-0.5 if scaling is None else scaling)
    num_kv_heads = key.shape[1]
    k_cache, v_cache = store_kv(meta.kv_cache, layer_idx, meta.slot_mapping,
                                key[:num_real] if meta.num_padding else key,
                                value[:num_real] if meta.num_padding else value)

    if query.device.type == "cpu" and _CPU_SEGMENTS:
        return _attend_segments(meta, query, key, value, k_cache, v_cache, scaling, sliding_window)
    output = query.new_empty(num_tokens, num_heads, head_dim)
    if meta.num_padding:
        output[num_tokens - meta.num_padding :].zero_()
    for index, part in enumerate(meta.prefills):
        output[part.q_start : part.q_start + part.q_len] = _attend_prefill_masked(
            meta, index, query, key, value, k_cache, v_cache, scaling, sliding_window
        )

    if meta.decode is not None:
        batch = meta.decode
        group = num_heads // num_kv_heads
        # grouped-query trick: the `group` query heads sharing a kv head become that head's query rows
        queries = query.index_select(0, batch.q_indices)  # [B, H, D]
        queries = queries.reshape(len(batch.rows), num_kv_heads, group, head_dim)
        outs: list[torch.Tensor | None] = [None] * len(batch.rows)
        groups, singles = batch.plan(sliding_window)
        for shared in groups:
            group_out = _attend_shared(queries[shared.rows], k_cache, v_cache, shared, scaling)
            for index, row in enumerate(shared.rows):
                outs[row] = group_out[index]
        if singles:
            gathered = _attend_gathered(queries[singles], k_cache, v_cache, batch.gather_plan(singles, sliding_window),
                                        scaling)
            for index, row in enumerate(singles):
                outs[row] = gathered[index]
        output.index_copy_(0, batch.q_indices, torch.stack(outs).reshape(len(outs), num_heads, head_dim))
    return output


def _attend_prefill_masked(
    meta: PagedAttentionMetadata,
    index: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """Prefill slice ``index`` attended with SDPA over its whole context and a bottom-right causal (and window) mask
    (``PagedAttentionMetadata.prefill_mask``); returns ``[q_len, H, D]``."""
    part = meta.prefills[index]
    q = query[part.q_start : part.q_start + part.q_len].transpose(0, 1)[None]
    if part.kv_start is not None:
        k = k_cache[part.kv_start : part.kv_start + part.ctx_len].transpose(0, 1)[None]
        v = v_cache[part.kv_start : part.kv_start + part.ctx_len].transpose(0, 1)[None]
    elif part.kv_slots is None and part.ctx_len == part.q_len:
        k = key[part.q_start : part.q_start + part.q_len].transpose(0, 1)[None]
        v = value[part.q_start : part.q_start + part.q_len].transpose(0, 1)[None]
    else:
        slots = part.kv_slots if part.kv_slots is not None else _run_slots(part.context_runs, part, meta.slot_mapping)
        k = k_cache.index_select(0, slots).transpose(0, 1)[None]
        v = v_cache.index_select(0, slots).transpose(0, 1)[None]
    mask = meta.prefill_mask(index, window)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out[0].transpose(0, 1)


def _run_slots(runs: list[tuple[int, int]], part: PrefillSlice, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Pool slots of a prefill slice's whole context: its context runs, then the chunk's own slots."""
    context = [torch.arange(start, start + length, device=slot_mapping.device) for start, length in runs]
    return torch.cat([*context, slot_mapping[part.q_start : part.q_start + part.q_len]])


_flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""ATen's CPU flash-attention kernel: reads strided (in-pool) K/V without copying them and returns the log-sum-exp
of each query row's scores with the output, so parts of one softmax computed separately can be merged exactly."""


@dataclass(frozen=True)
class Segment:
    """Query rows attending to one run of consecutive pool slots: ``rows`` are packed positions (a prefill chunk's
    tokens or decode rows), ``[start, start + length)`` the slots; ``causal_own``: the chunk's own new tokens instead
    (read from the step's key/value, causal)."""

    rows: torch.Tensor
    start: int
    length: int
    causal_own: bool = False
    single_row: int | None = None
    """The packed position when ``rows`` has one element (read without indexing a tensor)."""


@dataclass(frozen=True)
class SegmentPlan:
    """Every segment of one step (the same for all layers), built once per step and window."""

    segments: list[Segment]
    positions: torch.Tensor
    """Concatenated ``rows`` of all segments, in order (the merge's index)."""
    num_covered: int
    """Distinct positions covered; equal to ``len(positions)`` when no row has more than one segment."""
    direct: list[int]
    """Prefill slices attended in one SDPA call (``_attend_prefill_masked``): those with no context before them
    (plain causal, nothing to merge) and those longer than the sliding window (masked)."""
    prefill_kernel: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(prefill slice, its key runs [R, 2]) attended by the AMX prefill kernel, one call each, written in place; not in
    ``segments``."""
    decode_kernel: "DecodeKernelPlan | None" = None
    """The decode rows, when the C++ decode kernel attends them (``replica.cpu_kernels``); their segments are then
    not in ``segments``."""


@dataclass(frozen=True)
class DecodeKernelPlan:
    """The decode rows' segments as the C++ kernel reads them (``replica/csrc/decode_attention.cpp``).

    A component is a set of rows and every segment touching them: a shared-run group (its shared run, then each row's
    own runs) or a row alone. Components share no rows, so the kernel runs them in parallel."""

    segments: torch.Tensor
    """[S, 4] int64: first slot, length, and the segment's rows as a range of ``rows``."""
    rows: torch.Tensor
    """int64 packed positions: the rows of each segment, then of each component."""
    components: torch.Tensor
    """[C, 4] int64: its segments as a range of ``segments``, its rows as a range of ``rows``."""

    @staticmethod
    def build(batch: "DecodeBatch", window: int | None) -> "DecodeKernelPlan":
        segments: list[tuple[int, int, int, int]] = []
        rows: list[int] = []
        components: list[tuple[int, int, int, int]] = []

        def add_segment(positions: list[int], start: int, length: int) -> None:
            segments.append((start, length, len(rows), len(rows) + len(positions)))
            rows.extend(positions)

        def add_component(first_segment: int, positions: list[int]) -> None:
            components.append((first_segment, len(segments), len(rows), len(rows) + len(positions)))
            rows.extend(positions)

        groups, singles = batch.plan(window)
        for shared in groups:
            first = len(segments)
            positions = [batch.rows[row].q_index for row in shared.rows]
            add_segment(positions, shared.start, shared.length)
            for position, runs in zip(positions, shared.private_runs):
                for start, length in runs:
                    add_segment([position], start, length)
            add_component(first, positions)
        for row in singles:
            first = len(segments)
            position = batch.rows[row].q_index
            for start, length in batch.runs(row, window):
                add_segment([position], start, length)
            add_component(first, [position])
        as_tensor = lambda values, width: torch.tensor(values, dtype=torch.long).view(-1, width)  # noqa: E731
        return DecodeKernelPlan(as_tensor(segments, 4), torch.tensor(rows, dtype=torch.long),
                                as_tensor(components, 4))


def segment_plan(meta: PagedAttentionMetadata, window: int | None, decode_kernel: bool = False,
                 prefill_kernel: bool = False) -> SegmentPlan:
    """Segments of every query row (see ``_attend_segments``); with ``decode_kernel`` the decode rows go to a
    ``DecodeKernelPlan`` instead, with ``prefill_kernel`` the prompt chunks (no sliding window) to a C++ prefill kernel."""
    cache_key = ("segments", window, decode_kernel, prefill_kernel)
    if cache_key in meta._step_cache:
        return meta._step_cache[cache_key]
    segments: list[Segment] = []
    direct: list[int] = []
    kernel_prefills: list[tuple[int, torch.Tensor]] = []
    num_covered = 0
    for index, part in enumerate(meta.prefills):
        if prefill_kernel and window is None:
            kernel_prefills.append((index, torch.tensor(part.kv_runs, dtype=torch.long)))
            continue
        if not part.context_runs or (window is not None and part.ctx_len > window):
            direct.append(index)
            continue
        rows = torch.arange(part.q_start, part.q_start + part.q_len)
        segments.append(Segment(rows, part.q_start, part.q_len, causal_own=True))
        segments.extend(Segment(rows, start, length) for start, length in part.context_runs)
        num_covered += part.q_len
    kernel_plan = None
    if meta.decode is not None and decode_kernel:
        kernel_plan = DecodeKernelPlan.build(meta.decode, window)
    elif meta.decode is not None:
        batch = meta.decode
        groups, singles = batch.plan(window)
        for shared in groups:
            segments.append(Segment(batch.q_indices[shared.rows], shared.start, shared.length))
            for row, runs in zip(shared.rows, shared.private_runs):
                segments.extend(_decode_segments(batch, row, runs))
        for row in singles:
            segments.extend(_decode_segments(batch, row, batch.runs(row, window)))
        num_covered += len(batch.rows)
    positions = torch.cat([segment.rows for segment in segments]) if segments else torch.empty(0, dtype=torch.long)
    plan = SegmentPlan(segments, positions, num_covered, direct, kernel_prefills, kernel_plan)
    meta._step_cache[cache_key] = plan
    return plan


def _decode_segments(batch: DecodeBatch, row: int, runs: list[tuple[int, int]]) -> list[Segment]:
    """One segment per run of the row's context. Attending each run in place measured cheaper than gathering the
    rows' runs into one copy for one call, at 2-3 runs per row (decode b4, bf16: 50.6 vs 60.6 ms per step) and at
    10-12 runs per row (63.0 vs 67.1 ms)."""
    rows, position = batch.q_indices[row : row + 1], batch.rows[row].q_index
    return [Segment(rows, start, length, single_row=position) for start, length in runs]


def _attend_segments(
    meta: PagedAttentionMetadata,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """The CPU path of ``attend``: every query row's context is split into segments that each lie in consecutive pool
    slots (``segment_plan``, once per step), each segment is attended in place by one flash-attention call (no
    gather, no mask), and each row's segments are merged by their log-sum-exp (the softmax over the whole context,
    computed in parts)::

        prefill chunk   | context run 0 | context run 1 | own tokens (causal) |   -> 3 calls, merged per query row
        decode rows a,b | shared run (one call for a and b) | a's own run | b's own run |

    Grouped-query attention needs no K/V copy: for the pool's runs the ``group`` query heads of one kv head are that
    head's query rows (one pass over the run's keys for all of them); a chunk's own tokens (causal by position) are
    attended with the kernel's own head mapping.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    by_kv_head = query.view(num_tokens, num_kv_heads, group, head_dim)
    kernels = meta._step_cache.get("kernels")
    if kernels is None:  # the same for every layer of a step (one dtype, head size and pool): decided once
        kernels = meta._step_cache["kernels"] = (_decode_kernel_for(query),
                                                 _prefill_kernel_for(query, k_cache, v_cache))
    plan = segment_plan(meta, window, decode_kernel=kernels[0], prefill_kernel=kernels[1])
    outs: list[torch.Tensor] = []  # [r, kv_heads, group, D] each
    lses: list[torch.Tensor] = []  # [r, kv_heads, group] float32 each
    for segment in plan.segments:
        if segment.causal_own:
            lo, hi = segment.start, segment.start + segment.length
            q = query[lo:hi].transpose(0, 1)[None]
            k, v = key[lo:hi].transpose(0, 1)[None], value[lo:hi].transpose(0, 1)[None]
            out, lse = _flash_attention_cpu(q, k, v, 0.0, True, scale=scaling)  # GQA: the kernel maps heads itself
            outs.append(out[0].transpose(0, 1).view(segment.length, num_kv_heads, group, head_dim))
            lses.append(lse[0].transpose(0, 1).view(segment.length, num_kv_heads, group))
            continue
        num_rows = segment.rows.shape[0]
        if segment.single_row is not None:
            q = by_kv_head[segment.single_row][None]  # [1, kv_heads, group, D]
        else:
            q = by_kv_head.index_select(0, segment.rows).transpose(0, 1).reshape(1, num_kv_heads, num_rows * group,
                                                                                head_dim)
        k = k_cache[segment.start : segment.start + segment.length].transpose(0, 1)[None]
        v = v_cache[segment.start : segment.start + segment.length].transpose(0, 1)[None]
        out, lse = _flash_attention_cpu(q, k, v, 0.0, False, scale=scaling)
        outs.append(out[0].view(num_kv_heads, num_rows, group, head_dim).transpose(0, 1))
        lses.append(lse[0].view(num_kv_heads, num_rows, group).transpose(0, 1))

    output = _merge_segments(outs, lses, plan.positions, plan.num_covered,
                             query.new_zeros(num_tokens, num_heads, head_dim))
    for index, runs in plan.prefill_kernel:
        part = meta.prefills[index]
        rows = slice(part.q_start, part.q_start + part.q_len)
        cpu_kernels.prefill_attention(query[rows].contiguous(), k_cache, v_cache, runs,
                                      head_dim**-0.5 if scaling is None else scaling, output[rows])
    for index in plan.direct:
        part = meta.prefills[index]
        output[part.q_start : part.q_start + part.q_len] = _attend_prefill_masked(
            meta, index, query, key, value, k_cache, v_cache, scaling, window
        )
    if plan.decode_kernel is not None:
        kernels = plan.decode_kernel
        cpu_kernels.decode_attention(query.contiguous(), k_cache, v_cache, kernels.segments, kernels.rows,
                                     kernels.components, output, head_dim**-0.5 if scaling is None else scaling)
    return output


@dataclass
class KernelStepPlan:
    """A step whose every part runs on the C++ kernels, as ``cpu_kernels.attend_layer`` takes it (once per step and
    window)."""

    prefill_rows: torch.Tensor
    """[P, 2] int64: each prompt chunk's first row and row count."""
    prefill_runs: torch.Tensor
    """[R, 2] int64: the chunks' key runs (first slot, length), one chunk after another."""
    run_offsets: torch.Tensor
    """[P + 1] int64: chunk p's runs are ``prefill_runs[run_offsets[p]:run_offsets[p + 1]]``."""
    decode: "DecodeKernelPlan | None"


_NO_ROWS = torch.empty(0, dtype=torch.long)


def _kernel_step_plan(meta: PagedAttentionMetadata, query: torch.Tensor, window: int | None) -> KernelStepPlan | None:
    """The step as one call a layer (``cpu_kernels.attend_layer``) when ``_attend_segments`` would send every part of
    it to a C++ kernel: decode rows to the decode kernel, prompt chunks to the float32 / pair-dot prefill kernel (not
    AMX, no sliding window), on a contiguous pool of the query's dtype; else None."""
    cache_key = ("one call", window)
    if cache_key in meta._step_cache:
        return meta._step_cache[cache_key]
    plan = None
    pool = meta.kv_cache
    if (query.device.type == "cpu" and _CPU_SEGMENTS and pool.dtype == query.dtype and pool.is_contiguous()
            and (meta.prefills or meta.decode is not None)):
        decode_kernel = _decode_kernel_for(query)  # as _attend_segments asks (one segment plan for both)
        prefill_kernel = (bool(meta.prefills) and window is None and not cpu_kernels.prefill_on_amx(query)
                          and _prefill_kernel_for(query, pool, pool))
        if (meta.decode is None or decode_kernel) and (not meta.prefills or prefill_kernel):
            segments = segment_plan(meta, window, decode_kernel=decode_kernel, prefill_kernel=prefill_kernel)
            if not segments.segments and not segments.direct:
                chunks = segments.prefill_kernel
                offsets = [0]
                for _, runs in chunks:
                    offsets.append(offsets[-1] + runs.shape[0])
                rows = [(meta.prefills[index].q_start, meta.prefills[index].q_len) for index, _ in chunks]
                plan = KernelStepPlan(
                    torch.tensor(rows, dtype=torch.long).reshape(-1, 2),
                    torch.cat([runs for _, runs in chunks]) if chunks else _NO_ROWS.view(0, 2),
                    torch.tensor(offsets, dtype=torch.long), segments.decode_kernel)
    meta._step_cache[cache_key] = plan
    return plan


def _prefill_kernel_for(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this step's prompt chunks go to a C++ prefill kernel (``cpu_kernels.prefill_attention``): a contiguous
    pool of the query's dtype, and either bfloat16 with a head size the AMX kernel takes on a CPU and build with AMX
    tiles, or float32 or bfloat16 (widened to float32) up to head size 256 on a build with AVX2 and FMA."""
    if not (_CPU_PREFILL_KERNEL and k_cache.dtype == query.dtype and k_cache.is_contiguous()
            and v_cache.is_contiguous()):
        return False
    if cpu_kernels.prefill_on_amx(query):
        return True
    return (query.dtype in (torch.float32, torch.bfloat16) and query.shape[-1] <= 256
            and cpu_kernels.has_vector_prefill())


def _decode_kernel_for(query: torch.Tensor) -> bool:
    """Whether this step's decode rows go to the C++ kernel (``replica.cpu_kernels``): CPU, a dtype it takes, and
    the kernel built on this machine (``_CPU_DECODE_KERNEL`` lets tests and benchmarks compare with ATen's path)."""
    return _CPU_DECODE_KERNEL and query.dtype in _KERNEL_DTYPES and cpu_kernels.available()


def _merge_segments(
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    positions: torch.Tensor,
    num_covered: int,
    output: torch.Tensor,
) -> torch.Tensor:
    """Combine per-segment attention outputs into ``output`` (zeros ``[T, H, D]``, returned): row p's output is the
    sum of its segments' outputs weighted by ``exp(lse_segment - lse_total)``. Rows no segment covers stay zero."""
    if not outs:
        return output
    num_tokens = output.shape[0]
    out = torch.cat(outs)
    lse = torch.cat(lses)
    num_kv_heads, group, head_dim = out.shape[1:]
    if out.shape[0] == num_covered:  # every row in exactly one segment: nothing to merge
        output.view(num_tokens, num_kv_heads, group, head_dim).index_copy_(0, positions, out)
        return output
    top = lse.new_full((num_tokens, num_kv_heads, group), float("-inf"))
    top.scatter_reduce_(0, positions[:, None, None].expand_as(lse), lse, "amax")
    weight = torch.exp(lse - top.index_select(0, positions))
    total = lse.new_zeros(num_tokens, num_kv_heads, group).index_add_(0, positions, weight)
    merged = lse.new_zeros(num_tokens, num_kv_heads, group, head_dim)
    merged.index_add_(0, positions, out.float() * weight[..., None])
    merged /= total.clamp_min(1e-30)[..., None]
    return output.copy_(merged.view(output.shape))


def _attend_gathered(
    queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: "GatherPlan", scaling: float | None
) -> torch.Tensor:
    """Decode rows (queries ``[n, kv_heads, group, D]``) attending to their own contexts, all in one SDPA call: each
    row's visible K/V slots are gathered into one contiguous ``[n, L_max, kv_heads, D]`` tensor (one copy per layer;
    attending run by run copied each run's strided view inside every matmul, which cost more than the attention),
    shorter rows padded and masked::

        row 0 | slots of run 0 | slots of run 1 |          | <- mask False on the padding
        row 1 | slots of its only run                      |
    """
    num_rows, num_kv_heads, group, head_dim = queries.shape
    k = k_cache.index_select(0, plan.slots).view(num_rows, plan.max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, plan.slots).view(num_rows, plan.max_len, num_kv_heads, head_dim).transpose(1, 2)
    q = queries.reshape(num_rows, num_kv_heads * group, 1, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scaling, enable_gqa=group > 1)
    return out.view(num_rows, num_kv_heads, group, head_dim)


@dataclass(frozen=True)
class GatherPlan:
    """Pool slots of several decode rows' visible contexts, row-major and padded to ``max_len`` (padding: slot 0,
    masked), for ``_attend_gathered``; built once per step and window."""

    slots: torch.Tensor
    """[n * max_len] pool slot of each gathered key."""
    mask: torch.Tensor | None
    """[n, 1, 1, max_len] True where the key is real; None when no row is padded."""
    max_len: int


def gather_plan(runs_per_row: Sequence[list[tuple[int, int]]], device: torch.device) -> GatherPlan:
    lengths = [sum(length for _, length in runs) for runs in runs_per_row]
    max_len = max(lengths)
    slots = np.zeros((len(runs_per_row), max_len), dtype=np.int64)
    for row, runs in enumerate(runs_per_row):
        if runs:
            slots[row, : lengths[row]] = np.concatenate([np.arange(start, start + length) for start, length in runs])
    mask = None
    if min(lengths) < max_len:
        mask = torch.from_numpy(np.arange(max_len)[None, :] < np.array(lengths)[:, None]).to(device)[:, None, None, :]
    return GatherPlan(torch.from_numpy(slots.reshape(-1)).to(device), mask, max_len)


def _attend_shared(
    queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, shared: SharedRunGroup, scaling: float | None
) -> torch.Tensor:
    """Rows of one ``SharedRunGroup`` (queries ``[n, kv_heads, group, D]``) attending to the shared run plus their own
    runs; returns ``[n, kv_heads, group, D]``."""
    num_rows, num_kv_heads, group, head_dim = queries.shape
    scale = scaling if scaling is not None else head_dim**-0.5
    k_shared = k_cache[shared.start : shared.start + shared.length]  # [L, kv_heads, D]
    v_shared = v_cache[shared.start : shared.start + shared.length]
    stacked = queries.permute(1, 0, 2, 3).reshape(num_kv_heads, num_rows * group, head_dim)
    shared_scores = torch.matmul(stacked, k_shared.permute(1, 2, 0)).view(num_kv_heads, num_rows, group, -1)
    shared_probs = []
    private_out = []
    for index, runs in enumerate(shared.private_runs):
        q = queries[index]
        scores = torch.cat([shared_scores[:, index], *_run_scores(q, k_cache, runs)], dim=-1)
        probs = torch.softmax(scores.float() * scale, dim=-1).to(q.dtype)
        shared_probs.append(probs[..., : shared.length])
        private_out.append(_run_values(probs[..., shared.length :], v_cache, runs))
    probs = torch.stack(shared_probs, dim=1).reshape(num_kv_heads, num_rows * group, shared.length)
    out = torch.matmul(probs, v_shared.transpose(0, 1)).view(num_kv_heads, num_rows, group, head_dim)
    return out.permute(1, 0, 2, 3) + torch.stack(private_out)


def _run_scores(q: torch.Tensor, k_cache: torch.Tensor, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """``q @ K^T`` against the keys of each run, one ``[..., run_length]`` score tensor per run."""
    return [torch.matmul(q, k_cache[start : start + length].permute(1, 2, 0)) for start, length in runs]


def _run_values(probs: torch.Tensor, v_cache: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """``probs @ V`` where ``probs`` covers the runs' keys in order; zeros when there are no runs."""
    out = None
    offset = 0
    for start, length in runs:
        part = torch.matmul(probs[..., offset : offset + length], v_cache[start : start + length].transpose(0, 1))
        out = part if out is None else out + part
        offset += length
    if out is None:
        return probs.new_zeros(*probs.shape[:-1], v_cache.shape[-1])
    return out


def register_paged_attention() -> str:
    """Register ``paged_attention`` with transformers (idempotent); returns the name to select it by."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
