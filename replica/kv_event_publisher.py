"""KV events for routers outside Ray Serve, in vLLM's schema over ZMQ (``--kv-events-config``).

The cache-aware routers operators already run (llm-d's precise prefix-cache scorer, Dynamo's KV router, Ray's
KV-aware router) subscribe to vLLM engines' KV events. A replica started with ``--kv-events-config`` publishes the
same page events it feeds our own router (common/events.py, drained with every routing-stats payload, so a batch
covers one stats period) as vLLM does:

    PUB socket      multipart [topic, seq (8 bytes, big-endian), payload]       seq = 0, 1, 2, ... per replica
    ROUTER socket   request  [identity, b"", start seq (8 bytes, big-endian)]      (a DEALER client sends
    (replay)        replies  [identity, b"", seq, payload] for every buffered       [b"", start seq]: one request
                             batch with seq >= start,                              gets many replies)
                             then [identity, b"", -1 (8 bytes, signed), b""]

    payload  = msgpack [ts, [event, ...], data_parallel_rank]                  (vLLM's EventBatch, array_like)
    event    = {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | None,
                "token_ids": [...all pages' tokens...], "block_size": page_size, "lora_id": None,
                "medium": "GPU", "lora_name": None[, "extra_keys": [("salted",) | None per page]]}
             | {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU"}
             | {"type": "AllBlocksCleared"}

    medium   = "GPU"    the replica's own page pool (vLLM's name for the engine's KV pool, also on vLLM's CPU backend)
             | "CPU"    the Redis host tier (vLLM's name for KV offloaded to host memory)
             | "DISK"   the disk tier (the name KV-event consumers use for a disk tier)

Block hashes are our page keys: by default as vLLM publishes its own (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``),
the key's low 64 bits as an unsigned int (``block_hash_format: "int"``), or the whole 32-byte key
(``"bytes"``, which vLLM's ``ExternalBlockHash = bytes | int`` also allows). A ``BlockStored`` covers one run of a
chain: each block's parent is the block before it, the first block's parent is ``parent_block_hash``. A chain
whose first page folds in a ``cache_salt`` carries ``("salted",)`` as that page's ``extra_keys``: the salt's presence,
never the salt (vLLM publishes the salt itself). Data-parallel replicas publish on ``endpoint`` / ``replay_endpoint``
with the port offset by the replica's rank (vLLM's rule for data-parallel ranks: tcp ports + rank, ``inproc://`` /
``ipc://`` names + ``_dp<rank>``); each batch carries that rank.

The shared tiers' events ("CPU", "DISK") come from each tier's event tracker (replica/tiers/events.py): a replica
announces the pages it stored in a tier and their removal by anyone, Redis' own evictions included, so that per
replica and medium a subscriber's index equals what the tier holds of that replica's pages. They travel in their own
batches on the same socket and sequence. Page 0 of a salted chain carries ``("salted",)`` there too (the engine marks
the pages it hands to the tiers); pages a replica shares from its cache later (a local hit written to a tier that
lacked it) are not marked, since only the request that computed page 0 knew its salt.

Contract: ``publish`` never blocks the caller and does no conversion work (a full queue drops the batch and counts it
in ``num_dropped``); converting, encoding and the sockets live on the publisher's own thread; ``close`` stops it.
Nothing here touches the page pool.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Iterable

import msgpack

from common.events import MEDIUM_DEVICE, AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from common.page_keys import PageKey
from replica.config import KVEventsConfig

logger = logging.getLogger(__name__)

SALTED_EXTRA_KEY = ("salted",)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The address replica ``rank`` uses: tcp port + rank; ipc/inproc names get ``_dp<rank>`` (rank 0 unchanged)."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def external_hash(key: PageKey, block_hash_format: str) -> int | bytes:
    """A page key as a vLLM block hash: its low 64 bits (vLLM's int form) or the key itself."""
    if block_hash_format == "bytes":
        return key
    return int.from_bytes(key[-8:], "big")


def to_vllm_events(events: Iterable[KVEvent], page_size: int, block_hash_format: str = "int",
                   medium: str = MEDIUM_DEVICE) -> list[dict]:
    """Our events as vLLM event dicts (field order as vLLM's msgspec structs encode them), on ``medium``. A
    ``PagesStored`` becomes one ``BlockStored`` per run of keys that continue one chain."""
    out: list[dict] = []
    for event in events:
        if isinstance(event, PagesStored):
            out.extend(_blocks_stored(event, page_size, block_hash_format, medium))
        elif isinstance(event, PagesRemoved):
            hashes = [external_hash(key, block_hash_format) for key in event.keys]
            out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium})
        elif isinstance(event, AllPagesCleared):
            out.append({"type": "AllBlocksCleared"})
    return out


