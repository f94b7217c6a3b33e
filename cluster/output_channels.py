"""The ingress's end of the replicas' output channels (replica/async_engine.py, "Output channels").

Every output on a request's own Serve stream is one Ray message: ~0.5 ms of the replica's CPU and ~1 ms of the
ingress's, per request and per engine step. With a channel open to a replica, the ingress gets one message per step
carrying the outputs of all its requests there; each request's own stream then carries only its first output (the
time to first token stays one hop) and its end, or an error.

- ``OutputChannels`` (one per ingress): opens a channel to a replica when a request's first output comes from it while
  the ingress has ``MIN_CONCURRENT`` or more requests in flight (requests sent from then on use it), reads it, and hands
  each output to its request's queue. A channel ends when its replica closes it (idle, or gone) and is opened again
  on demand. One request at a time keeps to its own stream: measured (BENCHMARKS.md 0l), a short request and a single
  stream were slower with a channel open, and there is nothing to batch.
- ``ChanneledStream`` wraps one request's stream with the interface the ingress already reads (``__anext__``,
  ``cancel``): outputs come from the stream until one says ``via_channel``, then from the request's queue, while the
  stream is still watched for its end or an error (a lost replica, a cancellation) and raises it as before.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from typing import Any, Callable

from cluster.detached import create_detached_task
from common.types import OutputChannelRequest, RequestOutput
from router import long_calls

logger = logging.getLogger(__name__)

MIN_CONCURRENT = 2
"""Requests in flight at the ingress from which a first output opens a channel to its replica."""

END_WAIT_S = 30.0
"""After a bound request's stream ended: how long its last output may take to arrive on the channel (it was sent
before the stream ended; only a channel that broke meanwhile leaves it missing)."""


def _ignore(*_args) -> None:
    pass


class OutputChannelLost(RuntimeError):
    """A bound request's stream ended, but its last output never came on the channel."""


class _StreamEnded:
    """Queued on a bound request's queue when its own stream ended (``error``: what the stream raised, or None)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


def streaming(replicas: Any, transport: str) -> Any:
    """``replicas`` (a DeploymentHandle) for streaming calls over ``transport`` (``ServeConfig.replica_transport``):
    "grpc" is Serve's gRPC transport between deployments, "ray" Ray actor calls. Same router either way."""
    return replicas.options(stream=True, _by_reference=transport == "ray")


