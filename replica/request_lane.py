"""Request lanes, replica side: the ingress sends requests straight to a replica's engine, beside Ray Serve's handle.

Through the handle, a 12-token request's trip to the engine and its first output's trip back cost ~1.8 ms of a
~7.3 ms request on this project's 2-core box: the handle's routing machinery, Serve's gRPC transport and the
replica's request wrapper (BENCHMARKS.md 0zj). A lane is one TCP connection from the ingress to a replica, opened
by a Serve streaming call (``ServeReplica.request_lane``) and held open by it, so that:

- the ingress's own router still chooses the replica (router/ray_router.py ``route_for_lane``);
- Serve counts the open call as an ongoing request, so a replica being stopped waits for it; the ingress closes a
  lane when its replica leaves the router's replica set (once its requests there have ended), or after it was idle,
  which ends the call;
- requests that cannot take a lane (none open yet, the replica full, a request pinned to a replica) go through the
  handle as before (cluster/request_lanes.py).

The wire protocol and its handshake are in common/lane_protocol.py. The server is an asyncio server on the replica's
event loop, where ``AsyncEngine.generate`` runs for requests from either path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import secrets
from typing import Any, Callable

from common.lane_protocol import (HELLO_MAGIC, NONCE_BYTES, PROOF_BYTES, FrameReader, FrameWriter, LaneProtocolError,
                                  dump_error, read_frame, token_proof)
from common.types import STREAM_TOKEN_BYTES, StreamLocation

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_WAIT_S = 30.0
"""How long a lane's Serve call waits for its connection before it ends."""


class _Lane:
    __slots__ = ("connected", "ended", "writer")

    def __init__(self) -> None:
        self.connected = asyncio.Event()
        self.ended = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None


