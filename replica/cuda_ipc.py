"""Peer copy on GPUs of one machine: device to device through CUDA IPC, no trip through host memory.

Holder                                                   Receiver (same host, sees the holder's GPU)
  export_pages(PeerExportRequest(ipc_target=...))  <---    asks, naming its host and the GPUs it can see
  pages -> one staging tensor on the holder's GPU
  synchronize, open an IPC handle, keep the staging
  tensor under a lease                             --->    CudaIpcBundle (handle + keys + token ids, no tensor data)
                                                           maps the staging tensor, copies it into its own memory
                                                           (one device-to-device copy), unmaps it
  release_pages(PeerRelease(lease_id))             <---    releases the lease
  drops the staging tensor

The holder decides: it answers with a ``CudaIpcBundle`` only when the receiver runs on the same host (hostname and
kernel boot id) and lists the holder's GPU (by UUID) among the GPUs it can see; otherwise with a host ``PageBundle``
(replica/peer_copy.py), which also serves other nodes through Ray's object store. A receiver that fails to open the
handle asks again for a host bundle, so CUDA IPC only ever makes a copy faster, never makes it fail.

Leases bound what a receiver that never answers can pin: a lease expires after ``lease_ttl_s`` and is dropped at the
next export. (Torch's own IPC reference count keeps the memory alive while a receiver still has it mapped; memory a
receiver that died mid-copy had mapped is returned only when the holder exits.)

The handle travels as plain fields (bytes, ints, strings), so the bundle needs no pickled torch objects.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from common.page_keys import PageKey
from common.page_format import dtype_name
from common.types import CacheSource
from replica.page_record import PageRecord


@dataclass(frozen=True)
class IpcTarget:
    """Who asks: its host identity and the UUIDs of the GPUs it can see (in its own device order)."""

    host_id: str
    gpu_uuids: tuple[str, ...]


@dataclass(frozen=True)
class CudaIpcHandle:
    """``UntypedStorage._share_cuda_()`` of the staging tensor, as plain fields."""

    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


@dataclass(frozen=True)
class CudaIpcBundle:
    """Pages held on the holder's GPU: ``[num_pages, layers, 2, page_size, kv_heads, head_dim]`` of ``dtype``."""

    keys: list[PageKey]
    token_ids: list[list[int]]
    lease_id: str
    gpu_uuid: str
    handle: CudaIpcHandle
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_pages(self) -> int:
        return len(self.keys)


@dataclass
class PeerRelease:
    """Tell the holder ``target_replica`` that the receiver is done with lease ``lease_id`` (routed like an export)."""

    target_replica: str
    lease_id: str


@lru_cache(maxsize=1)
def host_id() -> str:
    """This host: its name plus the kernel's boot id (two containers on one host usually differ by name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot_id = file.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{socket.gethostname()}/{boot_id}"


def gpu_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


@lru_cache(maxsize=1)
def visible_gpu_uuids() -> tuple[str, ...]:
    """UUIDs of the GPUs this process can see, in its own device order (empty without CUDA)."""
    return tuple(gpu_uuid(index) for index in range(torch.cuda.device_count()))


def local_ipc_target() -> IpcTarget | None:
    """This process as a receiver of CUDA IPC bundles, or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return IpcTarget(host_id(), visible_gpu_uuids())


class IpcExporter:
    """Holder side: turns device pages into ``CudaIpcBundle``s and keeps each staging tensor until released."""

    def __init__(self, device: torch.device, lease_ttl_s: float = 30.0) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC needs a CUDA device, got {device}")
        self.device = device
        self.gpu_uuid = gpu_uuid(device)
        self.lease_ttl_s = lease_ttl_s
        self._leases: dict[str, tuple[torch.Tensor, float]] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-{id(self):x}"
        self._lock = threading.Lock()

    def can_serve(self, target: IpcTarget | None) -> bool:
        return target is not None and target.host_id == host_id() and self.gpu_uuid in target.gpu_uuids

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def export(self, pages: list[PageRecord]) -> CudaIpcBundle:
        """``pages`` (device tensors, any order of memory) -> a bundle over one new staging tensor, leased."""
        self._expire()
        with torch.cuda.device(self.device):
            staging = torch.stack([page.kv for page in pages]).contiguous()
            torch.cuda.current_stream().synchronize()  # the receiver reads it on another stream of another process
            share = staging.untyped_storage()._share_cuda_()
        _device, storage_handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync = share
        lease_id = f"{self._prefix}-{next(self._ids)}"
        with self._lock:
            self._leases[lease_id] = (staging, time.monotonic() + self.lease_ttl_s)
        return CudaIpcBundle(
            keys=[page.key for page in pages],
            token_ids=[list(page.token_ids) for page in pages],
            lease_id=lease_id,
            gpu_uuid=self.gpu_uuid,
            handle=CudaIpcHandle(bytes(storage_handle), int(size_bytes), int(offset_bytes), bytes(ref_handle),
                                 int(ref_offset), None if event_handle is None else bytes(event_handle),
                                 bool(event_sync)),
            shape=tuple(staging.shape),
            dtype=dtype_name(staging.dtype),
        )

    def release(self, lease_id: str) -> bool:
        """Drop the staging tensor of ``lease_id`` (False: unknown or already expired)."""
        with self._lock:
            found = self._leases.pop(lease_id, None) is not None
        torch.cuda.ipc_collect()
        return found

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [lease_id for lease_id, (_, deadline) in self._leases.items() if deadline < now]
            for lease_id in expired:
                del self._leases[lease_id]
        if expired:
            torch.cuda.ipc_collect()


def open_bundle(bundle: CudaIpcBundle, device: torch.device | None = None) -> list[PageRecord]:
    """Receiver side: copy the bundle's pages into memory of this process, on ``device`` (default: the holder's GPU
    as this process numbers it). The holder's memory is unmapped before this returns; release the lease afterwards.
    Raises if the holder's GPU is not visible here or the handle cannot be opened."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuids = visible_gpu_uuids()
    if bundle.gpu_uuid not in uuids:
        raise RuntimeError(f"GPU {bundle.gpu_uuid} is not visible to this process")
    holder_index = uuids.index(bundle.gpu_uuid)
    if device is None:
        device = torch.device("cuda", holder_index)
    dtype = getattr(torch, bundle.dtype)
    shape = tuple(bundle.shape)
    stride = torch.empty(shape, dtype=dtype, device="meta").stride()
    handle = bundle.handle
    mapped = rebuild_cuda_tensor(
        torch.Tensor, torch.Size(shape), stride, 0, torch.storage.TypedStorage, dtype, holder_index,
        handle.storage_handle, handle.storage_size_bytes, handle.storage_offset_bytes, False,
        handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle, handle.event_sync_required,
    )
    with torch.cuda.device(device):
        copied = mapped.to(device, copy=True)
        torch.cuda.current_stream().synchronize()
    del mapped
    return [PageRecord(key, tuple(tokens), copied[index], CacheSource.PEER)
            for index, (key, tokens) in enumerate(zip(bundle.keys, bundle.token_ids))]
