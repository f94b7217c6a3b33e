"""The same-node export call without Ray: a peer asks a holder for its pages over a local socket.

A receiver on the holder's node copies pages straight out of the holder's pool (replica/shared_pool.py); what it still
needs from the holder is the answer to "which leading pages of these keys do you hold, at which page ids and
generations". Through Serve's handle (or a Ray actor call) that question costs a round trip of about 3-4 ms on this
project's boxes, as long as copying 16 MiB out of the pool (BENCHMARKS.md 0f). Asked over a Unix socket it costs about
a tenth of a millisecond::

    receiver                                            holder (ExportServer: an accept thread, a thread per peer)
      first fetch: export_pages through Ray   ---->
                   SharedPoolBundle          <----     location.socket names the holder's socket
      later fetches: keys over the socket     ---->     engine.share_pages(keys), as export_pages would call it
                     ids, generations, tokens <----
      copies the pages out of the shared pool, checks the generations (unchanged)

The socket is in Linux's abstract namespace under a random name (nothing on any file system; gone with the holder).
Both ends check the other with ``SO_PEERCRED``: the holder serves only processes of its own user, the receiver talks
only to the process the bundle named (its pid), which also refuses a name some other process took over. What crosses
is what ``export_pages`` answers a peer through Ray (page ids, generations, token ids of pages the asker named by key);
the pages themselves are read from the pool, which already needs the same user. Every failure (refused, closed,
malformed, a timeout) makes the receiver forget the socket and ask through Ray again, so this path only makes a copy
faster, never makes it fail.

Wire format, little endian, one request and one answer per exchange, any number of exchanges per connection::

    request: b"PSXE" | u32 num_keys | num_keys x 32-byte page keys
    answer:  b"PSXA" | u32 num_pages (0xFFFFFFFF: the holder failed) | u32 num_tokens
             | num_pages x 32-byte keys | int64 page_ids[num_pages] | int64 generations[num_pages]
             | u32 tokens_per_page[num_pages] | int64 token_ids[num_tokens]
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
import threading
import time
from typing import Callable

import numpy as np

from common.page_keys import KEY_NUM_BYTES, PageKey

logger = logging.getLogger(__name__)

REQUEST_MAGIC = b"PSXE"
ANSWER_MAGIC = b"PSXA"
FAILED = 0xFFFFFFFF
MAX_KEYS = 1 << 16
"""A request naming more keys is refused before they are read (a 128-token page each: 8M tokens)."""
MAX_TOKENS_PER_PAGE = 1 << 16
ACCEPT_RETRY_S = 0.05
"""Pause after a failed ``accept`` (out of descriptors or memory) before the next."""
MAX_CONNECTIONS = 256
"""Peer connections a holder serves at once, a thread each (a receiver keeps up to 2 open: 127 peers on one node). A
connection over the limit is closed at once and its receiver asks through Ray."""
_HEADER = struct.Struct("<4sI")
_ANSWER_HEADER = struct.Struct("<4sII")
_PEERCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket."""
    pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def encode_request(keys: list[PageKey]) -> bytes:
    if len(keys) > MAX_KEYS:
        raise ValueError(f"a pool export names at most {MAX_KEYS} keys, got {len(keys)}")
    if any(len(key) != KEY_NUM_BYTES for key in keys):
        raise ValueError(f"page keys are {KEY_NUM_BYTES} bytes")
    return _HEADER.pack(REQUEST_MAGIC, len(keys)) + b"".join(keys)


def encode_answer(keys: list[PageKey], page_ids: list[int], generations: list[int],
                  token_ids: list[list[int]]) -> bytes:
    counts = np.fromiter((len(tokens) for tokens in token_ids), dtype="<u4", count=len(token_ids))
    flat = np.fromiter((token for tokens in token_ids for token in tokens), dtype="<i8", count=int(counts.sum()))
    return b"".join((_ANSWER_HEADER.pack(ANSWER_MAGIC, len(keys), flat.size), *keys,
                     np.asarray(page_ids, dtype="<i8").tobytes(), np.asarray(generations, dtype="<i8").tobytes(),
                     counts.tobytes(), flat.tobytes()))


def failed_answer() -> bytes:
    return _ANSWER_HEADER.pack(ANSWER_MAGIC, FAILED, 0)


def decode_answer_header(header: bytes) -> tuple[int, int]:
    """(num_pages, num_tokens); raises ``ConnectionError`` on a malformed or failed answer."""
    magic, num_pages, num_tokens = _ANSWER_HEADER.unpack(header)
    if magic != ANSWER_MAGIC:
        raise ConnectionError("not a pool export answer")
    if num_pages == FAILED:
        raise ConnectionError("the holder could not answer")
    if num_pages > MAX_KEYS or num_tokens > num_pages * MAX_TOKENS_PER_PAGE:
        raise ConnectionError("a pool export answer out of bounds")
    return num_pages, num_tokens


