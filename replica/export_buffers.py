"""Reused CPU memory for the copies a replica hands out of its process (a peer's host bundle, Ray's object store).

A host bundle is one contiguous tensor of the exported pages (``LLMEngine.export_pages(contiguous=True)``). Allocated
afresh for every export, a tensor of 32 MiB or more is new memory from the kernel each time (glibc maps allocations
that large on their own and unmaps them when freed): filling it cost 8193 page faults and 11-13 ms for the 16 float32
pages of a 2048-token prefix here, against ~1 ms for the same copy into memory already mapped (BENCHMARKS.md, section
0zh). These buffers stay mapped and are handed out again once nothing uses them any more: the storage's use count
says so (the bundle's numpy array, a page's view and Ray's serializer all hold it while they need it), so a buffer is
never written while anything can still read it. (Tier loads sidestep the same cost with one tensor per page,
``tiers.codec.new_page_tensors``; a bundle has to be one array to cross the object store without a second copy.)
"""

from __future__ import annotations

import math
import threading

import torch

MAX_RETAINED_BYTES = 256 << 20
"""At most this much memory is kept for reuse (a larger export, or one past this, gets memory of its own)."""
ROUND_BYTES = 4 << 20
"""Buffers are sized in steps of this, so exports of a few pages more or less reuse one."""


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
"""torch's count of the references to a storage (private: without it no buffer is ever reused)."""


def _unused(buffer: torch.Tensor) -> bool:
    """True when only ``buffer`` (and the wrapper this call makes) holds its storage."""
    return _storage_use_count is not None and _storage_use_count(buffer.untyped_storage()._cdata) <= 2


class ExportBuffers:
    """Thread-safe pool of retained CPU buffers: ``take(shape, dtype)`` answers a tensor of that shape over the start
    of a free buffer (first use: a new one), ``shape``'s elements laid out contiguously from offset 0."""

    def __init__(self, max_retained_bytes: int = MAX_RETAINED_BYTES) -> None:
        self.max_retained_bytes = max_retained_bytes
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        """1-D uint8 tensors, least recently handed out first."""
        self.reused = 0
        self.allocated = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        num_bytes = math.prod(shape) * dtype.itemsize
        if _storage_use_count is None:  # nothing could ever be reused: keep nothing
            self.allocated += 1
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            free = [buffer for buffer in self._buffers if buffer.numel() >= num_bytes and _unused(buffer)]
            if free:
                buffer = min(free, key=torch.Tensor.numel)
                self._drop(buffer)
                self._buffers.append(buffer)
                self.reused += 1
                return buffer[:num_bytes].view(dtype).view(shape)
            size = -(-num_bytes // ROUND_BYTES) * ROUND_BYTES
            for kept in [kept for kept in self._buffers if _unused(kept)]:  # least recently taken first
                if self._kept_bytes() + size <= self.max_retained_bytes:
                    break
                self._drop(kept)
            buffer = torch.empty(size, dtype=torch.uint8)
            self.allocated += 1
            if self._kept_bytes() + size <= self.max_retained_bytes:
                self._buffers.append(buffer)  # else handed out once, not kept (the bound holds)
            return buffer[:num_bytes].view(dtype).view(shape)

    def _drop(self, buffer: torch.Tensor) -> None:
        """Take ``buffer`` out of the list by identity (``list.remove`` would compare tensors with ``==``)."""
        del self._buffers[next(index for index, kept in enumerate(self._buffers) if kept is buffer)]

    def _kept_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._buffers)  # uint8: one element a byte

    def retained_bytes(self) -> int:
        with self._lock:
            return self._kept_bytes()
