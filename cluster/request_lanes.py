"""The ingress's end of the request lanes (replica/request_lane.py): requests go to the replica the ingress's own
router chose over one TCP connection per replica, instead of through Serve's handle.

- ``RequestLanes.open_stream(request, through_handle)`` answers a stream with the interface the ingress reads
  (``__anext__``, ``cancel``). It takes a lane when this process's router (router/local_routers.py) runs on this event
  loop and a lane is open to every replica it routes among; then the router chooses (``route_for_lane``: the same
  decision, hint and in-flight counts as a request through the handle) and the request goes on that replica's lane.
  Otherwise, and for a request pinned to a replica, ``through_handle(request)`` makes the stream, and lanes to the
  replicas without one are opened in the background (one Serve call each; a failed open is not tried again for
  ``RETRY_S``).
- A replica that answers "busy" started nothing: the stream goes on through the handle (``through_handle``), whose
  queue and back-pressure bound what the replicas take, with ``avoid_replica`` naming the busy one, so the router sends
  it to another replica when there is one (the busy one would refuse it: ``ServeReplica.generate``'s 429) and does not
  count its demand twice.
- A lane that breaks fails its requests with ``LaneLost`` (before the first token the ingress sends a request again,
  as for a replica that died); a lane whose replica left the router's set, or every lane once the ingress had no
  request for ``LANE_IDLE_S``, is closed once its requests have ended (checked on every request and every
  ``WATCH_PERIOD_S``), which ends its Serve call (a replica being stopped waits for that call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, Callable

from ray.serve.exceptions import BackPressureError, RequestCancelledError

from cluster.detached import create_detached_task
from common.types import LaneOpen, RequestOutput, StreamLocation
from common.lane_protocol import FrameReader, FrameWriter, encode, load_error, prove_to_holder
from router import local_routers, long_calls

logger = logging.getLogger(__name__)

LANE_IDLE_S = 10.0
"""When the ingress sent no request for this long, its lanes are closed (opened again on demand)."""
RETRY_S = 30.0
"""After a lane failed to open (or broke), requests to that replica go through the handle for this long."""
RETRY_BUSY_S = 1.0
"""... or this long when its open call was refused by Serve's full handle queue (``BackPressureError``)."""
WATCH_PERIOD_S = 1.0
"""How often lanes are checked for a replica that left or an idle lane when no request comes."""
OPEN_TIMEOUT_S = 60.0
"""How long a lane's Serve call may take to name the server (a replica still compiling its first steps is slow to
answer; requests go through the handle meanwhile), and its connection to be made."""


def lanes_can_route() -> bool:
    """Whether this process's routers run on the event loop of its deployment's methods, so the ingress may call
    them (cluster/app.py sets ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`` for its deployments)."""
    from ray.serve._private import constants

    return not constants.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP


class LaneLost(ConnectionError):
    """The lane to the replica serving a request broke (the replica died, or closed it)."""


class LaneStream:
    """One request's outputs from its lane, or from Serve's handle once the replica answered "busy"."""

    def __init__(self, lane: "_Lane", number: int, request_id: str, done: Callable[[bool], None],
                 through_handle: Callable[[], Any]) -> None:
        self.request_id = request_id
        self._lane = lane
        self._number = number
        self._done = done
        self._through_handle = through_handle
        self._queue: asyncio.Queue = asyncio.Queue()
        self._handle_stream: Any = None
        self._ended = False
        self._cancelled = False

    def __aiter__(self) -> "LaneStream":
        return self

    def cancel(self) -> None:
        """Final: the replica is told, the request stops counting at once, and the next read (or one waiting now)
        raises ``RequestCancelledError``, whatever arrived before (a "busy" does not send it through the handle)."""
        if self._handle_stream is not None:
            self._handle_stream.cancel()
        elif not self._ended:
            self._cancelled = True
            self._lane.cancel(self._number)
            self._end()
            self._queue.put_nowait(("cancelled", self._number))

    async def __anext__(self) -> RequestOutput:
        if self._handle_stream is not None:
            return await self._handle_stream.__anext__()
        if self._cancelled:
            raise RequestCancelledError(f"lane request {self._number}")
        if self._ended:
            raise StopAsyncIteration
        message = await self._queue.get()
        if self._cancelled:
            raise RequestCancelledError(f"lane request {self._number}")
        kind = message[0]
        if kind == "out":
            output = message[2]
            if output.finished:
                self._end()
            return output
        self._end(ran=kind != "busy")  # "busy": it never ran there (the router's next choice is a retry of this one)
        if kind == "err":
            raise load_error(message[2])
        if kind == "busy":
            self._handle_stream = self._through_handle()
            return await self._handle_stream.__anext__()
        raise LaneLost(f"the request lane to {self._lane.replica_id} broke")

    def put(self, message: tuple) -> None:
        self._queue.put_nowait(message)

    def _end(self, ran: bool = True) -> None:
        if not self._ended:
            self._ended = True
            self._lane.forget(self._number)
            self._done(ran)


