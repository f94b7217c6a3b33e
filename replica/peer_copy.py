"""Peer copy: moving pages between replicas without pickling tensors.

The holder exports the pages (pinned while copied, see ``LLMEngine.export_pages``) as a ``PageBundle``: one contiguous
numpy array ``[num_pages, layers, 2, page_size, kv_heads, head_dim]`` plus keys and token ids. Ray stores numpy
arrays in its object store and hands them to the reader zero-copy, so a bundle crosses processes at memory-copy speed
(torch tensors would be pickled). bfloat16 has no numpy dtype: its bits travel as uint16 and are viewed back.

On GPU the same bundle is built from device pages with one device-to-host copy; a device-to-device path (CUDA IPC /
NCCL through Ray's tensor transports) can replace the bundle without changing callers.
"""

from __future__ import annotations

import asyncio
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from replica.page_keys import PageKey

_WIRE_VIEW = {torch.bfloat16: (torch.uint16, "bfloat16"), torch.float16: (torch.uint16, "float16"),
              torch.float32: (torch.float32, "float32")}
_FROM_WIRE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class PageBundle:
    keys: list[PageKey]
    token_ids: list[list[int]]
    kv: np.ndarray
    """[num_pages, layers, 2, page_size, kv_heads, head_dim], raw bits of ``dtype``."""
    dtype: str

    @property
    def num_pages(self) -> int:
        return len(self.keys)


def bundle_pages(pages: list[tuple[PageKey, tuple[int, ...], torch.Tensor]]) -> PageBundle:
    """Pack exported pages into one array (a single copy)."""
    if not pages:
        return PageBundle([], [], np.empty(0, dtype=np.float32), "float32")
    stacked = torch.stack([kv for _, _, kv in pages]).cpu()
    view_dtype, name = _WIRE_VIEW[stacked.dtype]
    return PageBundle(
        keys=[key for key, _, _ in pages],
        token_ids=[list(tokens) for _, tokens, _ in pages],
        kv=stacked.view(view_dtype).numpy(),
        dtype=name,
    )


def unbundle_pages(bundle: PageBundle) -> list[tuple[PageKey, tuple[int, ...], torch.Tensor]]:
    """The pages of a bundle as CPU tensors (views of the bundle's array; the engine copies them into its pool)."""
    if bundle.num_pages == 0:
        return []
    with warnings.catch_warnings():
        # Ray hands the array over read-only (zero copy); it is only read, then copied into the pool
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(np.asarray(bundle.kv))
    dtype = _FROM_WIRE[bundle.dtype]
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    return [(key, tuple(tokens), tensor[index]) for index, (key, tokens) in enumerate(zip(bundle.keys, bundle.token_ids))]


@dataclass
class PeerExportRequest:
    """Ask the replica ``target_replica`` (Serve unique id) for the leading pages of ``keys`` it holds.
    The prefix-aware router sends a request carrying ``target_replica`` to exactly that replica when it is running."""

    target_replica: str
    keys: list[PageKey]


class ServePeerClient:
    """Peer copy over the replica deployment's own Serve handle: the holder's ``export_pages`` answers a
    ``PageBundle`` (numpy, zero-copy through Ray's object store). Transport errors and timeouts raise; the prefix
    fetcher then falls back to the shared tiers."""

    def __init__(self, deployment_name: str, app_name: str, timeout_s: float = 5.0) -> None:
        self.deployment_name = deployment_name
        self.app_name = app_name
        self.timeout_s = timeout_s
        self._handle = None

    def _get_handle(self):
        if self._handle is None:
            from ray import serve

            self._handle = serve.get_deployment_handle(self.deployment_name, self.app_name)
        return self._handle

    async def fetch(self, peer_id: str, keys) -> list[tuple[PageKey, tuple[int, ...], torch.Tensor]]:
        response = self._get_handle().export_pages.remote(PeerExportRequest(peer_id, list(keys)))
        bundle = await asyncio.wait_for(response, timeout=self.timeout_s)
        return unbundle_pages(bundle)
