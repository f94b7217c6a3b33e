"""Byte encoding of one stored page: a msgpack header plus the raw KV bytes. No pickle anywhere.

The header says what the bytes are (key, token ids, key format, model, dtype, page size, shape, length, CRC-32), so a
reader can reject anything it should not reuse. The KV travels as its raw little-endian bytes; bfloat16 has no numpy
dtype, so tensors are viewed as uint8 on the way out and viewed back as their dtype on the way in (bit-exact).

A Redis value ("blob") is laid out as::

    | b"PSKV" | header length: u32 little-endian | header (msgpack map) | KV bytes (header.num_bytes) |
      0        4                                 8                     8 + header length

The disk tier keeps the same header in the Arrow schema metadata and the KV bytes in a binary column.
"""

from __future__ import annotations

import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Sequence

import msgpack
import numpy as np
import torch

from common.page_format import PageFormat
from replica.tiers.base import StoredPage

BLOB_MAGIC = b"PSKV"
_BLOB_PREFIX = struct.Struct("<4sI")
HEADER_LAYOUT_VERSION = 1
"""Version of this header/blob layout (independent of the page key format)."""


class RejectedEntry(Exception):
    """A stored entry that must not be reused: undecodable, corrupt, foreign, or holding other tokens."""


@dataclass(frozen=True)
class PageHeader:
    """What a stored page says about itself."""

    key: bytes
    token_ids: tuple[int, ...]
    key_format_version: int
    model_fingerprint: str
    dtype: str
    page_size: int
    kv_shape: tuple[int, ...]
    num_bytes: int
    crc32: int
    byteorder: str = sys.byteorder
    layout_version: int = HEADER_LAYOUT_VERSION

    @classmethod
    def of_page(cls, page: StoredPage, payload: memoryview) -> "PageHeader":
        return cls(
            key=page.key,
            token_ids=page.token_ids,
            key_format_version=page.key_format_version,
            model_fingerprint=page.model_fingerprint,
            dtype=page.dtype,
            page_size=page.page_size,
            kv_shape=tuple(page.kv.shape),
            num_bytes=payload.nbytes,
            crc32=checksum(payload),
        )

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "layout_version": self.layout_version,
                "key": self.key,
                "token_ids": list(self.token_ids),
                "key_format_version": self.key_format_version,
                "model_fingerprint": self.model_fingerprint,
                "dtype": self.dtype,
                "page_size": self.page_size,
                "kv_shape": list(self.kv_shape),
                "num_bytes": self.num_bytes,
                "crc32": self.crc32,
                "byteorder": self.byteorder,
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "PageHeader":
        """Decode a header; RejectedEntry if it is not a well-formed header of this layout."""
        try:
            fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
            if fields.get("layout_version") != HEADER_LAYOUT_VERSION:
                raise RejectedEntry(f"header layout version {fields.get('layout_version')!r}")
            return cls(
                key=bytes(fields["key"]),
                token_ids=tuple(fields["token_ids"]),
                key_format_version=int(fields["key_format_version"]),
                model_fingerprint=str(fields["model_fingerprint"]),
                dtype=str(fields["dtype"]),
                page_size=int(fields["page_size"]),
                kv_shape=tuple(int(d) for d in fields["kv_shape"]),
                num_bytes=int(fields["num_bytes"]),
                crc32=int(fields["crc32"]),
                byteorder=str(fields["byteorder"]),
            )
        except RejectedEntry:
            raise
        except Exception as exc:  # msgpack raises many types on garbage; all mean "not our header"
            raise RejectedEntry(f"undecodable header: {type(exc).__name__}: {exc}") from exc

    def check(self, page_format: PageFormat, key: bytes, token_ids: Sequence[int]) -> None:
        """RejectedEntry unless this header describes page ``key`` holding ``token_ids`` in ``page_format``."""
        expected = (
            ("key_format_version", page_format.key_format_version),
            ("model_fingerprint", page_format.model_fingerprint),
            ("dtype", page_format.dtype),
            ("page_size", page_format.page_size),
            ("kv_shape", page_format.kv_shape),
            ("num_bytes", page_format.page_num_bytes),
            ("byteorder", sys.byteorder),
            ("key", key),
        )
        for name, want in expected:
            got = getattr(self, name)
            if got != want:
                raise RejectedEntry(f"foreign entry: {name} is {got!r}, expected {want!r}")
        if self.token_ids != tuple(token_ids):
            raise RejectedEntry("stored token ids differ from the request's")


def checksum(payload: bytes | memoryview) -> int:
    """CRC-32 of the KV bytes (~2.4 GB/s here): catches bit rot and foreign writers, not adversaries."""
    return zlib.crc32(payload)


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying (the view keeps ``kv`` alive)."""
    if not kv.is_contiguous() or kv.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(kv.reshape(-1).view(torch.uint8).numpy())


def tensor_from_payload(header: PageHeader, payload: bytes | memoryview) -> torch.Tensor:
    """A new tensor (owned, writable) holding ``payload``; RejectedEntry on a length or checksum mismatch."""
    if len(payload) != header.num_bytes:
        raise RejectedEntry(f"truncated entry: {len(payload)} KV bytes, header says {header.num_bytes}")
    if checksum(payload) != header.crc32:
        raise RejectedEntry("KV bytes fail their CRC-32")
    flat = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
    return flat.view(getattr(torch, header.dtype)).reshape(header.kv_shape)


def encode_blob(page: StoredPage) -> bytearray:
    """One page as a single byte string (Redis value). Copies the KV once."""
    payload = tensor_bytes(page.kv)
    header_bytes = PageHeader.of_page(page, payload).pack()
    blob = bytearray(_BLOB_PREFIX.size + len(header_bytes) + payload.nbytes)
    _BLOB_PREFIX.pack_into(blob, 0, BLOB_MAGIC, len(header_bytes))
    start = _BLOB_PREFIX.size
    blob[start : start + len(header_bytes)] = header_bytes
    blob[start + len(header_bytes) :] = payload
    return blob


def decode_blob(blob: bytes, page_format: PageFormat, key: bytes, token_ids: Sequence[int]) -> torch.Tensor:
    """The verified KV of a blob written by ``encode_blob``; RejectedEntry if it must not be reused."""
    view = memoryview(blob)
    if len(view) < _BLOB_PREFIX.size:
        raise RejectedEntry(f"truncated entry: {len(view)} bytes")
    magic, header_len = _BLOB_PREFIX.unpack_from(view, 0)
    if magic != BLOB_MAGIC:
        raise RejectedEntry(f"not a prefixserve page (magic {magic!r})")
    header_end = _BLOB_PREFIX.size + header_len
    if header_end > len(view):
        raise RejectedEntry("truncated entry: header runs past the end")
    header = PageHeader.unpack(view[_BLOB_PREFIX.size : header_end])
    header.check(page_format, key, token_ids)
    return tensor_from_payload(header, view[header_end:])