class LaneServer:
    """A replica's end of its lanes: an asyncio TCP server on the replica's event loop.

    ``generate(request)`` is the engine's async iterator of outputs (``AsyncEngine.generate``, which counts a request
    from its first step); ``room()`` is how many more requests the replica takes now (at none, a request is answered
    "busy" and the ingress uses Serve's handle, whose queue bounds the rest).
    A lane is ``expect``-ed by its Serve call before the call names the server, and ``hold`` returns when its
    connection ended; a connection naming a lane that no call expects is refused."""

    def __init__(self, generate: Callable[[Any], Any], room: Callable[[], int], host: str,
                 node: str | None = None, channels: Any = None) -> None:
        """``channels``: the engine's output channels (``AsyncEngine.open_channel`` / ``close_channel``), or None:
        each lane gets one, so the outputs after a request's first leave once per engine step for all the lane's
        requests (one frame), instead of one frame per request from a task woken per request."""
        self._generate = generate
        self._room = room
        self._channels = channels
        self._not_started: set[asyncio.Task] = set()
        """Tasks of requests admitted that have not run yet (not in ``room()`` yet)."""
        self._host = host
        self._node = node
        self._token = secrets.token_bytes(STREAM_TOKEN_BYTES)
        self._server: asyncio.AbstractServer | None = None
        self.location: StreamLocation | None = None
        self._lanes: dict[str, _Lane] = {}
        self._starting = asyncio.Lock()
        self.num_refused = 0
        self.num_requests = 0
        self.num_active = 0
        """Lane requests admitted and not ended yet (``ServeReplica.generate`` refuses handle requests past capacity
        only while lanes carry some)."""
        self.num_busy = 0
        self.num_batches = 0

    async def start(self) -> StreamLocation:
        async with self._starting:  # two lanes opened at once start one server
            if self.location is None:
                self._server = await asyncio.start_server(self._on_connection, self._host, 0)
                port = self._server.sockets[0].getsockname()[1]
                self.location = StreamLocation(self._host, port, self._token, self._node)
        return self.location

    def expect(self, lane_id: str) -> None:
        self._lanes.setdefault(lane_id, _Lane())

    async def hold(self, lane_id: str, connect_wait_s: float = CONNECT_WAIT_S) -> None:
        """Return when lane ``lane_id``'s connection has ended, or if it did not connect within ``connect_wait_s``."""
        lane = self._lanes.get(lane_id)
        if lane is None:
            return
        try:
            await asyncio.wait_for(lane.connected.wait(), connect_wait_s)
        except asyncio.TimeoutError:
            return
        await lane.ended.wait()

    def drop(self, lane_id: str) -> None:
        """Close lane ``lane_id`` (its requests are cancelled) and forget it."""
        lane = self._lanes.pop(lane_id, None)
        if lane is not None and lane.writer is not None:
            lane.writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for lane in list(self._lanes.values()):
            if lane.writer is not None:
                lane.writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(HELLO_MAGIC + nonce)
        reply = await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
        peer_nonce, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(proof, token_proof(self._token, b"peer", nonce, peer_nonce)):
            self.num_refused += 1
            return False
        writer.write(token_proof(self._token, b"holder", nonce, peer_nonce))
        return True

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lane = None
        tasks: dict[int, asyncio.Task] = {}
        channel = pump = None
        try:
            if not await asyncio.wait_for(self._handshake(reader, writer), HANDSHAKE_TIMEOUT_S):
                return
            hello = await asyncio.wait_for(read_frame(reader), HANDSHAKE_TIMEOUT_S)
            lane = self._lanes.get(hello[1]) if len(hello) == 2 and hello[0] == "hello" else None
            if lane is None or lane.writer is not None:
                lane = None
                raise LaneProtocolError("a lane must open with the hello of a lane its Serve call expects")
            lane.writer = writer
            lane.connected.set()
            frames = FrameWriter(writer)
            if self._channels is not None:
                channel = self._channels.open_channel(f"lane-{hello[1]}")
                pump = asyncio.ensure_future(self._pump(channel, frames))
            incoming = FrameReader(reader)
            while True:
                for message in await incoming.next_frames():
                    self._take(message, frames, tasks, channel)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, OSError) as error:
            if isinstance(error, LaneProtocolError):
                logger.warning("a request lane broke the protocol (%s); closing it", error)
        except Exception:  # noqa: BLE001 - a frame that does not unpickle: hang up, the ingress sends again
            logger.warning("a request lane sent a malformed frame; closing it", exc_info=True)
        finally:
            for task in list(tasks.values()):
                task.cancel()  # the engine aborts them and frees their pages
            if pump is not None:
                pump.cancel()
                self._channels.close_channel(channel)
            writer.close()
            if lane is not None:
                lane.ended.set()

    def _take(self, message: tuple, frames: FrameWriter, tasks: dict[int, asyncio.Task], channel: Any = None) -> None:
        """Start a request (or answer "busy"), or cancel one."""
        kind = message[0]
        if kind == "gen" and len(message) == 3:
            number, request = message[1], message[2]
            if channel is not None and dataclasses.is_dataclass(request):  # its later outputs: the lane's batches
                request = dataclasses.replace(request, output_channel=channel.channel_id)
            # requests admitted from this same read have not reached the engine yet: count them too
            if len(self._not_started) >= self._room():
                self.num_busy += 1
                frames.send(("busy", number))
                return
            self.num_requests += 1
            self.num_active += 1
            task = asyncio.ensure_future(self._run(frames, number, request))
            self._not_started.add(task)
            tasks[number] = task
            task.add_done_callback(functools.partial(self._ended, tasks, number))
        elif kind == "cancel" and len(message) == 2:
            task = tasks.get(message[1])
            if task is not None:
                task.cancel()
        else:
            raise LaneProtocolError(f"an unknown message {kind!r}")

    async def _pump(self, channel: Any, frames: FrameWriter) -> None:
        """The lane's channel: each batch (the outputs of one engine step, after each request's first) as one frame."""
        while True:
            batch = await channel.next_batch(3600.0)
            if batch:
                self.num_batches += 1
                frames.send(("outs", batch))

    def _ended(self, tasks: dict[int, asyncio.Task], number: int, task: asyncio.Task) -> None:
        self.num_active -= 1
        tasks.pop(number, None)
        self._not_started.discard(task)  # cancelled before it ran

    async def _run(self, frames: FrameWriter, number: int, request: Any) -> None:
        self._not_started.discard(asyncio.current_task())  # the engine counts it from its first step below (no await
        # in between); a task cancelled before it ran leaves the set in its done callback
        try:
            async for output in self._generate(request):
                frames.send(("out", number, output))
        except Exception as error:  # noqa: BLE001 - the request fails at the ingress with this error
            frames.send(("err", number, dump_error(error)))
