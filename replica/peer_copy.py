"""Peer copy: moving pages between replicas without pickling tensors.

The holder exports the pages (pinned while copied, off its engine thread: ``LLMEngine.export_pages_concurrently``) as a
``PageBundle``: one contiguous numpy array ``[num_pages, layers, 2, page_size, kv_heads, head_dim]`` plus keys and
token ids. The export copies the pool pages straight into that array (``contiguous=True``), so the holder copies each
byte once before Ray puts it in the object store; the receiver writes the pages into its pool from the store's memory.
Ray stores numpy arrays in its object store and hands them to the reader zero-copy, so a bundle crosses processes at
memory-copy speed (torch tensors would be pickled). bfloat16 has no numpy dtype: its bits travel as uint16 and are
viewed back.

On GPUs of one host the holder answers a ``CudaIpcBundle`` instead (replica/cuda_ipc.py): the receiver maps the
holder's staging tensor and copies it device to device, then releases it. Between CPU replicas of one node it answers
a ``SharedPoolBundle`` (replica/shared_pool.py): the receiver copies the pages straight out of the holder's pool, kept
in shared memory, and checks they were not reused meanwhile; once it knows the holder's export socket, it asks there
instead of through Ray (replica/pool_socket.py: a tenth of a millisecond instead of a 3-4 ms round trip). Across
nodes the receiver asks the holder's page stream (replica/page_stream.py) once it knows it: from the router, which
names it with the peer hint (``learn_stream``), or from the holder's first host bundle. Otherwise, or when the
receiver cannot open the holder's memory, the host bundle above is used (a copy on the holder, the object store, the
write on the receiver).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from common.page_format import dtype_name
from common.page_keys import PageKey
from common.types import CacheSource, StreamLocation
from replica.cuda_ipc import CudaIpcBundle, IpcTarget, PeerRelease, local_ipc_target, open_bundle
from replica.landing import LandingPages, submit_into
from replica.page_record import PageRecord
from replica.page_stream import StreamClient
from replica.pool_socket import ExportClient
from replica.shared_pool import PoolLocation, PoolReader, SharedPoolBundle, node_id

logger = logging.getLogger(__name__)

SOCKET_RETRY_S = 60.0
"""After a holder's export socket (or page stream) failed, neither its answers through Ray nor the router's hints are
used to learn it again for this long."""

_WIRE_VIEW = {torch.bfloat16: torch.uint16, torch.float16: torch.uint16, torch.float32: torch.float32}


@dataclass(frozen=True)
class PageBundle:
    keys: list[PageKey]
    token_ids: list[list[int]]
    kv: np.ndarray
    """[num_pages, layers, 2, page_size, kv_heads, head_dim], raw bits of ``dtype``."""
    dtype: str
    stream: StreamLocation | None = None
    """The holder's page stream (replica/page_stream.py), when it serves one: the receiver asks there next time."""

    @property
    def num_pages(self) -> int:
        return len(self.keys)


def bundle_pages(pages: list[PageRecord]) -> PageBundle:
    """Pack exported pages into one array: no copy when they are already the consecutive slots of one CPU tensor
    (``export_pages(..., contiguous=True)``), else one copy."""
    if not pages:
        return PageBundle([], [], np.empty(0, dtype=np.float32), "float32")
    stacked = stacked_view(pages)
    if stacked is None:
        stacked = torch.stack([page.kv for page in pages]).cpu()
    return PageBundle(
        keys=[page.key for page in pages],
        token_ids=[list(page.token_ids) for page in pages],
        kv=stacked.view(_WIRE_VIEW[stacked.dtype]).numpy(),
        dtype=dtype_name(stacked.dtype),
    )


def stacked_view(pages: list[PageRecord]) -> torch.Tensor | None:
    """``[num_pages, *page_shape]`` over the pages' own memory if page i's KV is slot i of one contiguous CPU tensor
    (its storage may go on past the last page: a reused export buffer, replica/export_buffers.py), else None. The
    bundle then carries only those slots; callers pass copies made for the bundle (``export_pages(contiguous=True)``),
    never views of memory that changes, such as the KV pool's pages."""
    first = pages[0].kv
    if first.device.type != "cpu" or not first.is_contiguous() or first.storage_offset() != 0:
        return None
    storage = first.untyped_storage()
    numel = first.numel()
    if storage.nbytes() < len(pages) * numel * first.element_size():
        return None
    for index, page in enumerate(pages):
        kv = page.kv
        if (kv.untyped_storage().data_ptr() != storage.data_ptr() or kv.storage_offset() != index * numel
                or kv.dtype != first.dtype or kv.shape != first.shape or not kv.is_contiguous()):
            return None
    return torch.empty(0, dtype=first.dtype).set_(storage, 0, (len(pages), *first.shape))


