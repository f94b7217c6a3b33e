"""The Ray Serve replica: one data-parallel copy of the model behind a Serve deployment.

A plain class; cluster/app.py wraps it with ``serve.deployment`` (num_replicas = the data-parallel degree and the
prefix-aware request router). The ingress calls it through a ``DeploymentHandle``:

    handle.options(stream=True).generate.remote(EngineRequest)   -> stream of RequestOutput
    handle.options(stream=True).output_channel.remote(OutputChannelRequest)
                                                                  -> stream of list[RequestOutput] (one per step)
    handle.info.remote()                                          -> ReplicaInfo
    handle.broadcast("reset_prefix_cache")                        -> one bool per replica
    handle.broadcast("stats")                                     -> one EngineStats per replica (for /metrics)
    handle.broadcast("kv_source_stats")                           -> one KVSourceStats per replica (for /metrics)
    handle.broadcast("pin_prefix", PinPrefix) / ("unpin_prefix", id) / ("prefix_reports")   -> admin (retention)
    handle.broadcast("take_back_pin", id, pin_id)                 -> admin: a pin whose warm-up failed, undone
    handle.export_pages.remote(PeerExportRequest)                 -> PageBundle | CudaIpcBundle | SharedPoolBundle
                                                                     (peer copy, holder)
    handle.release_pages.remote(PeerRelease)                      -> bool (a CUDA IPC copy is done)
    handle.prefetch_prefix.remote(PrefetchRequest)                -> PrefetchResult (hot-prefix replication, target)
    handle.options(stream=True).request_lane.remote(LaneOpen)     -> the lane server's StreamLocation, then open
                                                                     while the lane is (replica/request_lane.py)

Serve itself calls ``record_routing_stats()`` every ``request_routing_stats_period_s``; the dict it returns reaches the
router in every process holding a handle (common/routing_stats.py describes the format). The replica's id is Serve's
``ReplicaID.unique_id``, the same string the router uses, so events, hints and responses agree on names.

Contracts: ``__init__`` blocks while the model loads (Serve runs constructors off the request path); every other
method is async or O(1) and never blocks the replica's event loop (engine work runs on the AsyncEngine's thread).

Importing this module imports no torch: ``prefixserve serve``'s own process imports it to build the application
(cluster/app.py), and torch with Dynamo took 2.4 s of that process's start, before Ray (BENCHMARKS.md 0zr). The engine's
modules are imported where the replica is built and used (``__init__``, the peer-copy methods).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

from common.errors import ReplicaFullError
from common.routing_stats import encode_stream
from common.types import (EngineRequest, EngineStats, KVSourceStats, LaneOpen, OutputChannelRequest, PinPrefix,
                          PrefetchRequest, PrefetchResult, PrefixReport, ReplicaInfo, RequestOutput, StreamLocation,
                          TierReport)
from replica.config import EngineConfig
from replica.cost_meter import ReplicaCostMeter, retained_groups
from replica.event_log import ReplicaEventLog, TierEventRelay
from replica.kv_event_publisher import build_publisher
from replica.request_lane import LaneServer

if TYPE_CHECKING:  # these import torch (the module docstring)
    from replica.cuda_ipc import CudaIpcBundle, PeerRelease
    from replica.peer_copy import PageBundle, PeerExportRequest, ServePeerClient
    from replica.shared_pool import SharedPoolBundle


OUTPUT_CHANNEL_IDLE_S = 0.5
"""An output channel with no request bound to it and nothing to send for this long ends (its caller opens it again
when it next needs it): an open channel is an ongoing call, which Serve waits for before it stops a replica."""


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files ``tokenizer.save_pretrained`` writes, by name (for ``ReplicaInfo``)."""
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="prefixserve-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in Path(folder).iterdir() if path.is_file()}


def self_peer_client(device: str) -> ServePeerClient | None:
    """A peer client over this replica's own deployment (None outside Serve)."""
    from replica.peer_copy import ServePeerClient  # (outside the try: a broken import must not pass for "no Serve")

    try:
        from ray import serve

        context = serve.get_replica_context()
        return ServePeerClient(context.deployment, context.app_name, device=device)
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None


