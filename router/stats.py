"""Routing stats: what a replica returns from Ray Serve's ``record_routing_stats()``, and how a router reads it.

How it travels. The Serve controller calls each replica's ``record_routing_stats()`` every
``request_routing_stats_period_s`` (x0.9-1.1), keeps only the latest dict per replica, and, when a dict differs from
the previous one, broadcasts every replica's latest dict to every process holding a handle; each of those processes has
its own router, whose ``RunningReplica.routing_stats`` then changes. So a router may miss payloads (updates coalesce),
may start long after the replicas, and nobody can ask it what it has seen. Hence the rule:

- Every payload carries the events appended during the last ``num_payloads_retained`` payloads (R, default 4), so a
  router that missed up to R - 1 payloads in a row catches up from events alone.
- Every ``snapshot_every_n_payloads``-th payload (K, default 20; the first payload is number 0) also carries a snapshot
  of all cached keys labelled with the newest ``seq``, so a new router, or one that saw a gap, is exact again within K
  periods (10 s at the 0.5 s period). A payload also carries a snapshot when events had to be dropped unpublished (the
  buffer holds at most ``max_num_buffered_keys`` keys), when the engine's numbering went backwards (new epoch), or when
  the replica asked for one (``request_snapshot``).
- Nothing in a payload changes while the replica is idle (no counter, no clock), so an idle replica costs no broadcasts
  except its periodic snapshot.

Wire format (format 1): a plain dict of str / int / None / bytes / lists, which Ray pickles and msgpack round-trips
(``use_bin_type=True``). Page keys travel as one ``bytes`` blob per event or snapshot: the 32-byte keys concatenated.

    {
      "format": 1,
      "replica_id": "r8x2k1",                       # Serve's ReplicaID.unique_id
      "epoch": "3f9c0a7d1e2b4c65",                  # one lifetime of the replica's event numbering
      "last_seq": 42,                               # newest event seq appended (first_seq - 1 = 0: none yet)
      "load": {"num_running": 3, "num_waiting": 1, "num_pages_free": 80, "num_pages_cached": 300,
               "num_pages_total": 512},
      "events": [["stored", 41, b"<32*n bytes>"], ["removed", 42, b"<32*m bytes>"], ["cleared", 43, b""]],
      "snapshot": None | {"seq": 42, "keys": b"<32*n bytes>"},
    }
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from replica.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from replica.page_keys import KEY_NUM_BYTES, PageKey
from router.index import IndexSnapshot

if TYPE_CHECKING:  # replica.outputs imports torch (through replica.sampling); routers only read attributes
    from replica.outputs import EngineStats

ROUTING_STATS_FORMAT = 1

_KIND_STORED = "stored"
_KIND_REMOVED = "removed"
_KIND_CLEARED = "cleared"


class RoutingStatsError(ValueError):
    """A routing-stats dict that is not format 1 (the router ignores that replica's report and logs why)."""


@dataclass(frozen=True)
class ReplicaLoad:
    """How busy a replica is, as the policy sees it."""

    replica_id: str
    num_requests: int = 0
    """Requests running or waiting on the replica (num_running + num_waiting, or a fresher estimate)."""
    num_pages_free: int = 0
    num_pages_total: int = 0


@dataclass(frozen=True)
class ReplicaReport:
    """One parsed routing-stats payload."""

    replica_id: str
    epoch: str
    last_seq: int
    num_running: int
    num_waiting: int
    num_pages_free: int
    num_pages_cached: int
    num_pages_total: int
    events: tuple[KVEvent, ...]
    snapshot: IndexSnapshot | None

    def to_load(self) -> ReplicaLoad:
        return ReplicaLoad(
            replica_id=self.replica_id,
            num_requests=self.num_running + self.num_waiting,
            num_pages_free=self.num_pages_free,
            num_pages_total=self.num_pages_total,
        )


# ---- encoding ---------------------------------------------------------------------------------------------------------
def make_routing_stats(
    replica_id: str,
    stats: EngineStats,
    events: Sequence[KVEvent],
    snapshot_keys: Iterable[PageKey] | None,
    *,
    epoch: str = "",
    last_seq: int | None = None,
) -> dict[str, Any]:
    """Build one payload. ``last_seq`` defaults to the newest event's seq (0 without events); it labels the snapshot.

    ``snapshot_keys`` must describe the cache no earlier than ``last_seq`` (taken later is fine: see router/index.py).
    """
    if last_seq is None:
        last_seq = events[-1].seq if events else 0
    return {
        "format": ROUTING_STATS_FORMAT,
        "replica_id": replica_id,
        "epoch": epoch,
        "last_seq": last_seq,
        "load": {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_pages_free": stats.num_pages_free,
            "num_pages_cached": stats.num_pages_cached,
            "num_pages_total": stats.num_pages_total,
        },
        "events": [encode_event(event) for event in events],
        "snapshot": None if snapshot_keys is None else {"seq": last_seq, "keys": join_keys(snapshot_keys)},
    }


def encode_event(event: KVEvent) -> list[Any]:
    if isinstance(event, PagesStored):
        return [_KIND_STORED, event.seq, join_keys(event.keys)]
    if isinstance(event, PagesRemoved):
        return [_KIND_REMOVED, event.seq, join_keys(event.keys)]
    if isinstance(event, AllPagesCleared):
        return [_KIND_CLEARED, event.seq, b""]
    raise TypeError(f"not a KV event: {event!r}")


def join_keys(keys: Iterable[PageKey]) -> bytes:
    return b"".join(keys)


def split_keys(blob: bytes) -> tuple[PageKey, ...]:
    if len(blob) % KEY_NUM_BYTES:
        raise RoutingStatsError(f"a key blob of {len(blob)} bytes is not a whole number of {KEY_NUM_BYTES}-byte keys")
    return tuple([blob[start : start + KEY_NUM_BYTES] for start in range(0, len(blob), KEY_NUM_BYTES)])


# ---- decoding ---------------------------------------------------------------------------------------------------------
def parse_routing_stats(raw: Mapping[str, Any] | None) -> ReplicaReport | None:
    """Parse a payload; None for an empty one (Serve's value before the first pull). Raises RoutingStatsError."""
    if not raw:
        return None
    if raw.get("format") != ROUTING_STATS_FORMAT:
        raise RoutingStatsError(
            f"routing stats format {raw.get('format')!r}, expected {ROUTING_STATS_FORMAT}: "
            "run the same prefixserve version on replicas and routers"
        )
    try:
        load = raw["load"]
        snapshot = raw["snapshot"]
        return ReplicaReport(
            replica_id=str(raw["replica_id"]),
            epoch=str(raw["epoch"]),
            last_seq=int(raw["last_seq"]),
            num_running=int(load["num_running"]),
            num_waiting=int(load["num_waiting"]),
            num_pages_free=int(load["num_pages_free"]),
            num_pages_cached=int(load["num_pages_cached"]),
            num_pages_total=int(load["num_pages_total"]),
            events=tuple(decode_event(item) for item in raw["events"]),
            snapshot=None if snapshot is None else IndexSnapshot(int(snapshot["seq"]), split_keys(snapshot["keys"])),
        )
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, RoutingStatsError):
            raise
        raise RoutingStatsError(f"malformed routing stats: {error!r}") from error