class _Lane:
    """One open lane: its connection, the requests on it, and the Serve call that holds it open."""

    def __init__(self, replica_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 call_task: asyncio.Task) -> None:
        self.replica_id = replica_id
        self._reader = reader
        self._writer = writer
        self._frames = FrameWriter(writer)
        self.call_task = call_task
        self._streams: dict[int, LaneStream] = {}
        self._request_to_number: dict[str, int] = {}
        """Request id -> its number here: outputs in the replica's batches ("outs") name only the request."""
        self._next = 0
        self.closed = False
        self.closing = False
        self.read_task = create_detached_task(self._read())

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def _put(self, number: int | None, message: tuple) -> None:
        stream = self._streams.get(number)
        if stream is not None:
            stream.put(message)

    def generate(self, request: Any, done: Callable[[bool], None], through_handle: Callable[[], Any]) -> LaneStream:
        self._next += 1
        stream = LaneStream(self, self._next, request.request_id, done, through_handle)
        self._streams[self._next] = stream
        self._request_to_number[request.request_id] = self._next
        self._frames.send(("gen", self._next, request))
        return stream

    def cancel(self, number: int) -> None:
        if not self.closed and number in self._streams:
            self._frames.send(("cancel", number))

    def forget(self, number: int) -> None:
        stream = self._streams.pop(number, None)
        if stream is not None and self._request_to_number.get(stream.request_id) == number:
            del self._request_to_number[stream.request_id]
        if self.closing and not self._streams:
            self.close()

    def close(self) -> None:
        """Close now: requests still on it fail with ``LaneLost``."""
        if not self.closed:
            self.closed = True
            self._writer.close()
            self.call_task.cancel()
            for stream in list(self._streams.values()):
                stream.put(("lost",))

    def close_when_idle(self) -> None:
        self.closing = True
        if not self._streams:
            self.close()

    async def _read(self) -> None:
        try:
            incoming = FrameReader(self._reader)
            while True:
                for message in await incoming.next_frames():
                    if message[0] == "outs":
                        for output in message[1]:
                            self._put(self._request_to_number.get(output.request_id), ("out", None, output))
                    elif len(message) >= 2:
                        self._put(message[1], message)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, asyncio.CancelledError):
            pass
        except Exception:  # noqa: BLE001 - a malformed frame: the lane is closed, requests go through the handle
            logger.warning("request lane to %s sent a malformed frame; closing it", self.replica_id, exc_info=True)
        finally:
            self.close()


async def connect_lane(replica_id: str, location: StreamLocation, lane_id: str, call_task: asyncio.Task) -> _Lane:
    """Connect to a replica's lane server, prove its token, say which lane this is."""
    reader, writer = await asyncio.open_connection(location.host, location.port)
    try:
        await prove_to_holder(reader, writer, location.token)
        writer.write(encode(("hello", lane_id)))
    except BaseException:
        writer.close()
        raise
    return _Lane(replica_id, reader, writer, call_task)


