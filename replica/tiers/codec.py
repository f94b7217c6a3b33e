"""Byte encoding of one stored page: a msgpack header plus the sealed KV bytes. No pickle anywhere.

The header says what the bytes are (key format, model, dtype, page size, shape, length, the keyed digest of the token
ids, the key id and nonce), so a reader can reject anything it should not reuse before decrypting. It holds no token
ids and no page key (see ``seal``). The KV travels as its raw little-endian bytes, AES-GCM-encrypted with the header
and the page key as associated data; bfloat16 has no numpy dtype, so tensors are viewed as uint8 on the way out and
viewed back as their dtype on the way in (bit-exact). Decryption writes straight into the tensor handed back (one
pass over the bytes, no intermediate copy).

A Redis value ("blob") is laid out as::

    | b"PSK2" | header length: u32 little-endian | header (msgpack map) | sealed KV (header.num_bytes + 16-byte tag) |
      0        4                                 8                     8 + header length

The disk tier keeps the same header in the Arrow schema metadata and the sealed KV bytes in a binary column.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import msgpack
import torch

from common.page_format import PageFormat
from replica.landing import writable_bytes
from replica.tiers.base import StoredPage
from replica.tiers.seal import NONCE_BYTES, TAG_BYTES, SealError, TierKey, new_nonce

BLOB_MAGIC = b"PSK2"
_BLOB_PREFIX = struct.Struct("<4sI")
HEADER_LAYOUT_VERSION = 2
"""Version of this header/blob layout (independent of the page key format). 2: sealed (keyed names, token digest,
AES-GCM payload)."""
MAX_HEADER_BYTES = 4096
"""A header is ~250 bytes; anything longer is rejected before it is parsed."""


class RejectedEntry(Exception):
    """A stored entry that must not be reused: undecodable, corrupt, tampered, foreign, or holding other tokens."""


@dataclass(frozen=True)
class PageHeader:
    """What a stored page says about itself."""

    key_format_version: int
    model_fingerprint: str
    dtype: str
    page_size: int
    kv_shape: tuple[int, ...]
    num_bytes: int
    key_id: bytes
    nonce: bytes
    token_digest: bytes
    byteorder: str = sys.byteorder
    layout_version: int = HEADER_LAYOUT_VERSION

    @classmethod
    def of_page(cls, page: StoredPage, tier_key: TierKey, num_bytes: int) -> "PageHeader":
        return cls(
            key_format_version=page.key_format_version,
            model_fingerprint=page.model_fingerprint,
            dtype=page.dtype,
            page_size=page.page_size,
            kv_shape=tuple(page.kv.shape),
            num_bytes=num_bytes,
            key_id=tier_key.key_id,
            nonce=new_nonce(),
            token_digest=tier_key.token_digest(page.token_ids),
        )

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "layout_version": self.layout_version,
                "key_format_version": self.key_format_version,
                "model_fingerprint": self.model_fingerprint,
                "dtype": self.dtype,
                "page_size": self.page_size,
                "kv_shape": list(self.kv_shape),
                "num_bytes": self.num_bytes,
                "byteorder": self.byteorder,
                "key_id": self.key_id,
                "nonce": self.nonce,
                "token_digest": self.token_digest,
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "PageHeader":
        """Decode a header; RejectedEntry if it is not a well-formed header of this layout."""
        if len(data) > MAX_HEADER_BYTES:
            raise RejectedEntry(f"header of {len(data)} bytes (at most {MAX_HEADER_BYTES})")
        try:
            fields = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES,
                                     max_str_len=MAX_HEADER_BYTES, max_array_len=16, max_map_len=32)
            if fields.get("layout_version") != HEADER_LAYOUT_VERSION:
                raise RejectedEntry(f"header layout version {fields.get('layout_version')!r}")
            header = cls(
                key_format_version=int(fields["key_format_version"]),
                model_fingerprint=str(fields["model_fingerprint"]),
                dtype=str(fields["dtype"]),
                page_size=int(fields["page_size"]),
                kv_shape=tuple(int(d) for d in fields["kv_shape"]),
                num_bytes=int(fields["num_bytes"]),
                byteorder=str(fields["byteorder"]),
                key_id=bytes(fields["key_id"]),
                nonce=bytes(fields["nonce"]),
                token_digest=bytes(fields["token_digest"]),
            )
        except RejectedEntry:
            raise
        except Exception as exc:  # msgpack raises many types on garbage; all mean "not our header"
            raise RejectedEntry(f"undecodable header: {type(exc).__name__}: {exc}") from exc
        if len(header.nonce) != NONCE_BYTES:
            raise RejectedEntry(f"nonce of {len(header.nonce)} bytes")
        return header

    def check(self, page_format: PageFormat, tier_key: TierKey, token_ids: Sequence[int]) -> None:
        """RejectedEntry unless this header describes a page of ``page_format`` sealed under ``tier_key`` holding
        ``token_ids`` (compared as keyed digests)."""
        expected = (
            ("key_format_version", page_format.key_format_version),
            ("model_fingerprint", page_format.model_fingerprint),
            ("dtype", page_format.dtype),
            ("page_size", page_format.page_size),
            ("kv_shape", page_format.kv_shape),
            ("num_bytes", page_format.page_num_bytes),
            ("byteorder", sys.byteorder),
            ("key_id", tier_key.key_id),
        )
        for name, want in expected:
            got = getattr(self, name)
            if got != want:
                raise RejectedEntry(f"foreign entry: {name} is {got!r}, expected {want!r}")
        if self.token_digest != tier_key.token_digest(token_ids):
            raise RejectedEntry("stored token ids differ from the request's")


def associated_data(header_bytes: bytes, page_key: bytes) -> bytes:
    """What the AES-GCM tag authenticates besides the KV: the exact header bytes and the page key."""
    return bytes(header_bytes) + b"\x00" + page_key


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying (the view keeps ``kv`` alive)."""
    if not kv.is_contiguous() or kv.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(kv.reshape(-1).view(torch.uint8).numpy())