def answer_body_size(num_pages: int, num_tokens: int) -> int:
    return num_pages * (KEY_NUM_BYTES + 8 + 8 + 4) + num_tokens * 8


def decode_answer_body(body: bytes, num_pages: int,
                       asked: list[PageKey]) -> tuple[list[PageKey], list[int], list[int], list[list[int]]]:
    """(keys, page_ids, generations, token_ids). The keys must be the leading run of the ``asked`` ones."""
    offset = num_pages * KEY_NUM_BYTES
    keys = [body[index * KEY_NUM_BYTES:(index + 1) * KEY_NUM_BYTES] for index in range(num_pages)]
    if num_pages > len(asked) or keys != list(asked[:num_pages]):
        raise ConnectionError("the holder answered keys that were not asked")
    page_ids = np.frombuffer(body, dtype="<i8", count=num_pages, offset=offset).tolist()
    generations = np.frombuffer(body, dtype="<i8", count=num_pages, offset=offset + 8 * num_pages).tolist()
    counts = np.frombuffer(body, dtype="<u4", count=num_pages, offset=offset + 16 * num_pages)
    flat = np.frombuffer(body, dtype="<i8", offset=offset + 20 * num_pages)
    if int(counts.sum()) != flat.size:
        raise ConnectionError("a pool export answer's token counts do not add up")
    bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).tolist()
    tokens = flat.tolist()
    return keys, page_ids, generations, [tokens[bounds[index]:bounds[index + 1]] for index in range(num_pages)]


def receive_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed the connection before the first byte, ConnectionError if
    it closed part-way."""
    received = 0
    while received < len(view):
        count = sock.recv_into(view[received:])
        if count == 0:
            if received == 0:
                return False
            raise ConnectionError("a message was cut short")
        received += count
    return True


def receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None if the peer closed the connection before the first one."""
    buffer = bytearray(size)
    return bytes(buffer) if receive_into(sock, memoryview(buffer)) else None


