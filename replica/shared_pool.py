"""Peer copy between CPU replicas of one node: the receiver copies pages straight out of the holder's page pool.

A CPU replica's page pool lives in an anonymous shared-memory file (``memfd_create``) instead of private memory, with
one generation counter per page after the KV. A peer on the same node copies the pages it needs directly from there:

    Holder                                                  Receiver (same node)
      export_pages(PeerExportRequest(node_id=...))  <---      asks, naming its node
      under the export index's lock: the leading run of
      published keys, their page ids and generations  --->    SharedPoolBundle (no page data: ids, generations, where
                                                              the pool is: pid, fd, inode)
                                                              maps the pool read-only (once per holder), copies the
                                                              pages into its own memory, then re-reads the
                                                              generations: a page whose generation moved is dropped,
                                                              with the pages after it

One copy of each byte on the receiver (given landing pages, replica/landing.py, straight into its own pool pages; else
into fresh tensors, then into the pool at admission), none on the holder, nothing through Ray's object store (whose
copies and waits took 20-90 ms for 32 MiB here, benchmarks/kv_sources.py), and no pin or lease: the holder's engine
never waits for a receiver. That is safe because of the export index's rule (replica/export_index.py): a published
page's KV does not change while its key is published, and the engine withdraws a key before it hands the page out
again. ``withdraw`` now also increments the page's generation, under the same lock, before the page can be written. The
receiver reads the generation after its copy: if it still equals the one in the answer, the key was not withdrawn
before the copy ended, so no byte it copied was overwritten (x86-64 keeps both sides' stores and loads in program
order; elsewhere the locks and thread hand-offs on both sides order them). A page that moved is not an error: the fetch
stops there and the request gets the rest from the tiers or recomputes it.

Who may read: the file is the holder's open descriptor, reached as ``/proc/<pid>/fd/<fd>``, which only processes of
the same user (with ptrace-read rights over the holder) can open; nothing is left on any file system, and the memory
is freed when the holder exits and its receivers drop their mappings. The receiver checks the file's device, inode
and size against the answer before mapping it (a reused pid or descriptor number is refused), and maps it read-only.

A receiver that cannot open the pool (another pid namespace, no ``/proc``) asks again for a host bundle
(replica/peer_copy.py), so this path only ever makes a copy faster, never makes it fail. ``node_id()`` names the Ray
node as well as the host, so replicas on two Ray nodes of one machine (tests' multi-node clusters) keep the object
store between them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import math
import mmap
import os
import threading
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from common.page_format import DTYPE_NAME_TO_NUMPY, dtype_name
from common.page_keys import PageKey
from common.types import CacheSource, StreamLocation
from replica.cuda_ipc import host_id
from replica.landing import LandingPages, submit_into
from replica.page_record import PageRecord
from replica.page_stream import StreamServer
from replica.pool_socket import ExportServer

logger = logging.getLogger(__name__)

GENERATION_ALIGN = 64
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


@lru_cache(maxsize=1)
def node_id() -> str:
    """This process's node: the host (name and boot id) plus the Ray node id when Ray is up."""
    try:
        import ray

        if ray.is_initialized():
            return f"{host_id()}/{ray.get_runtime_context().get_node_id()}"
    except Exception:  # noqa: BLE001 - no Ray: the host alone
        pass
    return host_id()


@dataclass(frozen=True)
class PoolLocation:
    """Where a holder's pool is: its process's descriptor of the shared file, that file's device, inode and size, and
    the layout of the KV and generations inside it."""

    pid: int
    fd: int
    device: int
    inode: int
    nbytes: int
    shape: tuple[int, ...]
    """The KV tensor: ``[layers, 2, num_pages, page_size, kv_heads, head_dim]``, contiguous, at offset 0."""
    dtype: str
    generations_offset: int
    """Byte offset of the int64 generation of each page (``num_pages`` of them)."""
    socket: str | None = None
    """The holder's export socket (replica/pool_socket.py): a receiver asks it directly next time, without Ray."""


@dataclass(frozen=True)
class SharedPoolBundle:
    """A holder's answer on the same node: the leading pages it holds of the asked keys, by page id and generation."""

    keys: list[PageKey]
    token_ids: list[list[int]]
    page_ids: list[int]
    generations: list[int]
    location: PoolLocation

    @property
    def num_pages(self) -> int:
        return len(self.keys)