def decode_event(item: Sequence[Any]) -> KVEvent:
    kind, seq, blob = item
    if kind == _KIND_STORED:
        return PagesStored(seq=int(seq), keys=split_keys(blob))
    if kind == _KIND_REMOVED:
        return PagesRemoved(seq=int(seq), keys=split_keys(blob))
    if kind == _KIND_CLEARED:
        return AllPagesCleared(seq=int(seq))
    raise RoutingStatsError(f"unknown KV event kind {kind!r}")


# ---- the replica side -------------------------------------------------------------------------------------------------
class ReplicaEventLog:
    """A replica's bounded log of recent KV events and the payload rule in the module docstring.

    The Serve replica owns one. Contract: the engine numbers its events ``first_seq``, ``first_seq + 1``, ...; call
    ``append`` with every event drained from the engine, in order, before ``stats_payload``; ``snapshot_keys_fn``
    must return the keys cached now (after the appended events; later is fine), and is called only when
    ``snapshot_due``. Not thread-safe: call both from the replica's event loop.

    Buffer order: oldest event first; events older than the oldest retained payload are trimmed at each payload, and
    the oldest are dropped first when more than ``max_num_buffered_keys`` keys are buffered.
    """

    def __init__(
        self,
        replica_id: str,
        *,
        num_payloads_retained: int = 4,
        snapshot_every_n_payloads: int = 20,
        max_num_buffered_keys: int = 1 << 16,
        first_seq: int = 1,
        epoch: str | None = None,
    ) -> None:
        if num_payloads_retained < 1 or snapshot_every_n_payloads < 1 or max_num_buffered_keys < 1:
            raise ValueError(
                "num_payloads_retained, snapshot_every_n_payloads and max_num_buffered_keys must be >= 1 "
                f"(got {num_payloads_retained}, {snapshot_every_n_payloads}, {max_num_buffered_keys})"
            )
        self.replica_id = replica_id
        self.num_payloads_retained = num_payloads_retained
        self.snapshot_every_n_payloads = snapshot_every_n_payloads
        self.max_num_buffered_keys = max_num_buffered_keys
        self.epoch = epoch or new_epoch()
        self._first_seq = first_seq
        self._events: deque[KVEvent] = deque()
        self._num_buffered_keys = 0
        self._last_seq = first_seq - 1
        self._payload_last_seqs: deque[int] = deque(maxlen=num_payloads_retained + 1)
        """``last_seq`` at each of the last R + 1 payloads (the current one included), oldest first."""
        self._num_payloads = 0
        self._snapshot_due = True

    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def num_buffered_events(self) -> int:
        return len(self._events)

    @property
    def snapshot_due(self) -> bool:
        """Whether the next ``stats_payload`` will call ``snapshot_keys_fn`` (fetch the keys only then)."""
        return self._snapshot_due or self._num_payloads % self.snapshot_every_n_payloads == 0

    def request_snapshot(self) -> None:
        """Make the next payload carry a snapshot."""
        self._snapshot_due = True

    def append(self, events: Iterable[KVEvent]) -> None:
        """Record events in seq order. A seq that goes backwards starts a new epoch; one that skips ahead forces a
        snapshot (routers will see the gap and need it)."""
        for event in events:
            if event.seq != self._last_seq + 1:
                if event.seq <= self._last_seq:
                    self._start_new_epoch()
                else:
                    self._snapshot_due = True
            self._events.append(event)
            self._num_buffered_keys += _num_keys(event)
            self._last_seq = event.seq
        self._drop_overflow()

    def stats_payload(
        self, engine_stats: EngineStats, snapshot_keys_fn: Callable[[], Iterable[PageKey]]
    ) -> dict[str, Any]:
        """The dict ``record_routing_stats()`` returns now. Calls ``snapshot_keys_fn`` only when a snapshot is due."""
        snapshot_keys = list(snapshot_keys_fn()) if self.snapshot_due else None
        self._snapshot_due = False
        self._payload_last_seqs.append(self._last_seq)
        self._num_payloads += 1
        self._trim_published()
        return make_routing_stats(
            self.replica_id,
            engine_stats,
            list(self._events),
            snapshot_keys,
            epoch=self.epoch,
            last_seq=self._last_seq,
        )

    # ---- internals -------------------------------------------------------------------------------------------------
    def _trim_published(self) -> None:
        """Keep the events appended since the payload R payloads ago (all that a router which saw it may lack)."""
        if len(self._payload_last_seqs) <= self.num_payloads_retained:
            return
        oldest = self._payload_last_seqs[0]
        while self._events and self._events[0].seq <= oldest:
            self._num_buffered_keys -= _num_keys(self._events.popleft())

    def _drop_overflow(self) -> None:
        last_published = self._payload_last_seqs[-1] if self._payload_last_seqs else self._first_seq - 1
        while self._num_buffered_keys > self.max_num_buffered_keys and len(self._events) > 1:
            dropped = self._events.popleft()
            self._num_buffered_keys -= _num_keys(dropped)
            if dropped.seq > last_published:
                self._snapshot_due = True

    def _start_new_epoch(self) -> None:
        self.epoch = new_epoch()
        self._events.clear()
        self._num_buffered_keys = 0
        self._payload_last_seqs.clear()
        self._snapshot_due = True


def new_epoch() -> str:
    return secrets.token_hex(8)


def _num_keys(event: KVEvent) -> int:
    return len(event.keys) if isinstance(event, (PagesStored, PagesRemoved)) else 1