def current_replica_id(default: str) -> str:
    """Serve's ``ReplicaID.unique_id`` of the replica running this code, or ``default`` outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica (tests, local use)
        return default


def freeze_startup_objects() -> None:
    """Move everything start-up allocated (the model, transformers' and the compiler's objects: ~640k tracked
    objects for the tiny Llama, compiled) out of the garbage collector's reach (``gc.freeze``). Otherwise every
    full collection walks them all: 480 ms with the GIL held, a stall of every request in the replica, every few
    seconds under load."""
    gc.collect()
    gc.freeze()


class ServeReplica:
    """One replica: an ``AsyncEngine`` plus the Serve-facing methods listed in the module docstring."""

    def __init__(self, engine_config: EngineConfig, served_model_name: str,
                 peer_client: ServePeerClient | None = None, lane_capacity: int = 0) -> None:
        """Build the engine from ``engine_config`` with ``replica_id`` replaced by this replica's Serve id.
        ``peer_client``: how to reach peers (default: over this replica's own deployment handle);
        ``lane_capacity``: requests in the engine from which a request lane answers "busy" (0: serve no lanes)."""
        import torch

        from replica.async_engine import build_async_engine
        from replica.cuda_ipc import IpcExporter
        from replica.engine import dtype_line, resolve_dtype, startup_line

        start = time.perf_counter()
        replica_id = current_replica_id(engine_config.replica_id)
        config = dataclasses.replace(engine_config, replica_id=replica_id)
        if config.devices == "cpu":
            torch.set_num_threads(config.num_threads)
        self.replica_id = replica_id
        self.served_model_name = served_model_name
        self.config = config
        self.lane_capacity = lane_capacity
        self._lane_server: LaneServer | None = None
        if peer_client is None:
            peer_client = self_peer_client("cuda" if config.devices == "gpu" else "cpu")
        self.engine = build_async_engine(config, peer_client=peer_client)
        # Serve's logger: its handlers reach `prefixserve serve`'s output (the engine's own logger has none there)
        serve_logger = logging.getLogger("ray.serve")
        serve_logger.info("%s", dtype_line(replica_id, *resolve_dtype(config)))
        device = self.engine.engine.device
        self.ipc_exporter = IpcExporter(device) if device.type == "cuda" else None
        self._event_log = ReplicaEventLog(replica_id)
        self._cost_meter = ReplicaCostMeter()  # per-unit costs measured here, sent in the routing stats
        self.engine.engine.step_observer = self._cost_meter.observe_step
        tiers = self.engine.fetcher.tiers if self.engine.fetcher else ()
        self._tier_relay = TierEventRelay(replica_id)
        relay_tiers = config.route_on_tier_contents and bool(tiers)
        self._kv_publisher = build_publisher(config.kv_events_config, page_size=config.page_size,
                                             tiers=() if relay_tiers else tiers)
        if relay_tiers:  # one tracker per tier feeds the routers (routing stats) and, when configured, the publisher
            self._tier_relay.watch(tiers, sinks=[self._kv_publisher.publish_tier])
        self._tokenizer_files = tokenizer_files(self.engine.tokenizer)
        runner = self.engine.engine.runner
        serve_logger.info(
            "%s: model fingerprint %s, max_model_len %d, prefix caching %s",
            startup_line(replica_id, time.perf_counter() - start, runner.backend, runner.startup_seconds),
            self.engine.model_fingerprint,
            self.engine.max_model_len,
            "on" if config.enable_prefix_caching else "off",
        )
        freeze_startup_objects()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (call with ``handle.options(stream=True)``); the last has ``finished=True``.

        Raises ``InvalidRequestError`` before the first output when the request can never be served, and
        ``ReplicaFullError`` when request lanes carry requests here and the engine already holds ``lane_capacity``
        (Serve's own limit counts only the requests sent through its handle; with no lane request in, that limit is
        the bound, as with lanes off). Cancelling the call (the client went away) aborts the request and frees its
        pages.
        """
        lanes = getattr(self, "_lane_server", None)
        if (self.lane_capacity and lanes is not None and lanes.num_active
                and self.engine.num_requests >= self.lane_capacity):
            raise ReplicaFullError(f"replica {self.replica_id} holds {self.engine.num_requests} requests")
        async for output in self.engine.generate(request):
            yield output

    async def output_channel(self, request: OutputChannelRequest) -> AsyncIterator[list[RequestOutput]]:
        """The caller's output channel on this replica (call with ``handle.options(stream=True)``): one list of outputs
        per message, those of every request that named ``request.channel_id`` and was bound to it at its first output
        (``AsyncEngine``). The first message is empty: the channel is open. It ends when idle for
        ``OUTPUT_CHANNEL_IDLE_S``, when cancelled, or at once when addressed to another replica (the target left)."""
        if request.target_replica != self.replica_id:
            return
        channel = self.engine.open_channel(request.channel_id)
        try:
            yield []
            while (batch := await channel.next_batch(OUTPUT_CHANNEL_IDLE_S)) is not None:
                yield batch
        finally:
            self.engine.close_channel(channel)

    async def request_lane(self, request: LaneOpen) -> AsyncIterator[StreamLocation | None]:
        """The caller's request lane to this replica (call with ``handle.options(stream=True)``;
        replica/request_lane.py): the lane server's location, then open until the lane's connection ends. Nothing
        when addressed to another replica (the target left); None when this replica serves no lanes."""
        if request.target_replica != self.replica_id:
            return
        server = await self._lane_server_started()
        if server is None:
            yield None
            return
        server.expect(request.lane_id)
        try:
            yield server.location
            await server.hold(request.lane_id)
        finally:  # also when the caller ended the call
            server.drop(request.lane_id)

    async def _lane_server_started(self) -> LaneServer | None:
        if self.lane_capacity <= 0:
            return None
        if self._lane_server is None:
            from replica.page_stream import node_address
            from replica.shared_pool import node_id

            host = node_address()
            if host is None:
                return None
            self._lane_server = LaneServer(self.engine.generate,
                                           lambda: self.lane_capacity - self.engine.num_requests, host, node_id(),
                                           channels=self.engine)
        await self._lane_server.start()
        return self._lane_server

    async def export_pages(self, request: PeerExportRequest) -> PageBundle | CudaIpcBundle | SharedPoolBundle:
        """Peer copy, holder side: the leading pages of ``request.keys`` this replica holds, as where they lie in this
        replica's shared pool when the receiver is a CPU replica of this node, as a CUDA IPC bundle when it shares a
        GPU host with this replica, else as a host bundle (pinned while copied). A request that reached another
        replica than its target (the target left) answers no pages."""
        from replica.peer_copy import bundle_pages
        from replica.shared_pool import node_id

        if request.target_replica != self.replica_id:
            return bundle_pages([])
        if request.node_id is not None and request.node_id == node_id():
            shared = await self.engine.share_pages(list(request.keys))
            if shared is not None:
                return shared
        if self.ipc_exporter is not None and self.ipc_exporter.can_serve(request.ipc_target):
            pages = await self.engine.export_pages(list(request.keys), to_cpu=False)
            if pages:  # the export waits for the device (a synchronize): on a worker thread, off the event loop
                return await asyncio.to_thread(self.ipc_exporter.export, pages)
            return bundle_pages([])
        bundle = bundle_pages(await self.engine.export_pages(list(request.keys), contiguous=True))
        stream = self.engine.stream_location  # the receiver asks there next time, without the object store
        return dataclasses.replace(bundle, stream=stream) if stream is not None else bundle

    async def release_pages(self, request: PeerRelease) -> bool:
        """Peer copy, holder side: the receiver of a CUDA IPC bundle is done with it (False: unknown lease). The
        release collects the driver's IPC references (``torch.cuda.ipc_collect``) on a worker thread."""
        if self.ipc_exporter is None or request.target_replica != self.replica_id:
            return False
        return await asyncio.to_thread(self.ipc_exporter.release, request.lease_id)

    async def prefetch_prefix(self, request: PrefetchRequest) -> PrefetchResult:
        """Hot-prefix replication, target side: copy the prefix's pages from the peer ``request.peer_hint`` into this
        replica's prefix cache ahead of need (``AsyncEngine.prefetch_prefix``); the stored events that follow tell the
        routers. A request that reached another replica than its target (the target left) copies nothing."""
        if request.target_replica != self.replica_id:
            return PrefetchResult(self.replica_id, request.num_pages, error="addressed to another replica")
        return await self.engine.prefetch_prefix(request)

    def kv_source_stats(self) -> KVSourceStats:
        """Pages, bytes, seconds and errors per source (peer, host, disk), plus the shared tiers' own counters."""
        from replica.peer_copy import ServePeerClient

        fetcher = self.engine.fetcher
        if fetcher is None:
            return KVSourceStats(self.replica_id)
        peer_client = fetcher.peer_client
        return KVSourceStats(
            replica_id=self.replica_id,
            fetch={source: dataclasses.replace(stats) for source, stats in fetcher.source_to_stats.items()},
            tiers={tier.name: TierReport(tier.stats(), tier.available) for tier in fetcher.tiers},
            peer_transport=(dict(peer_client.transport_stats.pages) if isinstance(peer_client, ServePeerClient)
                            else {}),
            peer_export_calls=(peer_client.transport_stats.export_calls() if isinstance(peer_client, ServePeerClient)
                               else {}),
        )

    async def info(self) -> ReplicaInfo:
        return ReplicaInfo(
            replica_id=self.replica_id,
            served_model_name=self.served_model_name,
            model_fingerprint=self.engine.model_fingerprint,
            max_model_len=self.engine.max_model_len,
            page_size=self.config.page_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            vocab_size=self.engine.engine.vocab_size,
            tokenizer_files=self._tokenizer_files,
        )

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached page not in use; False when some pages were in use and stayed (engine's contract)."""
        return await self.engine.reset_prefix_cache()

    async def pin_prefix(self, pin: PinPrefix) -> dict[str, Any]:
        """Admin: retain the prefix here (now and when its pages are cached later)."""
        num_resident, num_retained = await self.engine.pin_prefix(pin)
        return {"replica_id": self.replica_id, "num_pages_resident": num_resident, "num_pages_retained": num_retained}

    async def unpin_prefix(self, prefix_id: str) -> bool:
        return await self.engine.unpin_prefix(prefix_id)

    async def take_back_pin(self, prefix_id: str, pin_id: str = "") -> bool:
        """Admin: undo this replica's part of a pin whose warm-up failed (an earlier pin of the prefix comes back)."""
        return await self.engine.take_back_pin(prefix_id, pin_id)

    async def prefix_reports(self) -> list[PrefixReport]:
        return await self.engine.prefix_reports()

    def stats(self) -> EngineStats:
        """The engine's counters now (gauges and monotonic totals); cheap, for /metrics."""
        return self.engine.stats()

    async def record_routing_stats(self) -> dict[str, Any]:
        """The routing-stats dict Serve pulls periodically (common/routing_stats.py, format 1).

        KV events drained from the engine feed the replica's event log; the cached-key snapshot is read on the engine
        thread after the drain, so it is never older than the events' last seq (the log's contract).
        """
        stats = self.engine.stats()
        events = self.engine.drain_kv_events()
        self._kv_publisher.publish(events)  # vLLM-schema events over ZMQ (a no-op without --kv-events-config)
        self._event_log.append(events)
        snapshot_keys = await self.engine.cached_page_keys()
        if self.engine.fetcher is not None:
            self._cost_meter.observe_sources(self.engine.fetcher.source_to_stats)
        retained = retained_groups(await self.engine.retained_page_keys())
        payload = self._event_log.stats_payload(stats, lambda: snapshot_keys, costs=self._cost_meter.costs(),
                                                retained=retained)
        tiers = self._tier_relay.payloads()
        if tiers:
            payload["tiers"] = tiers
        stream = self.engine.stream_location
        if stream is not None:  # the routers name it with a peer_hint: no first copy through the object store
            payload["stream"] = encode_stream(stream)
        return payload

    def __del__(self) -> None:
        """Serve calls this when the replica stops: stop the engine thread (requests in flight fail)."""
        if getattr(self, "_lane_server", None) is not None:
            self._lane_server.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if getattr(self, "_kv_publisher", None) is not None:
            self._kv_publisher.close()