def sealed_size(page_format: PageFormat) -> int:
    """Bytes of one page's sealed KV (KV + tag)."""
    return page_format.page_num_bytes + TAG_BYTES


def new_header(page: StoredPage, tier_key: TierKey) -> tuple[PageHeader, bytes]:
    """A fresh header for ``page`` (new nonce) and its packed bytes."""
    header = PageHeader.of_page(page, tier_key, page.kv.numel() * page.kv.element_size())
    return header, header.pack()


def seal_page(page: StoredPage, tier_key: TierKey, header: PageHeader, header_bytes: bytes, out) -> None:
    """Encrypt ``page.kv`` into ``out`` (a writable buffer of ``header.num_bytes + TAG_BYTES`` bytes)."""
    tier_key.seal_into(header.nonce, tensor_bytes(page.kv), associated_data(header_bytes, page.key), out)


def new_page_tensors(page_format: PageFormat, num_pages: int) -> list[torch.Tensor]:
    """``num_pages`` contiguous, uninitialized page tensors to decrypt a load's pages into. One allocation per page,
    not one per load: glibc serves a page-sized block (0.5-2 MiB) from its heap once one has been freed, while a
    whole load's block (8-32 MiB) is a fresh mmap every time, and faulting its memory in measured 3x the decryption
    itself (16 float32 pages: 0.8 against 2.5 GB/s)."""
    dtype = getattr(torch, page_format.dtype)
    return [torch.empty(page_format.kv_shape, dtype=dtype) for _ in range(num_pages)]