def unbundle_pages(bundle: PageBundle) -> list[PageRecord]:
    """The pages of a bundle as CPU tensors (views of the bundle's array; the engine copies them into its pool)."""
    if bundle.num_pages == 0:
        return []
    with warnings.catch_warnings():
        # Ray hands the array over read-only (zero copy); it is only read, then copied into the pool
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(np.asarray(bundle.kv))
    dtype = getattr(torch, bundle.dtype)
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    return [PageRecord(key, tuple(tokens), tensor[index], CacheSource.PEER)
            for index, (key, tokens) in enumerate(zip(bundle.keys, bundle.token_ids))]


@dataclass
class PeerExportRequest:
    """Ask the replica ``target_replica`` (Serve unique id) for the leading pages of ``keys`` it holds.
    The prefix-aware router sends a request carrying ``target_replica`` to exactly that replica when it is running."""

    target_replica: str
    keys: list[PageKey]
    ipc_target: IpcTarget | None = None
    """Set by a receiver on a GPU: the holder may answer a ``CudaIpcBundle`` if it shares a GPU with it."""
    node_id: str | None = None
    """Set by a receiver on a CPU (``shared_pool.node_id()``): the holder may answer a ``SharedPoolBundle`` if it runs
    on the same node and its pool is in shared memory."""


TRANSPORTS = ("cuda_ipc", "shared_memory", "host", "tcp")


@dataclass
class PeerTransportStats:
    """Pages received per transport: ``cuda_ipc`` (device to device), ``shared_memory`` (straight from the pool of a
    CPU peer on this node), ``host`` (numpy through the object store) or ``tcp`` (a peer on another node's page
    stream)."""

    pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSPORTS, 0))
    ipc_failures: int = 0
    """CUDA IPC bundles that could not be opened (the copy was retried as a host bundle)."""
    shared_memory_failures: int = 0
    """Shared pools that could not be opened (the copy was retried as a host bundle)."""
    handle_exports: int = 0
    """Export calls through the deployment's handle (Ray)."""
    socket_exports: int = 0
    """Export calls answered over a holder's local socket instead of through Ray."""
    socket_failures: int = 0
    """Export calls over a socket that failed (asked again through Ray; the socket is forgotten)."""
    stream_exports: int = 0
    """Pages asked of a peer on another node over its page stream instead of through Ray."""
    stream_failures: int = 0
    """Page stream calls that failed (asked again through Ray; the stream is forgotten)."""

    def export_calls(self) -> dict[str, int]:
        """Export calls by path, for /metrics: "handle" (Ray), "socket", "socket_failed", "stream", "stream_failed"."""
        return {"handle": self.handle_exports, "socket": self.socket_exports, "socket_failed": self.socket_failures,
                "stream": self.stream_exports, "stream_failed": self.stream_failures}


