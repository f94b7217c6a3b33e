"""The request lanes' wire protocol (replica/request_lane.py serves a lane, cluster/request_lanes.py opens one).

Handshake, as the page stream's (replica/page_stream.py) with its own first bytes: the server sends ``HELLO_MAGIC`` and
a nonce, the client its nonce and ``token_proof(token, b"peer", ...)``, the server ``token_proof(token, b"holder",
...)``; each side proves it knows the replica's random token without sending it. Then frames of ``u32 length |
pickle``::

    ingress -> replica:  ("hello", lane_id)           once, first
                         ("gen", n, EngineRequest)     a request, numbered by the ingress
                         ("cancel", n)                 the ingress gave request n up
    replica -> ingress:  ("out", n, RequestOutput)     an output (the last one has finished=True)
                         ("outs", [RequestOutput])     the outputs of one engine step for the lane's requests
                                                       after their first (matched by request id)
                         ("err", n, pickled exception) the request failed (nothing follows for n)
                         ("busy", n)                   the replica is full: n was not started

A frame is bounded before it is read (``MAX_FRAME_BYTES``); frames sent in one pass of the event loop leave in one
write (``FrameWriter``). Only a peer that proved the token is unpickled, as Ray itself unpickles what it is sent.
No torch, no Ray: the ingress process imports this.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import pickle
import secrets
import struct

NONCE_BYTES = 32
HELLO_MAGIC = b"PSRL"
"""A lane server's first bytes (the page stream's are b"PSXH")."""
PROOF_BYTES = hashlib.sha256().digest_size
READ_BYTES = 1 << 18
"""How much a ``FrameReader`` asks for at once."""
MAX_FRAME_BYTES = 256 << 20
"""The largest frame either side reads (a request of a few hundred thousand token ids pickles to a few MiB)."""
HEADER = struct.Struct("<I")


class LaneProtocolError(ConnectionError):
    """The other side broke the protocol (a frame too large, not a tuple, an unknown kind)."""


def token_proof(token: bytes, role: bytes, nonce_holder: bytes, nonce_peer: bytes) -> bytes:
    """What a side of a handshake sends to prove it knows ``token`` (``role``: b"peer" or b"holder")."""
    return hmac.new(token, role + nonce_holder + nonce_peer, hashlib.sha256).digest()


def encode(message: tuple) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple:
    """One frame (the hello, read before the connection's ``FrameReader`` takes over)."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    _check_size(size)
    return _message(pickle.loads(await reader.readexactly(size)))


class FrameReader:
    """The frames of a connection, all those complete in what has arrived at once: one wake-up of the reading task
    for the outputs of many requests, where reading each frame's header and body would take two."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buffer = bytearray()

    async def next_frames(self) -> list[tuple]:
        """At least one frame; ``IncompleteReadError`` at the end of the stream."""
        while True:
            messages = self._parse()
            if messages:
                return messages
            data = await self._reader.read(READ_BYTES)
            if not data:
                raise asyncio.IncompleteReadError(bytes(self._buffer), None)
            self._buffer += data

    def _parse(self) -> list[tuple]:
        buffer, offset, messages = self._buffer, 0, []
        view = memoryview(buffer)
        try:
            while len(buffer) - offset >= HEADER.size:
                (size,) = HEADER.unpack_from(buffer, offset)
                _check_size(size)  # before any of the body is waited for
                end = offset + HEADER.size + size
                if len(buffer) < end:
                    break
                messages.append(_message(pickle.loads(view[offset + HEADER.size:end])))
                offset = end
        finally:
            view.release()
        del buffer[:offset]
        return messages


def _check_size(size: int) -> None:
    if size > MAX_FRAME_BYTES:
        raise LaneProtocolError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")


def _message(message: object) -> tuple:
    if not isinstance(message, tuple) or not message:
        raise LaneProtocolError("a frame that is not a message")
    return message


def dump_error(error: BaseException) -> bytes:
    """A request's error for an "err" frame, pickled on its own, so that one the ingress cannot unpickle (a class it
    lacks, an ``__init__`` pickle cannot call again) fails only its request (``load_error``), not the lane."""
    try:
        return pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - any exception that does not pickle
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))


def load_error(data: bytes) -> BaseException:
    """The error ``dump_error`` sent, or a RuntimeError saying it could not be read."""
    try:
        error = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - whatever the replica's error was, the request failed
        return RuntimeError(f"the replica's error could not be read here ({type(exc).__name__}: {exc})")
    return error if isinstance(error, BaseException) else RuntimeError(f"the replica failed: {error!r}")


class FrameWriter:
    """Frames for one connection, written once per pass of the event loop (outputs of one engine step that reach
    the loop together leave in one ``write``)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending: list[bytes] = []

    def send(self, message: tuple) -> None:
        if self._writer.is_closing():
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(encode(message))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._writer.is_closing():
            self._writer.write(b"".join(pending))


async def prove_to_holder(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: bytes) -> None:
    """Client side of the handshake; ConnectionError when the server is not the holder of ``token``."""
    hello = await reader.readexactly(len(HELLO_MAGIC) + NONCE_BYTES)
    if hello[:len(HELLO_MAGIC)] != HELLO_MAGIC:
        raise LaneProtocolError("not a prefixserve replica")
    server_nonce = hello[len(HELLO_MAGIC):]
    nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(nonce + token_proof(token, b"peer", server_nonce, nonce))
    proof = await reader.readexactly(PROOF_BYTES)
    if not hmac.compare_digest(proof, token_proof(token, b"holder", server_nonce, nonce)):
        raise ConnectionRefusedError("the replica could not prove its token")