LOAD_WORKERS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
"""Threads that read and decrypt a disk-tier load's pages side by side (``DiskTier.load``). AES-GCM runs at 2-3 GB/s
on one core and releases the GIL, as do file reads: on 2 cores two threads decrypt 16 float32 pages at 3.1 GB/s, one
at 2.4 (benchmarks/tier_transfer_floor.py, BENCHMARKS.md section 0b). A Redis load decrypts on its own thread:
decrypting there while the next value arrives measured no gain."""
_load_pool: ThreadPoolExecutor | None = None
_load_pool_lock = threading.Lock()


def load_pool() -> ThreadPoolExecutor:
    """The process' shared pool of ``LOAD_WORKERS`` threads for tier loads (created on first use)."""
    global _load_pool
    if _load_pool is None:
        with _load_pool_lock:
            if _load_pool is None:
                _load_pool = ThreadPoolExecutor(LOAD_WORKERS, thread_name_prefix="kv-tier-load")
    return _load_pool


def open_payload(header_bytes: bytes | memoryview, page_format: PageFormat, tier_key: TierKey, key: bytes,
                 token_ids: Sequence[int], sealed: bytes | memoryview,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The verified KV of a sealed entry, decrypted straight into ``out`` (a CPU tensor of the page's shape and dtype:
    one slot of ``new_page_tensors``, or a page of the KV pool, see ``writable_bytes``; a new tensor if None) and
    returned; RejectedEntry if it must not be reused (``out`` then holds garbage the caller must not use: nothing is
    returned for it)."""
    header = PageHeader.unpack(header_bytes)
    header.check(page_format, tier_key, token_ids)
    if len(sealed) != header.num_bytes + TAG_BYTES:
        raise RejectedEntry(f"truncated entry: {len(sealed)} sealed bytes, header says {header.num_bytes + TAG_BYTES}")
    dtype = getattr(torch, header.dtype)
    if out is None:
        out = torch.empty(header.kv_shape, dtype=dtype)
    elif out.dtype != dtype or tuple(out.shape) != header.kv_shape or out.device.type != "cpu":
        raise ValueError(f"open_payload needs a CPU {dtype} tensor of shape {header.kv_shape}, "
                         f"got {out.dtype} {list(out.shape)}")
    try:
        tier_key.open_into(header.nonce, sealed, associated_data(bytes(header_bytes), key), writable_bytes(out))
    except SealError as exc:
        raise RejectedEntry(str(exc)) from None
    return out


def encode_blob(page: StoredPage, tier_key: TierKey) -> bytearray:
    """One page as a single byte string (Redis value). One pass over the KV (encrypting into the blob)."""
    header, header_bytes = new_header(page, tier_key)
    start = _BLOB_PREFIX.size + len(header_bytes)
    blob = bytearray(start + header.num_bytes + TAG_BYTES)
    _BLOB_PREFIX.pack_into(blob, 0, BLOB_MAGIC, len(header_bytes))
    blob[_BLOB_PREFIX.size : start] = header_bytes
    seal_page(page, tier_key, header, header_bytes, memoryview(blob)[start:])
    return blob


def decode_blob(blob: bytes | memoryview, page_format: PageFormat, tier_key: TierKey, key: bytes,
                token_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """The verified KV of a blob written by ``encode_blob`` (decrypted into ``out`` if given, see ``open_payload``);
    RejectedEntry if it must not be reused."""
    view = memoryview(blob)
    if len(view) < _BLOB_PREFIX.size:
        raise RejectedEntry(f"truncated entry: {len(view)} bytes")
    magic, header_len = _BLOB_PREFIX.unpack_from(view, 0)
    if magic != BLOB_MAGIC:
        raise RejectedEntry(f"not a prefixserve page (magic {magic!r})")
    header_end = _BLOB_PREFIX.size + header_len
    if header_len > MAX_HEADER_BYTES or header_end > len(view):
        raise RejectedEntry("truncated entry: header runs past the end")
    return open_payload(view[_BLOB_PREFIX.size : header_end], page_format, tier_key, key, token_ids,
                        view[header_end:], out)
