"""One page as one Arrow IPC file, written atomically (mode 0600) and read only if it is a regular file.

File layout (Arrow IPC file format, one record batch of one row)::

    schema metadata  {b"prefixserve.page": msgpack PageHeader}   format, dtype, shape, key id, nonce, token digest
    column "kv"      large_binary                                 the sealed KV bytes (AES-GCM, see ``seal``)

Atomic write: the file is written under a unique temporary name (mode 0600) in the destination folder and renamed
over the destination with ``os.replace``, so a reader sees either no file or a whole one.

Safe read: the file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat``-ed before a byte is read, so a symlink,
a FIFO, a device or a socket planted under a page's name is rejected at once (never followed, never blocked on), and
a file larger than a page can be is rejected before it is read. The bytes are read with ``readinto`` into one buffer
(reused by the thread) that Arrow parses in place; the KV is decrypted from there straight into the returned tensor.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
from typing import Sequence

import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from common.page_format import PageFormat
from replica.tiers.base import StoredPage
from replica.tiers.codec import RejectedEntry, new_header, open_payload, seal_page
from replica.tiers.seal import TAG_BYTES, TierKey

HEADER_METADATA_KEY = b"prefixserve.page"
KV_COLUMN = "kv"
TEMP_SUFFIX = ".tmp"
FILE_OVERHEAD_BYTES = 64 << 10
"""How much larger than its sealed KV a page file may be (Arrow framing + header are ~2 KiB); bigger is rejected."""


def write_page_file(path: str, page: StoredPage, tier_key: TierKey, *, fsync: bool = False,
                    keep_temp: bool = False) -> tuple[int, str]:
    """Write ``page`` to ``path`` atomically (mode 0600); returns (file size, path written).

    With ``keep_temp`` the file stays under its temporary name (returned) for the caller to rename later. Raises
    OSError on I/O failure (no temporary file is left behind).
    """
    header, header_bytes = new_header(page, tier_key)
    sealed = bytearray(header.num_bytes + TAG_BYTES)
    seal_page(page, tier_key, header, header_bytes, memoryview(sealed))
    schema = pa.schema([pa.field(KV_COLUMN, pa.large_binary())], metadata={HEADER_METADATA_KEY: header_bytes})
    offsets = pa.array([0, len(sealed)], type=pa.int64()).buffers()[1]
    column = pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(sealed)])
    batch = pa.record_batch([column], schema=schema)

    folder = os.path.dirname(path)
    fd, temp_path = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=TEMP_SUFFIX)
    os.close(fd)  # mkstemp made it 0600: only this user reads the tier
    try:
        with pa.OSFile(temp_path, "wb") as sink, ipc.new_file(sink, schema) as writer:
            writer.write_batch(batch)
        if fsync:
            sync_file(temp_path)
        size = os.path.getsize(temp_path)
        if not keep_temp:
            os.replace(temp_path, path)
            return size, path
    except BaseException:
        remove_quietly(temp_path)
        raise
    return size, temp_path


class NotRegularFile(RejectedEntry):
    """A symlink, FIFO, device, socket or folder where a page file should be."""


_scratch = threading.local()


def scratch_buffer(num_bytes: int) -> bytearray:
    """This thread's reusable read buffer of at least ``num_bytes`` (a fresh 1 MiB buffer per page costs page faults
    on every read)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < num_bytes:
        buffer = _scratch.buffer = bytearray(num_bytes)
    return buffer


def read_file_safely(path: str, max_bytes: int, into: bytearray | None = None) -> memoryview:
    """The bytes of the regular file ``path`` (at most ``max_bytes``), read into ``into`` (``max_bytes`` long; a new
    buffer if None) and returned as a view of it.

    Raises FileNotFoundError if there is nothing there, NotRegularFile for a symlink / FIFO / device / socket /
    folder, RejectedEntry for a file larger than ``max_bytes``, OSError for other I/O failures.
    """
    mode = os.lstat(path).st_mode  # FileNotFoundError if nothing is there
    if not stat.S_ISREG(mode):  # never even open a device, FIFO or socket
        raise NotRegularFile(f"not a regular file (mode {stat.filemode(mode)})")
    try:  # and again on the descriptor: the entry may have been swapped since the lstat
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile("a symbolic link, not a page file") from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a socket, or a folder opened for reading
            raise NotRegularFile(f"not a regular file ({exc.strerror})") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(f"not a regular file (mode {stat.filemode(info.st_mode)})")
        if info.st_size > max_bytes:
            raise RejectedEntry(f"{info.st_size} bytes, a page file has at most {max_bytes}")
        view = memoryview(into if into is not None else bytearray(info.st_size))[: info.st_size]
        num_read = 0
        while num_read < info.st_size:
            chunk = os.readv(fd, [view[num_read:]])
            if chunk == 0:
                break  # shrank meanwhile: the parser below rejects a short file
            num_read += chunk
        return view[:num_read]
    finally:
        os.close(fd)


def max_file_bytes(page_format: PageFormat) -> int:
    return page_format.page_num_bytes + TAG_BYTES + FILE_OVERHEAD_BYTES


def read_page_file(path: str, page_format: PageFormat, tier_key: TierKey, key: bytes,
                   token_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """The verified KV stored at ``path``, decrypted into ``out`` (see ``codec.open_payload``; a new tensor if None).

    Raises FileNotFoundError if there is no file, NotRegularFile (a RejectedEntry) for anything but a regular file,
    RejectedEntry if it is oversized, truncated, corrupt, tampered, foreign, or holds other tokens, and OSError for
    other I/O failures.
    """
    max_bytes = max_file_bytes(page_format)
    data = read_file_safely(path, max_bytes, into=scratch_buffer(max_bytes))  # valid until this thread's next read
    try:
        reader = ipc.open_file(pa.BufferReader(pa.py_buffer(data)))
        metadata = reader.schema.metadata or {}
        if HEADER_METADATA_KEY not in metadata:
            raise RejectedEntry("no prefixserve page header in the Arrow schema metadata")
        if reader.num_record_batches != 1:
            raise RejectedEntry(f"{reader.num_record_batches} record batches, expected 1")
        batch = reader.get_batch(0)
        batch.validate(full=True)  # bounds-check offsets before touching the bytes they point at
        if batch.num_rows != 1 or batch.schema.names != [KV_COLUMN]:
            raise RejectedEntry(f"unexpected table: {batch.num_rows} rows, columns {batch.schema.names}")
        column = batch.column(0)
        if column.null_count:
            raise RejectedEntry("the kv cell is null")
        # the cell's bytes straight from the column's buffers (validated above); ``column[0]`` would build a scalar
        # at ~90 us a page
        _, offsets, values = column.buffers()
        start, end = memoryview(offsets).cast("q")[column.offset : column.offset + 2]
        sealed = memoryview(values).cast("B")[start:end]  # Arrow exports signed bytes
        return open_payload(metadata[HEADER_METADATA_KEY], page_format, tier_key, key, token_ids, sealed, out)
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