class PeerServer:
    """A listening socket, its accept thread, and a thread per admitted peer connection (at most
    ``max_connections``; more are closed at once). Subclasses give ``_admit`` (a check of a new connection: False
    closes it) and ``_serve`` (the connection's exchanges; it ends with ``_drop``)."""

    def __init__(self, listener: socket.socket, max_connections: int, thread_name: str) -> None:
        self._listener = listener
        self.max_connections = max_connections
        self.num_refused = 0
        """Connections refused: ``_admit`` said no, or ``max_connections`` were open."""
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread_name = thread_name
        self._thread = threading.Thread(target=self._accept, name=thread_name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        for sock in (self._listener, *connections):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    @property
    def serving(self) -> bool:
        """Whether peers may be sent here (open, and its accept thread alive)."""
        return not self._closed and self._thread.is_alive()

    def _admit(self, sock: socket.socket) -> bool:
        return True

    def _serve(self, sock: socket.socket) -> None:
        raise NotImplementedError

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.discard(sock)
        sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                # out of descriptors or memory for a moment: the peers asking meanwhile wait or are refused, and
                # ask through Ray; this socket stays (a return here would leave it named in answers, unanswered)
                logger.warning("accepting a peer on %s failed (%s); retrying", self._thread_name, exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            try:
                admitted = self._admit(sock)
                with self._lock:
                    refuse = self._closed or not admitted or len(self._connections) >= self.max_connections
                    if not refuse:
                        self._connections.add(sock)
                if refuse:
                    self.num_refused += 1
                    sock.close()
                    continue
                threading.Thread(target=self._serve, args=(sock,), name=f"{self._thread_name}-peer",
                                 daemon=True).start()
            except (OSError, RuntimeError) as exc:  # e.g. "can't start new thread": this peer asks through Ray
                logger.warning("serving a peer on %s failed (%s)", self._thread_name, exc)
                self._drop(sock)


class ExportServer(PeerServer):
    """Holder side: answers peers of this user on this node. ``answer(keys)`` returns the ``SharedPoolBundle`` of the
    leading pages held (``LLMEngine.share_pages``); it runs on the connection's thread and may wait (pages being
    computed)."""

    def __init__(self, answer: Callable[[list[PageKey]], object]) -> None:
        self.answer = answer
        self.name = f"\0prefixserve-pool-{os.getpid()}-{secrets.token_hex(12)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(self.name)
            listener.listen(MAX_CONNECTIONS)
        except BaseException:
            listener.close()
            raise
        super().__init__(listener, MAX_CONNECTIONS, "prefixserve-pool-exports")

    def _admit(self, sock: socket.socket) -> bool:
        _pid, uid = peer_credentials(sock)  # another user's process is refused
        return uid == os.getuid()

    def _serve(self, sock: socket.socket) -> None:
        try:
            while True:
                header = receive_exactly(sock, _HEADER.size)
                if header is None:
                    return
                magic, num_keys = _HEADER.unpack(header)
                if magic != REQUEST_MAGIC or num_keys > MAX_KEYS:
                    return  # not a peer of ours: hang up before reading anything more
                body = receive_exactly(sock, num_keys * KEY_NUM_BYTES) if num_keys else b""
                if body is None:
                    return
                keys = [body[index * KEY_NUM_BYTES:(index + 1) * KEY_NUM_BYTES] for index in range(num_keys)]
                try:
                    bundle = self.answer(keys)
                    reply = (failed_answer() if bundle is None else
                             encode_answer(bundle.keys, bundle.page_ids, bundle.generations, bundle.token_ids))
                except Exception:  # noqa: BLE001 - the peer asks through Ray instead
                    logger.warning("answering a pool export failed", exc_info=True)
                    reply = failed_answer()
                sock.sendall(reply)
        except (OSError, ConnectionError):
            pass  # the peer went away, or we are closing
        finally:
            self._drop(sock)


def _close(writer: asyncio.StreamWriter, sock: socket.socket) -> None:
    """Close a connection through its transport; when the transport's event loop is closed already (nothing will run
    that close), close the socket object itself. (Only then: a live transport may still flush to it. uvloop holds an
    I/O reference on the socket object, so this close leaves its descriptor to uvloop.)"""
    try:
        writer.close()
    except RuntimeError:
        sock.close()


class ExportClient:
    """Receiver side: asks holders over their sockets, keeping a few idle connections per holder (on the event loop
    that opened them: a connection is never used from another loop)."""

    def __init__(self, max_idle_per_holder: int = 2) -> None:
        self.max_idle_per_holder = max_idle_per_holder
        self._idle: dict[tuple[str, int], list[tuple[asyncio.AbstractEventLoop, asyncio.StreamReader,
                                                     asyncio.StreamWriter, socket.socket]]] = {}

    async def ask(self, name: str, pid: int, keys: list[PageKey]):
        """(keys, page_ids, generations, token_ids) of the leading pages the holder ``pid`` listening on ``name``
        holds. Raises ``OSError`` / ``ConnectionError`` (wrap it in a timeout: a holder may wait for pages being
        computed)."""
        request = encode_request(keys)
        loop = asyncio.get_running_loop()
        reader, writer, sock = await self._connection(loop, name, pid)
        try:
            writer.write(request)
            await writer.drain()
            num_pages, num_tokens = decode_answer_header(await reader.readexactly(_ANSWER_HEADER.size))
            if num_pages > len(keys):  # checked before the body is read
                raise ConnectionError("the holder answered more pages than were asked")
            body = await reader.readexactly(answer_body_size(num_pages, num_tokens))
            answer = decode_answer_body(body, num_pages, keys)
        except BaseException:
            _close(writer, sock)
            raise
        idle = self._idle.setdefault((name, pid), [])
        if len(idle) < self.max_idle_per_holder:
            idle.append((loop, reader, writer, sock))
        else:
            _close(writer, sock)
        return answer

    def forget(self, name: str, pid: int) -> None:
        for _loop, _reader, writer, sock in self._idle.pop((name, pid), []):
            _close(writer, sock)

    def close(self) -> None:
        """Close every idle connection."""
        for name, pid in list(self._idle):
            self.forget(name, pid)

    async def _connection(self, loop: asyncio.AbstractEventLoop, name: str, pid: int):
        idle = self._idle.get((name, pid))
        while idle:
            owner, reader, writer, sock = idle.pop()
            if owner is loop and not reader.at_eof() and not writer.is_closing():
                return reader, writer, sock
            _close(writer, sock)
        # connected here, then handed to the loop: uvloop (Serve's loop) refuses an abstract name (EINVAL). A local
        # connect to a listening socket completes at once (or fails at once: a full backlog is refused, not waited on)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            sock.connect(name)
            their_pid, their_uid = peer_credentials(sock)
            if their_pid != pid or their_uid != os.getuid():
                raise ConnectionError(f"the socket {name!r} is not the holder's (pid {their_pid}, not {pid})")
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            return reader, writer, sock
        except BaseException:
            sock.close()
            raise
