"""Peer copy between nodes without Ray's object store: the holder streams pages straight out of its pool over TCP.

A receiver on another node cannot map the holder's pool (replica/shared_pool.py). Through Ray, a host bundle costs
the holder's copy of the pages into a new array, Ray storing it, the object's trip and the receiver's get: 17-24 ms for
16 MiB on this project's 2-core box, of which the round trip alone is 3 ms and the copy and ``ray.put`` 5-7 ms
(``benchmarks/kv_breakdown.py --object-store``, BENCHMARKS.md 0i). Here the holder writes the pages' bytes from its
pool onto a TCP connection (``sendmsg`` of each page's per-layer K and V slices: no copy in the holder's process) and
the receiver reads them into an array per page, which the engine writes into its pool as it does a host bundle's, or,
given landing pages (replica/landing.py), straight into its pool pages, run by run::

    receiver                                              holder (StreamServer: an accept thread, a thread per peer)
      first fetch: export_pages through Ray       ---->   (skipped when the router named the stream: below)
                   PageBundle                     <----   bundle.stream names host, port and a token
      later fetches: connect, prove the token     <--->   (mutual HMAC-SHA256 over both sides' nonces)
                     keys                         ---->   engine.share_pages(keys): page ids, generations, tokens
                     keys, tokens, page bytes     <----   sent from the pool; then the generations read again:
                     pages still valid            <----   pages withdrawn meanwhile (and those after) are not valid

The holder also names its stream in its routing stats (common/routing_stats.py), and the router sends it along with
a ``peer_hint`` naming the holder (``EngineRequest.peer_stream``), so a request's receiver on another node asks here
from its first copy on (``ServePeerClient.learn_stream``); the bundle's name is for a receiver whose router has not
seen it. Hot-prefix copies (``PrefetchRequest``) carry the stream the same way.

Who may ask: a process that knows the holder's token, which is random per holder and only ever travels inside Ray
(the export answer through Serve's handle; the routing stats, from the Serve controller to the processes holding a
handle; the request the router sends to a replica): whoever can ask the holder through Ray for its pages may ask here.
Each side proves it knows the token without sending it, so the receiver also refuses a process that took over the port
after the holder went. The pages cross the network unencrypted, as Ray's own object transfers do without TLS: run
the cluster on a private network (README, "Threat model"). A request is bounded before it is read (at most
``MAX_KEYS`` keys) and an answer before it is read (no more pages than asked, the keys asked in order, a page no
larger than ``MAX_PAGE_BYTES``); a peer that breaks the protocol is hung up on.

Every failure (refused, closed, malformed, timed out) makes the receiver forget the address and ask through Ray again
(replica/peer_copy.py), so this path only makes a copy faster, never makes it fail.

Wire format, little endian; after the handshake, one request and one answer per exchange, any number per connection::

    handshake: holder b"PSXH" | 32-byte nonce_h; peer 32-byte nonce_p | HMAC(token, b"peer" | nonce_h | nonce_p);
               holder HMAC(token, b"holder" | nonce_h | nonce_p)
    request:   b"PSXT" | u32 num_keys | num_keys x 32-byte page keys
    answer:    b"PSXP" | u32 num_pages (0xFFFFFFFF: the holder failed) | u32 num_tokens | u8 dtype | 5 x u32 page
               shape (layers, 2, page size, kv heads, head dim) | num_pages x 32-byte keys | u32
               tokens_per_page[num_pages] | int64 token_ids[num_tokens] | the pages' bytes, page after page
               | u32 num_valid
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import socket
import struct
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from common.lane_protocol import token_proof
from common.page_format import DTYPE_NAME_TO_NUMPY, dtype_name
from common.page_keys import KEY_NUM_BYTES, PageKey
from common.types import STREAM_TOKEN_BYTES, StreamLocation
from replica.landing import writable_runs
from replica.pool_socket import PeerServer, receive_exactly, receive_into

logger = logging.getLogger(__name__)

HELLO_MAGIC = b"PSXH"
REQUEST_MAGIC = b"PSXT"
ANSWER_MAGIC = b"PSXP"
FAILED = 0xFFFFFFFF
NONCE_BYTES = 32
MAX_KEYS = 1 << 16
MAX_PAGE_BYTES = 256 << 20
"""A page larger than this is refused before any of it is read (a float32 page of 128 tokens of a 70B-class model with
80 layers x 8 KV heads x 128 is 40 MiB)."""
MAX_CONNECTIONS = 64
"""Peer connections a holder serves at once, a thread each; a connection over the limit is closed at once."""
HANDSHAKE_TIMEOUT_S = 5.0
IOV_MAX = 1024
"""Buffers per ``sendmsg`` (Linux's IOV_MAX)."""
RECEIVE_BUFFER_BYTES = 4 << 20
"""The receiver's socket buffer, set before it connects: the first answer on a new connection then arrives as fast
as later ones. With the kernel's autotuning the window starts small (``tcp_rmem``'s default, 128 KiB here) and 16 MiB
took 6.3-6.4 ms instead of 3.8-4.0 (BENCHMARKS.md 0zi). Capped at ``net.core.rmem_max``; below 1 MiB left to the
kernel, whose autotuning then goes further."""
RMEM_MAX_PATH = "/proc/sys/net/core/rmem_max"

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADER = struct.Struct("<4sI")
_ANSWER_HEADER = struct.Struct("<4sIIB5I")
_VALID = struct.Struct("<I")


def receive_buffer_bytes(rmem_max_path: str = RMEM_MAX_PATH) -> int:
    """``RECEIVE_BUFFER_BYTES`` capped at the kernel's ``rmem_max``, or 0 (leave the buffer to the kernel) when that
    is under 1 MiB or cannot be read."""
    try:
        with open(rmem_max_path) as file:
            limit = int(file.read().strip())
    except (OSError, ValueError):
        return 0
    size = min(RECEIVE_BUFFER_BYTES, limit)
    return size if size >= 1 << 20 else 0


def connect(host: str, port: int, timeout_s: float, buffer_bytes: int) -> socket.socket:
    """``socket.create_connection`` with the receive buffer (``buffer_bytes``; 0: the kernel's) set before the
    handshake, where it sizes the window the connection opens with."""
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
            sock.settimeout(timeout_s)
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error if error is not None else OSError(f"no address for {host}:{port}")


def node_address() -> str | None:
    """The address of this process's Ray node (what replicas on other nodes reach it by), or None outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - no Ray, or it cannot tell: no stream, peers copy through Ray
        return None


def _receive(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes; ConnectionError if the peer closes the connection first."""
    data = receive_exactly(sock, size)
    if data is None:
        raise ConnectionError("the connection closed")
    return data


def _send_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """``sendmsg`` the buffers in order, as many per call as the kernel takes (partial sends resumed)."""
    index = 0
    while index < len(buffers):
        sent = sock.sendmsg(buffers[index:index + IOV_MAX])
        while sent:
            size = len(buffers[index])
            if sent >= size:
                sent -= size
                index += 1
            else:
                buffers[index] = buffers[index][sent:]
                sent = 0


class StreamServer(PeerServer):
    """Holder side: answers peers that prove the token, sending pages from ``kv`` ([layers, 2, pages, ...], the
    pool) and checking ``generations`` after the send. ``answer(keys)`` returns the ``SharedPoolBundle`` of the leading
    pages held (``LLMEngine.share_pages``); it runs on the connection's thread and may wait (pages being computed)."""

    def __init__(self, answer: Callable[[list[PageKey]], object], kv: torch.Tensor, generations: np.ndarray,
                 host: str, port: int = 0, node: str | None = None) -> None:
        if kv.dtype not in _DTYPES or kv.dim() != 6 or not kv.is_contiguous():
            raise ValueError(f"a pool [layers, 2, pages, page size, kv heads, head dim] of {_DTYPES}, got "
                             f"{tuple(kv.shape)} {kv.dtype}")
        self.answer = answer
        self.kv = kv
        self.generations = generations
        self._bytes = kv.view(torch.uint8).numpy()  # [layers, 2, pages, page size, kv heads, head dim x bytes]
        self._page_shape = (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4], kv.shape[5])
        self._dtype_code = _DTYPES.index(kv.dtype)
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                 socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind((host, port))
            listener.listen(MAX_CONNECTIONS)
        except BaseException:
            listener.close()
            raise
        self.location = StreamLocation(host, listener.getsockname()[1], secrets.token_bytes(STREAM_TOKEN_BYTES), node)
        super().__init__(listener, MAX_CONNECTIONS, "prefixserve-page-stream")
        # num_refused also counts peers that could not prove the token

    def _handshake(self, sock: socket.socket) -> bool:
        token = self.location.token
        nonce = secrets.token_bytes(NONCE_BYTES)
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        sock.sendall(HELLO_MAGIC + nonce)
        reply = _receive(sock, NONCE_BYTES + hashlib.sha256().digest_size)
        peer_nonce, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(proof, token_proof(token, b"peer", nonce, peer_nonce)):
            self.num_refused += 1
            return False
        sock.sendall(token_proof(token, b"holder", nonce, peer_nonce))
        sock.settimeout(None)
        return True

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._handshake(sock):
                return
            while True:
                header = receive_exactly(sock, _HEADER.size)
                if header is None:
                    return  # the peer closed its idle connection
                magic, num_keys = _HEADER.unpack(header)
                if magic != REQUEST_MAGIC or num_keys > MAX_KEYS:
                    return
                body = _receive(sock, num_keys * KEY_NUM_BYTES) if num_keys else b""
                keys = [body[index * KEY_NUM_BYTES:(index + 1) * KEY_NUM_BYTES] for index in range(num_keys)]
                self._send_pages(sock, keys)
        except (OSError, ConnectionError):
            pass  # the peer went away or timed out, or we are closing
        finally:
            self._drop(sock)

    def _send_pages(self, sock: socket.socket, keys: list[PageKey]) -> None:
        try:
            bundle = self.answer(keys)
        except Exception:  # noqa: BLE001 - the peer asks through Ray instead
            logger.warning("answering a page stream request failed", exc_info=True)
            bundle = None
        if bundle is None:
            sock.sendall(_ANSWER_HEADER.pack(ANSWER_MAGIC, FAILED, 0, 0, 0, 0, 0, 0, 0))
            return
        counts = np.fromiter((len(tokens) for tokens in bundle.token_ids), dtype="<u4", count=len(bundle.keys))
        flat = np.fromiter((token for tokens in bundle.token_ids for token in tokens), dtype="<i8",
                           count=int(counts.sum()))
        head = b"".join((_ANSWER_HEADER.pack(ANSWER_MAGIC, len(bundle.keys), flat.size, self._dtype_code,
                                             *self._page_shape),
                         *bundle.keys, counts.tobytes(), flat.tobytes()))
        layers, two = self._page_shape[:2]
        pages = [memoryview(self._bytes[layer, kv, page_id]).cast("B")
                 for page_id in bundle.page_ids for layer in range(layers) for kv in range(two)]
        _send_buffers(sock, [memoryview(head), *pages])
        # after the send, as a receiver of a shared pool checks after its copy (replica/shared_pool.py): a page whose
        # generation moved was withdrawn, and perhaps written, while it was sent
        now = self.generations[bundle.page_ids].tolist() if bundle.page_ids else []
        num_valid = 0
        while num_valid < len(now) and now[num_valid] == bundle.generations[num_valid]:
            num_valid += 1
        sock.sendall(_VALID.pack(num_valid))


