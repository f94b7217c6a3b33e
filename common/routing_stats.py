"""The routing-stats wire format: what a replica returns from Ray Serve's ``record_routing_stats()`` (encoder) and
how a router reads it (parser). The replica's side of the payload rule below is ``replica.event_log.ReplicaEventLog``.

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

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from common.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from common.page_keys import KEY_NUM_BYTES, PageKey
from common.types import EngineStats

ROUTING_STATS_FORMAT = 1

_KIND_STORED = "stored"
_KIND_REMOVED = "removed"
_KIND_CLEARED = "cleared"


class RoutingStatsError(ValueError):
    """A routing-stats dict that is not format 1 (the router ignores that replica's report and logs why)."""


@dataclass(frozen=True)
class IndexSnapshot:
    """Every page key a replica had cached as of event ``seq`` (0: before its first event, numbered 1)."""

    seq: int
    keys: tuple[PageKey, ...]


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