def _blocks_stored(event: PagesStored, page_size: int, block_hash_format: str, medium: str) -> list[dict]:
    if len(event.infos) != len(event.keys):
        raise ValueError(f"PagesStored seq {event.seq} has {len(event.keys)} keys but {len(event.infos)} page infos")
    runs: list[list[int]] = []
    for index, info in enumerate(event.infos):
        continues = bool(runs) and info.parent_key is not None and info.parent_key == event.keys[index - 1]
        if continues:
            runs[-1].append(index)
        else:
            runs.append([index])
    blocks = []
    for run in runs:
        first = event.infos[run[0]]
        block: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [external_hash(event.keys[i], block_hash_format) for i in run],
            "parent_block_hash": (None if first.parent_key is None
                                  else external_hash(first.parent_key, block_hash_format)),
            "token_ids": list(itertools.chain.from_iterable(event.infos[i].token_ids for i in run)),
            "block_size": page_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }
        extra_keys = [SALTED_EXTRA_KEY if event.infos[i].salted and event.infos[i].parent_key is None else None
                      for i in run]
        if any(extra_keys):
            block["extra_keys"] = extra_keys
        blocks.append(block)
    return blocks


def encode_batch(ts: float, events: list[dict], data_parallel_rank: int) -> bytes:
    """vLLM's ``KVEventBatch`` (array_like): ``[ts, events, data_parallel_rank]``."""
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


class ZmqKVEventPublisher:
    """One replica's publisher: a PUB socket, an optional ROUTER replay socket and a bounded replay buffer, served by
    one thread. Buffer order: oldest batch first; beyond ``buffer_steps`` the oldest is forgotten."""

    POLL_S = 0.05

    def __init__(self, config: KVEventsConfig, *, page_size: int, rank: int = 0) -> None:
        import zmq  # here, so that importing this module (config parsing at the CLI) needs no zmq

        self.config = config
        self.page_size = page_size
        self.rank = rank
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, rank)
        self.num_published = 0
        self.num_dropped = 0
        self._zmq = zmq
        self._queue: queue.Queue[tuple[str, list[KVEvent]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay = None
        if self.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{rank}", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay: %s, rank %d)", self.endpoint, self.replay_endpoint, rank)

    def publish(self, events: Iterable[KVEvent]) -> None:
        """Queue one batch of the page pool's ``events`` (nothing when there are none); the publisher's thread
        converts, encodes and sends it. Never blocks."""
        self.publish_tier(MEDIUM_DEVICE, events)

    def publish_tier(self, medium: str, events: Iterable[KVEvent]) -> None:
        """Queue one batch of ``events`` on ``medium`` (a tier's event tracker calls this). Never blocks."""
        events = list(events)
        if not events:
            return
        try:
            self._queue.put_nowait((medium, events))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV event queue full (%d batches): a batch was dropped", self.config.max_queue_size)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to ``timeout_s``), then stop the thread and close the sockets."""
        if self._stopped.is_set():
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout=timeout_s)
        self._stopped.set()
        self._thread.join(timeout=timeout_s)

    # ---- the publisher thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                if self._replay is not None:
                    self._serve_replays()
                try:
                    batch = self._queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                try:
                    self._send(batch)
                except Exception:  # noqa: BLE001 - one bad batch must not stop the stream
                    self.num_dropped += 1
                    logger.exception("a KV event batch could not be published")
        except Exception:  # noqa: BLE001 - the publisher must never take the replica down
            logger.exception("KV event publisher stopped")
        finally:
            self._stopped.set()
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, batch: tuple[str, list[KVEvent]]) -> None:
        medium, events = batch
        converted = to_vllm_events(events, self.page_size, self.config.block_hash_format, medium)
        if not converted:
            return
        seq = self.num_published
        payload = encode_batch(time.time(), converted, self.rank)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.num_published += 1

    def _serve_replays(self) -> None:
        zmq = self._zmq
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""), flags=zmq.NOBLOCK)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class NullKVEventPublisher:
    """Publishes nothing (events off, or the sockets could not be opened)."""

    def publish(self, events: Iterable[KVEvent]) -> None:
        pass

    def publish_tier(self, medium: str, events: Iterable[KVEvent]) -> None:
        pass

    def close(self, timeout_s: float = 1.0) -> None:
        pass


def current_replica_rank() -> int:
    """Serve's rank of the replica running this code (0 outside Serve)."""
    try:
        from ray import serve

        return serve.get_replica_context().rank.rank
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return 0


def build_publisher(config: KVEventsConfig | None, *, page_size: int, rank: int | None = None,
                    tiers: Iterable[Any] = ()) -> ZmqKVEventPublisher | NullKVEventPublisher:
    """The replica's publisher (``rank``: None = this Serve replica's rank), also publishing the events of the
    shared ``tiers`` (``KVTier``s). Events off, or a socket that cannot be opened (port taken; logged), give a
    publisher that publishes nothing: serving goes on."""
    if config is None or not config.enabled:
        return NullKVEventPublisher()
    rank = current_replica_rank() if rank is None else rank
    try:
        publisher = ZmqKVEventPublisher(config, page_size=page_size, rank=rank)
    except Exception:  # noqa: BLE001 - events are an add-on; serving goes on without them
        logger.exception("could not open the KV event sockets %s / %s; serving without KV events",
                         offset_endpoint(config.endpoint, rank), offset_endpoint(config.replay_endpoint, rank))
        return NullKVEventPublisher()
    for tier in tiers:
        try:
            tier.enable_events(publisher.publish_tier)
        except Exception:  # noqa: BLE001 - a tier without events: the others and the device events go on
            logger.exception("the %s tier publishes no KV events", getattr(tier, "name", "?"))
    return publisher