class PageSlots:
    """Receive buffers for pages, reused once nothing refers to what was received into them: a page's array is a view
    of a slot, and the slot comes back when the last view of it (the array, the tensors over it, the engine's and the
    tiers' references) is gone. Fresh memory faults in every 4 KiB page on first touch, and malloc hands freed pages of
    this size back to the system: each fetch into new arrays took twice as long (32 MiB: 37 against 17-20 ms here).
    At most ``max_bytes`` are kept; beyond them a page gets a plain new array."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept_bytes = 0
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                slot = free.pop()
            elif self._kept_bytes + nbytes <= self.max_bytes:
                slot = np.empty(nbytes, dtype=np.uint8)
                self._kept_bytes += nbytes
            else:
                return np.empty(shape, dtype=dtype)
        page = slot.view(dtype).reshape(shape)
        weakref.finalize(page, self._give_back, slot)
        return page

    def _give_back(self, slot: np.ndarray) -> None:
        with self._lock:
            self._free.setdefault(slot.nbytes, []).append(slot)


class StreamClient:
    """Receiver side: asks holders for pages over TCP, keeping a few idle, proven connections per holder. Calls block
    (run them on a worker thread); ``timeout_s`` bounds every connect and read."""

    def __init__(self, timeout_s: float = 5.0, max_idle_per_holder: int = 2) -> None:
        self.timeout_s = timeout_s
        self.max_idle_per_holder = max_idle_per_holder
        self._idle: dict[StreamLocation, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="peer-page-stream")
        """Where callers on an event loop run ``fetch`` (blocking reads off the event loop)."""
        self.slots = PageSlots()
        self.buffer_bytes = receive_buffer_bytes()
        """Each new connection's receive buffer (``RECEIVE_BUFFER_BYTES``; 0: the kernel's autotuning)."""

    def fetch(self, location: StreamLocation, keys: list[PageKey], out: list[torch.Tensor] | None = None):
        """(keys, token_ids, pages, dtype) of the leading pages of ``keys`` the holder held and still held after
        sending them: ``pages`` are numpy arrays [layers, 2, page size, kv heads, head dim] of the dtype's bits, one per
        page, in reused memory (``PageSlots``); or, given ``out`` (tensors of that shape and dtype: pool pages, replica/
        landing.py), page i is received straight into ``out[i]``, which is returned. Raises ``OSError`` /
        ``ConnectionError`` on any failure."""
        if len(keys) > MAX_KEYS or any(len(key) != KEY_NUM_BYTES for key in keys):
            raise ValueError(f"at most {MAX_KEYS} page keys of {KEY_NUM_BYTES} bytes")
        sock = self._connection(location)
        try:
            sock.sendall(_HEADER.pack(REQUEST_MAGIC, len(keys)) + b"".join(keys))
            answer = self._read_answer(sock, keys, out)
        except BaseException:
            sock.close()
            raise
        self._release(location, sock)
        return answer

    def preconnect(self, location: StreamLocation) -> None:
        """Open and prove a connection to ``location`` ahead of the first fetch, kept idle (none if one is idle
        already). A failure is left for the fetch to meet."""
        with self._lock:
            if self._idle.get(location):
                return
        try:
            sock = self._connection(location)
        except OSError:  # ConnectionError, a timeout, refused: the fetch will see it too
            return
        self._release(location, sock)

    def forget(self, location: StreamLocation) -> None:
        with self._lock:
            idle = self._idle.pop(location, [])
        for sock in idle:
            sock.close()

    def close(self) -> None:
        with self._lock:
            idle = [sock for socks in self._idle.values() for sock in socks]
            self._idle.clear()
        for sock in idle:
            sock.close()

    def _read_answer(self, sock: socket.socket, keys: list[PageKey], out: list[torch.Tensor] | None = None):
        magic, num_pages, num_tokens, dtype_code, *page_shape = _ANSWER_HEADER.unpack(
            _receive(sock, _ANSWER_HEADER.size))
        if magic != ANSWER_MAGIC:
            raise ConnectionError("not a page stream answer")
        if num_pages == FAILED:
            raise ConnectionError("the holder could not answer")
        if num_pages > len(keys):  # checked before anything more is read
            raise ConnectionError("the holder answered more pages than were asked")
        if dtype_code >= len(_DTYPES) or page_shape[1] != 2 or num_tokens > num_pages * page_shape[2]:
            raise ConnectionError("a page stream answer out of bounds")  # a page holds at most page-size tokens
        dtype = _DTYPES[dtype_code]
        page_bytes = math.prod(page_shape) * dtype.itemsize
        if page_bytes > MAX_PAGE_BYTES:
            raise ConnectionError(f"a page of {page_bytes} bytes is over the limit")
        answered = _receive(sock, num_pages * KEY_NUM_BYTES) if num_pages else b""
        found = [answered[index * KEY_NUM_BYTES:(index + 1) * KEY_NUM_BYTES] for index in range(num_pages)]
        if found != list(keys[:num_pages]):
            raise ConnectionError("the holder answered keys that were not asked")
        counts = np.frombuffer(_receive(sock, 4 * num_pages), dtype="<u4") if num_pages else np.empty(0, "<u4")
        if int(counts.sum()) != num_tokens:
            raise ConnectionError("a page stream answer's token counts do not add up")
        flat = np.frombuffer(_receive(sock, 8 * num_tokens), dtype="<i8").tolist() if num_tokens else []
        bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).tolist()
        token_ids = [flat[bounds[index]:bounds[index + 1]] for index in range(num_pages)]
        layers, two, page_size, heads, dim = page_shape
        name = dtype_name(dtype)
        if out is not None and len(out) >= num_pages and all(
                tuple(view.shape) == tuple(page_shape) and view.dtype == dtype for view in out[:num_pages]):
            pages = out[:num_pages]  # a pool page is 2 x layers runs: each received where it belongs
            buffers = [run for page in pages for run in writable_runs(page)]
        else:
            pages = [self.slots.take((layers, two, page_size, heads, dim), DTYPE_NAME_TO_NUMPY[name])
                     for _ in range(num_pages)]
            buffers = [memoryview(page).cast("B") for page in pages]
        for buffer in buffers:
            if not receive_into(sock, buffer):
                raise ConnectionError("the holder closed the connection mid-answer")
        (num_valid,) = _VALID.unpack(_receive(sock, _VALID.size))
        if num_valid > num_pages:
            raise ConnectionError("the holder called more pages valid than it sent")
        return found[:num_valid], token_ids[:num_valid], pages[:num_valid], name

    def _connection(self, location: StreamLocation) -> socket.socket:
        with self._lock:
            idle = self._idle.get(location)
            if idle:
                return idle.pop()
        sock = connect(location.host, location.port, self.timeout_s, self.buffer_bytes)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _receive(sock, len(HELLO_MAGIC) + NONCE_BYTES)
            if hello[:len(HELLO_MAGIC)] != HELLO_MAGIC:
                raise ConnectionError(f"{location} is not a holder's page stream")
            holder_nonce, nonce = hello[len(HELLO_MAGIC):], secrets.token_bytes(NONCE_BYTES)
            sock.sendall(nonce + token_proof(location.token, b"peer", holder_nonce, nonce))
            proof = _receive(sock, hashlib.sha256().digest_size)
            if not hmac.compare_digest(proof, token_proof(location.token, b"holder", holder_nonce, nonce)):
                raise ConnectionError(f"{location} could not prove the holder's token")
            return sock
        except BaseException:
            sock.close()
            raise

    def _release(self, location: StreamLocation, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(location, [])
            if len(idle) < self.max_idle_per_holder:
                idle.append(sock)
                return
        sock.close()