class RequestLanes:
    """The ingress's lanes, one per replica of ``replicas`` (a DeploymentHandle)."""

    def __init__(self, replicas: Any, stream_call: Callable[[Any], Any], metrics: Any = None) -> None:
        """``stream_call(handle)``: the handle for streaming calls over the configured transport
        (cluster/output_channels.py ``streaming``)."""
        self.replicas = replicas
        self._stream_call = stream_call
        deployment_id = getattr(replicas, "deployment_id", None)
        self._deployment = (deployment_id.app_name, deployment_id.name) if deployment_id is not None else None
        self._metrics = metrics
        self._lanes: dict[str, _Lane] = {}
        self._opening: dict[str, asyncio.Task] = {}
        self._retry_at: dict[str, float] = {}
        self._retiring: set[_Lane] = set()
        """Lanes closed to new requests, still carrying some."""
        self._last_request = time.monotonic()
        self._watch: asyncio.Task | None = None
        self._closed = False

    async def open_stream(self, request: Any, through_handle: Callable[[Any], Any]) -> Any:
        """The request's stream: over a lane when one can take it, else ``through_handle(request)``."""
        router = self._router()
        if router is None or getattr(request, "target_replica", None):
            return self._counted("handle", through_handle(request))
        replica_ids = router.replica_ids()
        self._last_request = time.monotonic()
        self._tend(replica_ids, open_missing=True)
        if self._watch is None:
            self._watch = create_detached_task(self._watch_lanes())
        if not replica_ids or any(replica_id not in self._lanes for replica_id in replica_ids):
            return self._counted("handle", through_handle(request))
        replica_id, routed, done = await router.route_for_lane(request)
        lane = self._lanes.get(replica_id)
        if lane is None or lane.closed or lane.closing:  # it closed meanwhile (its replica is leaving): as a "busy"
            done(False)
            return self._counted("handle", through_handle(dataclasses.replace(request, avoid_replica=replica_id)))
        # "busy": through the handle, to another replica when there is one (the router avoids this one)
        return self._counted("lane", lane.generate(routed, done, lambda: self._counted("handle", through_handle(
            dataclasses.replace(request, avoid_replica=replica_id)), busy=True)))

    def _router(self) -> Any:
        if self._deployment is None or self._closed:
            return None
        return local_routers.find(*self._deployment)

    async def _watch_lanes(self) -> None:
        """Close lanes to replicas that left and idle ones even when no request comes (a replica being stopped waits
        for its lane's call)."""
        while not self._closed:
            await asyncio.sleep(WATCH_PERIOD_S)
            router = self._router()
            if router is not None:
                self._tend(router.replica_ids(), open_missing=False)

    def close(self) -> None:
        """Close every lane now (the ingress is shutting down: nothing is left on them)."""
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        for task in list(self._opening.values()):
            task.cancel()
        for lane in list(self._lanes.values()) + list(self._retiring):
            lane.close()

    def _counted(self, path: str, stream: Any, busy: bool = False) -> Any:
        if self._metrics is not None:
            self._metrics.lane_requests.labels("busy" if busy else path).inc()
        return stream

    def _tend(self, replica_ids: list[str], open_missing: bool) -> None:
        """Close lanes to replicas that left, and idle ones; open the missing ones (in the background)."""
        now = time.monotonic()
        current = set(replica_ids)
        idle = now - self._last_request > LANE_IDLE_S  # no request at all: a lane a router seldom picks stays open
        self._retiring = {lane for lane in self._retiring if not lane.closed}
        for replica_id, lane in list(self._lanes.items()):
            if lane.closed:
                del self._lanes[replica_id]
                self._retry_at.setdefault(replica_id, now + RETRY_S)
            elif replica_id not in current or (idle and not lane.num_requests):
                del self._lanes[replica_id]
                lane.close_when_idle()
                if not lane.closed:
                    self._retiring.add(lane)
        if not open_missing:
            return
        for replica_id in replica_ids:
            if replica_id in self._lanes or replica_id in self._opening or now < self._retry_at.get(replica_id, 0.0):
                continue
            self._retry_at.pop(replica_id, None)
            task = create_detached_task(self._open(replica_id))  # its calls belong to no request
            self._opening[replica_id] = task
            task.add_done_callback(lambda _, rid=replica_id: self._opening.pop(rid, None))

    async def _open(self, replica_id: str) -> None:
        lane_id = uuid.uuid4().hex
        call = self._stream_call(self.replicas).request_lane.remote(LaneOpen(replica_id, lane_id))
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        call_task = create_detached_task(self._hold(replica_id, call, ready))
        try:
            location = await asyncio.wait_for(asyncio.shield(ready), OPEN_TIMEOUT_S)
            if isinstance(location, Exception):
                raise location
            if not isinstance(location, StreamLocation):
                raise ConnectionRefusedError("the replica serves no request lane")
            lane = await asyncio.wait_for(connect_lane(replica_id, location, lane_id, call_task), OPEN_TIMEOUT_S)
        except asyncio.CancelledError:
            call_task.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - no lane: requests to this replica go through the handle
            call_task.cancel()
            # a full handle queue (a burst before the lanes opened) passes: try again soon
            retry_s = RETRY_BUSY_S if isinstance(error, BackPressureError) else RETRY_S
            self._retry_at[replica_id] = time.monotonic() + retry_s
            logger.info("no request lane to %s (%s: %s); its requests go through Serve's handle for %.0f s",
                        replica_id, type(error).__name__, error, retry_s)
            return
        if self._closed:
            lane.close()
            return
        self._lanes[replica_id] = lane

    async def _hold(self, replica_id: str, call: Any, ready: asyncio.Future) -> None:
        """Read the lane's Serve call: its first message names the server; it then stays open until the lane ends.
        While it is open it is no load on the replica (router/long_calls.py)."""
        long_calls.opened(replica_id)
        try:
            async for location in call:
                if not ready.done():
                    ready.set_result(location)
        except Exception as error:  # noqa: BLE001 - the call failed: the lane (if open) is closed below
            if not ready.done():
                ready.set_result(error)
        finally:
            long_calls.closed(replica_id)
            if not ready.done():
                ready.set_result(None)
            lane = self._lanes.get(replica_id)
            if lane is not None and lane.call_task is asyncio.current_task():
                lane.close()
