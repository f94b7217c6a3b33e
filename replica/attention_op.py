"""Paged attention as one opaque custom op, ``torch.ops.prefixserve.paged_attention``, for compiled model code.

``torch.compile`` sees the op as a black box with a fake (meta) implementation that only gives the output's shape,
so it never traces the per-step Python of the paged read (page runs, prefill slices, shared-prefix decode groups).
Everything between two attention calls is compiled; the attention itself runs ``replica.paged_attention.attend``.

The op's tensor arguments are only the layer's query/key/value; everything that changes from step to step in ways
the graph must not specialize on (the pool tensor, slot mapping, page runs, masks) is the step's
``PagedAttentionMetadata``, built once per step by the model runner and published for the duration of the forward
pass with ``forward_context`` (thread-local, so engines stepping in different threads don't see each other's)::

    with forward_context(metadata):
        logits = compiled_forward(ids_and_positions, logits_index)   # every layer's op reads `metadata`

The op writes the layer's new K/V into the pool (a side effect the compiler does not see: the pool is not an
argument, so functionalization never copies it); its output depends only on its arguments within one step, and each
layer's call has a different ``layer_idx``, so the compiler can neither merge nor drop calls.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from replica.paged_attention import PagedAttentionMetadata, attend

OP_NAME = "prefixserve::paged_attention"
_state = threading.local()


@contextmanager
def forward_context(metadata: PagedAttentionMetadata) -> Iterator[None]:
    """Make ``metadata`` the current step's paged-attention metadata in this thread."""
    previous = getattr(_state, "metadata", None)
    _state.metadata = metadata
    try:
        yield
    finally:
        _state.metadata = previous


def current_metadata() -> PagedAttentionMetadata:
    metadata = getattr(_state, "metadata", None)
    if metadata is None:
        raise RuntimeError("paged attention op called outside forward_context(); run the model through ModelRunner")
    return metadata


_library = torch.library.Library("prefixserve", "DEF")
_library.define("paged_attention(Tensor query, Tensor key, Tensor value, int layer_idx, float scaling, "
                "int sliding_window) -> Tensor")


def paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scaling: float, sliding_window: int
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] -> [T, H, D]; ``sliding_window`` 0 means none. Writes K/V into the
    current step's pool (see the module docstring)."""
    return attend(
        current_metadata(), layer_idx, query, key, value, scaling, sliding_window if sliding_window > 0 else None
    )


# Registered with the plain operator library rather than ``torch.library.custom_op``: the engine runs inference only,
# and custom_op's autograd layer and output-aliasing check took ~6 us of Python a call where this takes ~3 (a decode
# step of the tiny Llama makes 8 calls; BENCHMARKS.md 0ze). One implementation for every device.
_library.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME)
def _(query, key, value, layer_idx, scaling, sliding_window):
    return torch.empty_like(query, memory_format=torch.contiguous_format)