class SharedPool:
    """Holder side: the page pool's memory in a shared file, and the pages' generations."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Raises ``OSError`` when the memory cannot be had (no ``memfd_create``, or the fallocate is refused)."""
        numel = math.prod(shape)
        element_size = torch.empty((), dtype=dtype).element_size()
        kv_bytes = numel * element_size
        num_pages = shape[2]
        self.generations_offset = -(-kv_bytes // GENERATION_ALIGN) * GENERATION_ALIGN
        nbytes = self.generations_offset + 8 * num_pages
        self.fd = os.memfd_create("prefixserve-kv-pool", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(self.fd, 0, nbytes)  # commits the memory now: no SIGBUS on a full shm later
            # mapped in up front: a first touch of each 4 KiB page would fault (about 10 us each on a VM: 5 ms for one
            # 2 MiB page of KV written from a fetch)
            self._map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.kv = torch.frombuffer(self._map, dtype=dtype, count=numel).view(shape)
        self.generations = np.frombuffer(self._map, dtype=np.int64, count=num_pages, offset=self.generations_offset)
        status = os.fstat(self.fd)
        self._location = PoolLocation(pid=os.getpid(), fd=self.fd, device=status.st_dev, inode=status.st_ino,
                                     nbytes=nbytes, shape=tuple(shape), dtype=dtype_name(dtype),
                                     generations_offset=self.generations_offset)
        self._closed = False
        self.export_server = None
        self.stream_server: StreamServer | None = None

    @property
    def location(self) -> PoolLocation:
        """Where peers find this pool, naming the export socket while it serves (a closed socket, or one whose accept
        thread ended, is not named: peers would wait on it until their timeout)."""
        server = self.export_server
        if server is not None and server.serving:
            return dataclasses.replace(self._location, socket=server.name)
        return self._location

    def serve_exports(self, answer) -> None:
        """Answer peers' export calls over a local socket too (replica/pool_socket.py); ``answer(keys)`` gives the
        bundle. A socket that cannot be had is logged and skipped: peers then ask through Ray."""
        if self.export_server is not None:
            return
        try:
            self.export_server = ExportServer(answer)
        except OSError as exc:
            logger.warning("no export socket for the shared KV pool (%s); peers ask through Ray", exc)

    def serve_stream(self, answer, host: str) -> None:
        """Send pages to peers on other nodes over TCP too, listening on ``host`` (replica/page_stream.py);
        ``answer(keys)`` as for ``serve_exports``. A port that cannot be had is logged and skipped: peers on other nodes
        then copy through Ray's object store."""
        if self.stream_server is not None:
            return
        try:
            self.stream_server = StreamServer(answer, self.kv, self.generations, host, node=node_id())
        except OSError as exc:
            logger.warning("no page stream for peers on other nodes at %s (%s); they copy through Ray", host, exc)

    @property
    def stream_location(self) -> StreamLocation | None:
        """Where peers on other nodes ask for pages over TCP while the stream serves, else None."""
        server = self.stream_server
        return server.location if server is not None and server.serving else None

    def stop_serving_exports(self) -> None:
        """Close the export socket and the page stream; peers ask through Ray again."""
        if self.export_server is not None:
            self.export_server.close()
            self.export_server = None
        if self.stream_server is not None:
            self.stream_server.close()
            self.stream_server = None

    def bundle(self, keys: list[PageKey], token_ids: list[tuple[int, ...]], page_ids: list[int],
               generations: list[int]) -> SharedPoolBundle:
        return SharedPoolBundle(list(keys), [list(tokens) for tokens in token_ids], list(page_ids), list(generations),
                                self.location)

    def close(self) -> None:
        """Stop offering the pool to peers (the memory itself goes with the last tensor and mapping over it)."""
        self.stop_serving_exports()
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def allocate_shared_pool(shape: tuple[int, ...], dtype: torch.dtype) -> SharedPool | None:
    """A shared pool, or None (logged) where this system cannot give one: the pool is then private memory."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return SharedPool(shape, dtype)
    except OSError as exc:
        logger.warning("the KV pool could not be placed in shared memory (%s); peers on this node copy pages through "
                       "the object store", exc)
        return None


class PoolReader:
    """Receiver side: copies pages out of holders' pools, keeping the last few holders' pools mapped."""

    def __init__(self, max_mappings: int = 64) -> None:
        self.max_mappings = max_mappings
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="peer-pool-copy")
        """Copies run on this one thread: the pages' memory then comes back to the same malloc arena when they are
        freed and is reused by the next copy, already mapped in (on whichever of the event loop's worker threads,
        fetches measured 11-120 ms instead of 11-15 for the same 32 MiB, mostly faulting fresh memory in)."""
        self._mappings: collections.OrderedDict[tuple[int, int, int], tuple[torch.Tensor, np.ndarray]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_stale_pages = 0
        """Pages dropped because the holder reused them while they were copied (or before)."""

    async def copy(self, bundle: SharedPoolBundle, landing: LandingPages | None = None) -> list[PageRecord]:
        """``copy_pages`` on this reader's thread, into ``landing``'s pool pages when they may be written (their
        records then name them: ``PageRecord.landing_page``; replica/landing.py)."""
        job, out = submit_into(self.executor, functools.partial(self.copy_pages, bundle), landing, 0, bundle.num_pages)
        pages = await asyncio.wrap_future(job)
        if out is None:
            return pages
        return [dataclasses.replace(page, landing_page=landing.page_ids[index]) if page.kv is out[index] else page
                for index, page in enumerate(pages)]

    def copy_pages(self, bundle: SharedPoolBundle, out: list[torch.Tensor] | None = None) -> list[PageRecord]:
        """The leading pages of ``bundle`` whose generation held through the copy, as tensors owned here, or written
        into ``out[i]`` for page i when ``out`` has a page of the holder's shape and dtype for each (else tensors of
        their own: the caller's check of the pages refuses them). Raises ``OSError`` / ``ValueError`` if the holder's
        pool cannot be opened or is not the one the bundle names."""
        if not bundle.num_pages:
            return []
        kv, generations = self._mapped(bundle.location)
        if out is not None and len(out) >= bundle.num_pages and all(
                view.shape == kv.shape[:2] + kv.shape[3:] and view.dtype == kv.dtype for view in out[: bundle.num_pages]):
            copies = out[: bundle.num_pages]  # straight into the receiver's pool pages: one pass over the bytes
            for view, page_id in zip(copies, bundle.page_ids):
                view.copy_(kv[:, :, page_id])
        else:
            copies = [kv[:, :, page_id].clone() for page_id in bundle.page_ids]
        now = generations[bundle.page_ids].tolist()  # after the copies: see the module docstring
        num_valid = 0
        while num_valid < len(copies) and now[num_valid] == bundle.generations[num_valid]:
            num_valid += 1
        self.num_stale_pages += len(copies) - num_valid
        return [PageRecord(key, tuple(tokens), copy, CacheSource.PEER)
                for key, tokens, copy in zip(bundle.keys[:num_valid], bundle.token_ids, copies[:num_valid])]

    def forget(self, location: PoolLocation) -> None:
        with self._lock:
            self._mappings.pop((location.pid, location.fd, location.inode), None)

    def _mapped(self, location: PoolLocation) -> tuple[torch.Tensor, np.ndarray]:
        key = (location.pid, location.fd, location.inode)
        with self._lock:
            found = self._mappings.get(key)
            if found is not None:
                self._mappings.move_to_end(key)
                return found
        found = map_pool(location)
        with self._lock:
            self._mappings[key] = found
            while len(self._mappings) > self.max_mappings:
                self._mappings.popitem(last=False)
        return found


def map_pool(location: PoolLocation) -> tuple[torch.Tensor, np.ndarray]:
    """(KV, generations) of a holder's pool, mapped read-only; the descriptor is closed again (the mapping stays)."""
    if location.dtype not in DTYPE_NAME_TO_NUMPY:
        raise ValueError(f"unsupported pool dtype {location.dtype!r}")
    dtype = getattr(torch, location.dtype)
    fd = os.open(f"/proc/{location.pid}/fd/{location.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        status = os.fstat(fd)
        if (status.st_dev, status.st_ino, status.st_size) != (location.device, location.inode, location.nbytes):
            raise ValueError(f"/proc/{location.pid}/fd/{location.fd} is not the pool the holder named")
        mapped = mmap.mmap(fd, location.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    numel = math.prod(location.shape)
    num_pages = location.shape[2]
    if location.generations_offset < numel * dtype.itemsize or \
            location.generations_offset + 8 * num_pages > location.nbytes:
        raise ValueError("the pool's layout does not fit its file")
    with warnings.catch_warnings():  # read-only on purpose: this process never writes a peer's pool
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        kv = torch.from_numpy(np.frombuffer(mapped, dtype=DTYPE_NAME_TO_NUMPY[location.dtype], count=numel)).view(location.shape)
    # viewed as the pool's own dtype: torch copies uint16 at about half the speed of the same bytes as bfloat16
    # (16 pages of 1 MiB: 3.0 against 1.6 ms here)
    kv = kv.view(dtype)
    generations = np.frombuffer(mapped, dtype=np.int64, count=num_pages, offset=location.generations_offset)
    base = np.frombuffer(mapped, dtype=np.uint8)
    threading.Thread(target=populate, args=(base,), name="prefixserve-map-peer-pool", daemon=True).start()
    return kv, generations


MADV_POPULATE_READ = 22
"""Linux >= 5.14: map a range's pages in now, as a read would."""
POPULATE_CHUNK_BYTES = 64 << 20


def populate(mapped: np.ndarray) -> None:
    """Map the pages of a peer's pool into this process ahead of the copies (each first read of a 4 KiB page faults:
    about 10 us on a VM, 80 ms for 32 MiB), in the background and in chunks: a pool of gigabytes takes about a
    second. ``madvise`` through ctypes releases the GIL. Failing (an older kernel) only means copies fault instead."""
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        address, nbytes = mapped.ctypes.data, mapped.nbytes
        for offset in range(0, nbytes, POPULATE_CHUNK_BYTES):
            if madvise(address + offset, min(POPULATE_CHUNK_BYTES, nbytes - offset), MADV_POPULATE_READ) != 0:
                return
    except Exception:  # noqa: BLE001 - an optimisation only
        logger.debug("populating a peer's pool failed", exc_info=True)
