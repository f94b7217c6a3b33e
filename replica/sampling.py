"""The sampler: greedy, temperature, top-k, top-p, per-request seeds (``SamplingParams`` is in common/types.py)."""

from __future__ import annotations

import torch

from common.types import SamplingParams


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of ``logits`` [num_rows, vocab] (float32 is used for the math)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        tokens[row] = _sample_row(logits[row], p, generators[row])
    return tokens


def _sample_row(row_logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = row_logits / p.temperature
    if p.top_k and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop = cumulative - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, sorted_idx, sorted_probs)
    return draw(probs, generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with the given probabilities (1-D, summing to ~1, zeros never drawn): the first index whose
    cumulative probability exceeds one uniform number. ``torch.multinomial`` draws an exponential number for every
    entry of the vocabulary, ~570 us a row for 8192 entries on the AMX Xeon (2 ms of a 4-row decode step); this is
    one uniform number, a cumulative sum and a binary search, ~30 us."""
    probs = probs.detach().to("cpu", torch.float64)  # GPU logits: one copy of the row (the result is read anyway)
    cumulative = torch.cumsum(probs, 0)
    target = torch.rand(1, generator=generator, dtype=torch.float64) * cumulative[-1]
    index = int(torch.searchsorted(cumulative, target, right=True))
    if index >= probs.numel():  # the product rounded up to the total: the last token that can be drawn
        index = int(torch.nonzero(probs).max())
    return index
