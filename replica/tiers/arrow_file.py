"""One page as one Arrow IPC file, written atomically and read through a memory map.

File layout (Arrow IPC file format, one record batch of one row)::

    schema metadata  {b"prefixserve.page": msgpack PageHeader}   key, token ids, format, dtype, shape, CRC-32
    column "kv"      large_binary                                 the raw KV bytes (little-endian, C order)

Atomic write: the file is written under a unique temporary name in the destination folder and renamed over the
destination with ``os.replace``, so a reader sees either no file or a whole one, and two writers of the same page
leave one whole file (the last rename wins; both are identical anyway).
"""

from __future__ import annotations

import os
import tempfile
from typing import Sequence

import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from common.page_format import PageFormat
from replica.tiers.base import StoredPage
from replica.tiers.codec import PageHeader, RejectedEntry, tensor_bytes, tensor_from_payload

HEADER_METADATA_KEY = b"prefixserve.page"
KV_COLUMN = "kv"
TEMP_SUFFIX = ".tmp"


def write_page_file(path: str, page: StoredPage, *, mtime_ns: int | None = None, fsync: bool = False) -> int:
    """Write ``page`` to ``path`` atomically; returns the file size. Raises OSError on I/O failure (no temp left).

    ``mtime_ns`` sets the file's access and modification time before it appears (the disk tier's LRU clock).
    """
    payload = tensor_bytes(page.kv)
    header = PageHeader.of_page(page, payload)
    schema = pa.schema([pa.field(KV_COLUMN, pa.large_binary())], metadata={HEADER_METADATA_KEY: header.pack()})
    offsets = pa.array([0, payload.nbytes], type=pa.int64()).buffers()[1]
    column = pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(payload)])
    batch = pa.record_batch([column], schema=schema)

    folder = os.path.dirname(path)
    fd, temp_path = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=TEMP_SUFFIX)
    os.fchmod(fd, 0o644)  # mkstemp makes 0600; other replicas' processes read these files
    os.close(fd)
    try:
        with pa.OSFile(temp_path, "wb") as sink, ipc.new_file(sink, schema) as writer:
            writer.write_batch(batch)
        if fsync:
            sync_file(temp_path)
        if mtime_ns is not None:
            os.utime(temp_path, ns=(mtime_ns, mtime_ns))
        size = os.path.getsize(temp_path)
        os.replace(temp_path, path)
    except BaseException:
        remove_quietly(temp_path)
        raise
    return size


def read_page_file(path: str, page_format: PageFormat, key: bytes, token_ids: Sequence[int]) -> torch.Tensor:
    """The verified KV stored at ``path`` (an owned tensor; the memory map is closed on return).

    Raises FileNotFoundError if there is no file, RejectedEntry if it is truncated, corrupt, foreign, or holds other
    tokens, and OSError for other I/O failures.
    """
    with pa.memory_map(path, "r") as source:
        try:
            reader = ipc.open_file(source)
            metadata = reader.schema.metadata or {}
            if HEADER_METADATA_KEY not in metadata:
                raise RejectedEntry("no prefixserve page header in the Arrow schema metadata")
            header = PageHeader.unpack(metadata[HEADER_METADATA_KEY])
            header.check(page_format, key, token_ids)
            if reader.num_record_batches != 1:
                raise RejectedEntry(f"{reader.num_record_batches} record batches, expected 1")
            batch = reader.get_batch(0)
            batch.validate(full=True)  # bounds-check offsets before touching the bytes they point at
            if batch.num_rows != 1 or batch.schema.names != [KV_COLUMN]:
                raise RejectedEntry(f"unexpected table: {batch.num_rows} rows, columns {batch.schema.names}")
            payload = batch.column(0)[0].as_buffer()
            if payload is None:
                raise RejectedEntry("the kv cell is null")
            return tensor_from_payload(header, memoryview(payload))
        except (pa.ArrowException, ValueError, TypeError, KeyError, IndexError) as exc:
            raise RejectedEntry(f"unreadable Arrow file: {type(exc).__name__}: {exc}") from exc


def sync_file(path: str) -> None:
    """Flush ``path``'s data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path: str) -> bool:
    """Delete ``path`` if it exists; True if this call deleted it."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
