"""Landing pages: pool pages a fetch writes its pages into (a shared tier decrypts into them, a peer's pages are
copied or received into them), so that no copy into the pool follows.

A page loaded from Redis or the disk tier used to be decrypted into a fresh tensor and then copied into the pool page
the scheduler gave it at admission: the copy was a third pass over the bytes (4.7 ms of a 16-page, 32 MiB load's
22 ms on a 2-core EPYC; BENCHMARKS.md 0za). Now the engine thread reserves the pool pages when it plans the fetch,
the load decrypts straight into them (``writable_bytes``: a page of the pool is 2 x layers runs), and the
request adopts them at admission::

    plan (engine thread)   reserve_landing: n pages allocated (refcount 1, held by the fetch), local hits kept
    fetch (load threads)   tier.load(..., out=views): page i decrypted into pool page ids[i]
    add (engine thread)    each queued request holding a record takes a reference (Engine.add)
    fetch dropped          the fetch's references go back, once no load thread writes into the pages any more
    admission              the scheduler puts the landing page in the request's page table (its reference becomes
                           the page's); a record it does not use (the local hit grew) gives its reference back
    abort while queued     the request's references go back (Scheduler.finish)

The same holds for a peer (since session 37) whose pages come by a path that can write them
(``ServePeerClient.copies_into_pool``): on this node ``PoolReader.copy`` copies them out of its shared memory into the
landing pages (replica/shared_pool.py); on another node ``StreamClient.fetch`` receives its page stream into them run
by run (replica/page_stream.py). Both used to fill fresh tensors that were then copied into the pool at admission. A
peer asked through Ray's object store (no stream known yet, or none) brings tensors of its own: no pages are reserved
for it. A peer's pages are also written to the shared tiers after the first token, when the landing pages may hold other
KV already (the request finished, the pages were evicted and reused): that write reads them back by key
(``PrefixFetcher.read_back``: what is cached under the key then, or nothing), never through the records. So a write
can be lost (the request went away before admission, or only its first pages are cached yet): only a cache entry.

A page is never handed to anyone else while a load may still write into it: the fetch's reference goes back only when
both the fetch is done with (``drop``) and every load into the pages has returned (``end_load``; a load that timed
out keeps running on its thread). Pages a load did not fill (a miss, a rejected entry) are only ever released.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import threading
from typing import Callable, Sequence

import torch


class LandingPages:
    """The pool pages reserved for one fetch (``page_ids[i]`` for the fetch's page i; ``views[i]`` its KV)."""

    def __init__(self, page_ids: Sequence[int], views: Sequence[torch.Tensor],
                 release: Callable[[LandingPages], None]) -> None:
        """``release(self)``: gives the fetch's references on ``page_ids`` back; called once, from any thread (it
        hands the work to the engine thread)."""
        self.page_ids = list(page_ids)
        self.views = list(views)
        self._release = release
        self._lock = threading.Lock()
        self._num_loads = 0
        self._dropped = False
        self._released = False
        self.writable = True
        """False once a load into ``views`` timed out: its thread may still be writing, so no other load may use
        them (the fetch's later tiers load into fresh tensors)."""

    def begin_load(self) -> bool:
        """A load into ``views`` may start (call before handing them to a tier): False if the pages went back
        already (the fetch was abandoned: shutdown), and the load must use tensors of its own."""
        with self._lock:
            if self._released or not self.writable:
                return False
            self._num_loads += 1
            return True

    def end_load(self) -> None:
        """A load into ``views`` has returned or raised: its thread writes into them no more."""
        with self._lock:
            self._num_loads -= 1
            release = self._dropped and self._num_loads == 0 and not self._released
            self._released |= release
        if release:
            self._release(self)

    def drop(self) -> None:
        """The fetch is done with the pages (idempotent): release them now, or when the last load returns."""
        with self._lock:
            release = not self._dropped and self._num_loads == 0
            self._dropped = True
            self._released |= release
        if release:
            self._release(self)

    @property
    def released(self) -> bool:
        with self._lock:
            return self._released

    def __repr__(self) -> str:
        return f"LandingPages({self.page_ids}, loads={self._num_loads}, dropped={self._dropped})"


def submit_into(executor: concurrent.futures.Executor, load: Callable[[list | None], object],
                landing: LandingPages | None, first: int, count: int) -> tuple[concurrent.futures.Future, list | None]:
    """Run ``load(out)`` on ``executor``: ``out`` is ``landing``'s views ``first .. first + count`` when they may be
    written (``begin_load``), else None (the load makes tensors of its own). The views count as being written until the
    job returns, not until its caller stops waiting (a load that timed out goes on writing on its thread). Returns the
    job and ``out``."""
    out = None
    if landing is not None and first + count <= len(landing.views) and landing.begin_load():
        out = landing.views[first : first + count]
    try:
        job = executor.submit(load, out)
    except BaseException:
        if out is not None:
            landing.end_load()
        raise
    if out is not None:
        job.add_done_callback(lambda _: landing.end_load())
    return job, out


def landing_page_ids(pages) -> list[int]:
    """The landing pages of ``pages`` (``PageRecord``s), in order."""
    return [page.landing_page for page in pages if page.landing_page is not None]


def writable_bytes(tensor: torch.Tensor):
    """``tensor``'s memory as what ``TierKey.open_into`` writes: one buffer if it is contiguous, else its contiguous
    runs in order (a page of the KV pool ``[layers, 2, page_size, kv_heads, head_dim]`` is a view of
    ``[layers, 2, num_pages, ...]``: 2 x layers runs of ``page_size x kv_heads x head_dim`` elements; decrypting there
    spares the copy into the pool). ValueError for a layout whose innermost dimension is strided."""
    if tensor.is_contiguous():
        return tensor.view(-1).view(torch.uint8).numpy()
    if tensor.device.type != "cpu":
        raise ValueError("not a CPU tensor")
    offsets, run = _run_offsets(tuple(tensor.shape), tensor.stride(), tensor.element_size())
    # one buffer over the tensor's span (it lives as long as ``tensor``, which the caller holds), sliced per run
    span = (ctypes.c_char * (offsets[-1] + run)).from_address(tensor.data_ptr())
    whole = memoryview(span).cast("B")
    return [whole[offset : offset + run] for offset in offsets]


def writable_runs(tensor: torch.Tensor) -> list[memoryview]:
    """``writable_bytes`` as a list of byte memoryviews (one for a contiguous tensor)."""
    found = writable_bytes(tensor)
    return found if isinstance(found, list) else [memoryview(found).cast("B")]


@functools.lru_cache(maxsize=64)
def _run_offsets(shape: tuple[int, ...], strides: tuple[int, ...], element_size: int) -> tuple[tuple[int, ...], int]:
    """Byte offsets from the first element of the contiguous runs of a tensor laid out so, in order, and a run's
    bytes (computed once per layout: a pool's pages all share one)."""
    if strides[-1] != 1:
        raise ValueError(f"the innermost dimension is strided ({strides})")
    if any(stride < 0 for stride in strides):
        raise ValueError(f"negative strides ({strides})")
    inner, run = len(shape), 1  # shape[inner:] lies contiguously
    while inner > 0 and (shape[inner - 1] == 1 or strides[inner - 1] == run):
        inner -= 1
        run *= shape[inner]
    offsets = [0]
    for dim in range(inner - 1, -1, -1):
        step = strides[dim] * element_size
        offsets = [i * step + offset for i in range(shape[dim]) for offset in offsets]
    return tuple(offsets), run * element_size