class ServePeerClient:
    """Peer copy over the replica deployment's own Serve handle: the holder's ``export_pages`` answers a
    ``PageBundle`` (numpy, zero-copy through Ray's object store) or, between GPUs of one host, a ``CudaIpcBundle``.
    Transport errors and timeouts raise; the prefix fetcher then falls back to the shared tiers.

    ``device``: where this replica's pages live; a CUDA device makes the client offer CUDA IPC. ``handle``: anything
    with ``export_pages.remote`` / ``release_pages.remote`` returning awaitables (a Serve deployment handle, a Ray actor
    handle); by default the deployment's own handle, looked up on first use."""

    def __init__(self, deployment_name: str, app_name: str, timeout_s: float = 5.0,
                 device: torch.device | str = "cpu", handle=None) -> None:
        self.deployment_name = deployment_name
        self.app_name = app_name
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.ipc_target = local_ipc_target() if self.device.type == "cuda" else None
        self.node_id = node_id() if self.device.type == "cpu" else None
        self.pool_reader = PoolReader()
        self.export_client = ExportClient()
        self.stream_client = StreamClient(timeout_s)
        self._export_sockets: dict[str, PoolLocation] = {}
        """Holders (by replica id) whose export socket a shared-pool bundle named: asked there next time."""
        self._streams: dict[str, StreamLocation] = {}
        """Holders on other nodes whose page stream a host bundle or the router (``learn_stream``) named: asked
        there next time."""
        self.use_streams = True
        """Learn holders' page streams from their host bundles and the router's hints (False: every copy between nodes
        through Ray)."""
        self._socket_failed_at: dict[str, float] = {}
        """When a holder's socket last failed: not learned again for ``SOCKET_RETRY_S`` (e.g. another network
        namespace, where it can never work: one warning and one slow call per interval, not per fetch)."""
        self.transport_stats = PeerTransportStats()
        self._handle = handle
        self._pending_releases: set[asyncio.Future] = set()

    def _get_handle(self):
        if self._handle is None:
            from ray import serve

            self._handle = serve.get_deployment_handle(self.deployment_name, self.app_name)
        return self._handle

    def learn_stream(self, peer_id: str, location: StreamLocation) -> bool:
        """Ask ``peer_id`` over the page stream at ``location`` from now on, as the router named it with a peer_hint
        (the holder's routing stats), so even the first copy from a holder on another node skips Ray's object store.
        Not for a holder on this node (its shared memory is faster), nor within ``SOCKET_RETRY_S`` of a failed
        socket or stream, nor with streams off. True if learned."""
        if (not self._takes_streams() or location.node is None or location.node == self.node_id
                or peer_id in self._export_sockets or self._streams.get(peer_id) == location
                or not self._retry_ok(peer_id)):
            return False
        old = self._streams.get(peer_id)
        if old is not None:
            self.stream_client.forget(old)
        self._streams[peer_id] = location
        # connected and proven while the request is admitted: the copy, queued behind on the same thread, finds it
        self.stream_client.executor.submit(self.stream_client.preconnect, location)
        return True

    def _takes_streams(self) -> bool:
        """Page streams are learned at all: streams on, and pages kept on the CPU (received straight into them)."""
        return self.use_streams and self.device.type == "cpu"

    def _retry_ok(self, peer_id: str) -> bool:
        """No export socket or page stream of ``peer_id`` failed within the last ``SOCKET_RETRY_S``."""
        return time.monotonic() - self._socket_failed_at.get(peer_id, -math.inf) >= SOCKET_RETRY_S

    def copies_into_pool(self, peer_id: str) -> bool:
        """True if pages from ``peer_id`` come by a path that can write them straight into pool pages (``fetch``'s
        ``landing``): a copy out of its shared memory (its export socket is known) or its page stream."""
        return self.device.type == "cpu" and (peer_id in self._export_sockets or peer_id in self._streams)

    async def fetch(self, peer_id: str, keys, landing: LandingPages | None = None) -> list[PageRecord]:
        """The leading pages of ``keys`` that ``peer_id`` holds. ``landing``: pool pages reserved for them
        (replica/landing.py): a copy out of the peer's shared memory or its page stream writes into those (the
        records say so); Ray's object store and CUDA IPC bring tensors of their own."""
        pages = await self._ask_stream(peer_id, list(keys), landing)
        if pages is not None:
            self.transport_stats.pages["tcp"] += len(pages)
            return pages
        bundle = await self._ask_socket(peer_id, list(keys))
        if bundle is None:
            bundle = await self._export(PeerExportRequest(peer_id, list(keys), self.ipc_target, self.node_id))
            retry_ok = self._retry_ok(peer_id)
            if isinstance(bundle, SharedPoolBundle) and bundle.location.socket is not None and retry_ok:
                self._export_sockets[peer_id] = bundle.location
            elif isinstance(bundle, PageBundle) and bundle.stream is not None and retry_ok and self._takes_streams():
                self._streams[peer_id] = bundle.stream
        if isinstance(bundle, SharedPoolBundle):
            try:  # one copy of ~5 GB/s: off the event loop, on the reader's own thread
                pages = await self.pool_reader.copy(bundle, landing)
            except Exception as exc:  # noqa: BLE001 - e.g. another pid namespace: take the host path
                logger.warning("copying from %s's shared pool failed (%s); copying through the object store",
                               peer_id, exc)
                self.transport_stats.shared_memory_failures += 1
                self.pool_reader.forget(bundle.location)
                self._forget_socket(peer_id)
                bundle = await self._export(PeerExportRequest(peer_id, list(keys)))
            else:
                self.transport_stats.pages["shared_memory"] += len(pages)
                return pages
        if isinstance(bundle, CudaIpcBundle):
            try:
                pages = open_bundle(bundle, self.device)
            except Exception as exc:  # noqa: BLE001 - e.g. the GPU is not visible here: take the host path
                logger.warning("CUDA IPC copy from %s failed (%s); copying through host memory", peer_id, exc)
                self.transport_stats.ipc_failures += 1
                self._release(peer_id, bundle.lease_id)
                bundle = await self._export(PeerExportRequest(peer_id, list(keys)))
            else:
                self._release(peer_id, bundle.lease_id)
                self.transport_stats.pages["cuda_ipc"] += len(pages)
                return pages
        pages = unbundle_pages(bundle)
        self.transport_stats.pages["host"] += len(pages)
        return pages

    async def _ask_socket(self, peer_id: str, keys: list[PageKey]) -> SharedPoolBundle | None:
        """The holder's answer over its export socket, or None (no socket known, or it failed: then forgotten)."""
        location = self._export_sockets.get(peer_id)
        if location is None:
            return None
        try:
            found, page_ids, generations, token_ids = await asyncio.wait_for(
                self.export_client.ask(location.socket, location.pid, keys), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - gone, restarted, timed out: ask through Ray
            logger.warning("the export socket of %s failed (%r); asking through Ray for %.0f s", peer_id, exc,
                           SOCKET_RETRY_S)
            self.transport_stats.socket_failures += 1
            self._socket_failed_at[peer_id] = time.monotonic()
            self._forget_socket(peer_id)
            return None
        self.transport_stats.socket_exports += 1
        return SharedPoolBundle(found, token_ids, page_ids, generations, location)

    async def _ask_stream(self, peer_id: str, keys: list[PageKey],
                          landing: LandingPages | None = None) -> list[PageRecord] | None:
        """The pages the holder sends over its page stream, or None (no stream known, or it failed: then forgotten).
        The blocking reads run on the stream client's own thread, like a shared-pool copy; into ``landing``'s pool
        pages when they may be written."""
        location = self._streams.get(peer_id)
        if location is None:
            return None
        out = None
        try:
            job, out = submit_into(self.stream_client.executor,
                                   functools.partial(self.stream_client.fetch, location, keys), landing, 0, len(keys))
            found, token_ids, arrays, dtype = await asyncio.wait_for(asyncio.wrap_future(job), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - gone, restarted, timed out, a port not open: ask through Ray
            if out is not None and isinstance(exc, asyncio.TimeoutError):
                landing.writable = False  # the read may go on writing into the pages: the next source may not
            logger.warning("the page stream of %s at %s failed (%r); asking through Ray for %.0f s", peer_id,
                           location, exc, SOCKET_RETRY_S)
            self.transport_stats.stream_failures += 1
            self._socket_failed_at[peer_id] = time.monotonic()
            self._forget_stream(peer_id)
            return None
        self.transport_stats.stream_exports += 1
        dtype = getattr(torch, dtype)
        return [PageRecord(key, tuple(tokens), array, CacheSource.PEER, landing_page=landing.page_ids[index])
                if out is not None and array is out[index] else
                PageRecord(key, tuple(tokens), torch.from_numpy(array).view(dtype), CacheSource.PEER)
                for index, (key, tokens, array) in enumerate(zip(found, token_ids, arrays))]

    def close(self) -> None:
        """Close the idle connections to holders' export sockets and page streams."""
        self.export_client.close()
        self.stream_client.close()

    def _forget_stream(self, peer_id: str) -> None:
        location = self._streams.pop(peer_id, None)
        if location is not None:
            self.stream_client.forget(location)

    def _forget_socket(self, peer_id: str) -> None:
        location = self._export_sockets.pop(peer_id, None)
        if location is not None:
            self.export_client.forget(location.socket, location.pid)

    async def _export(self, request: PeerExportRequest):
        self.transport_stats.handle_exports += 1
        response = self._get_handle().export_pages.remote(request)
        return await asyncio.wait_for(response, timeout=self.timeout_s)

    def _release(self, peer_id: str, lease_id: str) -> None:
        """Tell the holder in the background (the copy does not wait); a lost release lets the lease expire there."""
        response = self._get_handle().release_pages.remote(PeerRelease(peer_id, lease_id))
        task = asyncio.ensure_future(self._await_release(response, peer_id))
        self._pending_releases.add(task)
        task.add_done_callback(self._pending_releases.discard)

    async def _await_release(self, response, peer_id: str) -> None:
        try:
            await asyncio.wait_for(response, timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the holder's lease then expires on its own
            logger.warning("releasing CUDA IPC pages on %s failed (%s); the lease will expire", peer_id, exc)