class OutputChannels:
    """The ingress's output channels, one per replica, all under one ``channel_id``."""

    def __init__(self, replicas: Any, metrics: Any = None, num_inflight: Callable[[], int] = lambda: MIN_CONCURRENT,
                 transport: str = "grpc") -> None:
        """``metrics``: an ``IngressMetrics`` (its ``streamed_outputs`` and ``channel_messages`` counters), or None;
        ``num_inflight``: the ingress's requests in flight now; ``transport``: see ``streaming``."""
        self.replicas = replicas
        self.transport = transport
        self._num_inflight = num_inflight
        self.channel_id = uuid.uuid4().hex
        self._queues: weakref.WeakValueDictionary[str, asyncio.Queue] = weakref.WeakValueDictionary()
        self._replica_to_task: dict[str, asyncio.Task] = {}
        self._on_request_path = metrics.streamed_outputs.labels("request").inc if metrics is not None else _ignore
        self._on_channel_path = metrics.streamed_outputs.labels("channel").inc if metrics is not None else _ignore
        self._on_message = metrics.channel_messages.inc if metrics is not None else _ignore

    def stream(self, request_id: str, stream: Any) -> "ChanneledStream":
        """Wrap ``stream``, the Serve stream of a request sent with ``output_channel=self.channel_id``."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return ChanneledStream(self, request_id, stream, queue)

    def note_request_path(self, output: RequestOutput) -> None:
        """An output came on its request's own stream: count it, and open a channel to its replica if none is and
        requests run side by side."""
        self._on_request_path()
        if self._num_inflight() >= MIN_CONCURRENT:
            self.ensure_open(output.replica_id)

    def is_open(self, replica_id: str) -> bool:
        return replica_id in self._replica_to_task

    def ensure_open(self, replica_id: str) -> None:
        """Open a channel to ``replica_id`` unless one is open or opening."""
        if not replica_id or replica_id in self._replica_to_task:
            return
        task = create_detached_task(self._read(replica_id))  # not cancelled with the request that opens it
        self._replica_to_task[replica_id] = task
        task.add_done_callback(lambda done: self._ended(replica_id, done))

    def close(self) -> None:
        """Stop reading every channel (the replicas fail the requests still bound to them)."""
        for task in list(self._replica_to_task.values()):
            task.cancel()

    async def _read(self, replica_id: str) -> None:
        long_calls.opened(replica_id)  # not load on the replica (router/long_calls.py)
        try:
            await self._read_channel(replica_id)
        finally:
            long_calls.closed(replica_id)

    async def _read_channel(self, replica_id: str) -> None:
        stream = streaming(self.replicas, self.transport).output_channel.remote(
            OutputChannelRequest(self.channel_id, target_replica=replica_id))
        try:
            async for batch in stream:
                if not batch:
                    continue  # the replica's first message: the channel is open
                self._on_message()
                self._on_channel_path(len(batch))
                for output in batch:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        finally:
            stream.cancel()

    def _ended(self, replica_id: str, task: asyncio.Task) -> None:
        if self._replica_to_task.get(replica_id) is task:
            del self._replica_to_task[replica_id]
        if not task.cancelled() and task.exception() is not None:
            logger.info("output channel to replica %s ended: %r", replica_id, task.exception())


class ChanneledStream:
    """One request's outputs, from its Serve stream, then (once bound) from its output channel."""

    def __init__(self, channels: OutputChannels, request_id: str, stream: Any, queue: asyncio.Queue) -> None:
        self._channels = channels
        self._request_id = request_id
        self._stream = stream
        self._queue = queue
        self._bound = False
        self._watch: asyncio.Task | None = None
        self._ended: _StreamEnded | None = None

    def cancel(self) -> None:
        self._stream.cancel()

    def __aiter__(self) -> "ChanneledStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._bound:
            output = await self._stream.__anext__()
            self._channels.note_request_path(output)
            if output.via_channel:
                self._bound = True
                self._watch = asyncio.ensure_future(self._watch_stream())
            return output
        while True:
            if self._ended is not None and self._queue.empty():
                return await self._last_output()
            item = await self._queue.get()
            if isinstance(item, _StreamEnded):
                self._ended = item
                if item.error is not None:
                    raise item.error
                continue
            return item

    async def _watch_stream(self) -> None:
        """The bound request's own stream: it ends (the last output went to the channel) or raises; either way the
        reader learns it in order with the channel's outputs."""
        try:
            extra = await self._stream.__anext__()
        except StopAsyncIteration:
            self._queue.put_nowait(_StreamEnded(None))
        except BaseException as error:  # noqa: BLE001 - the reader raises it (cancellation included)
            self._queue.put_nowait(_StreamEnded(error))
        else:
            self._queue.put_nowait(_StreamEnded(OutputChannelLost(f"unexpected output on a bound stream: {extra!r}")))

    async def _last_output(self) -> RequestOutput:
        """The stream ended cleanly: the rest is on the channel, or will be shortly."""
        try:
            item = await asyncio.wait_for(self._queue.get(), END_WAIT_S)
        except asyncio.TimeoutError:
            raise OutputChannelLost(f"request {self._request_id}: its stream ended but its last output never came "
                                    "on the output channel") from None
        if isinstance(item, _StreamEnded):
            raise OutputChannelLost("the stream ended twice")
        return item

    def __del__(self) -> None:
        if self._watch is not None and not self._watch.done():
            self._watch.cancel()
