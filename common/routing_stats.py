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
      # optional (older replicas omit them; the router then uses its configured defaults and ages nothing):
      "costs": {"step_ms": 15.2, "prefill_token_ms": 0.41, "attention_pair_us": 0.33, "decode_row_ms": 5.1,
                "peer_copy_page_ms": 3.2, "host_page_ms": 2.9, "disk_page_ms": 2.2},   # only those measured
      "retained": [[priority, expires_at_unix_s | None, b"<32*n bytes>"], ...],  # pages held under a retention,
                                                    # grouped; None: until unpinned; at most MAX_RETAINED_KEYS keys
      "load": {..., "num_evictions": 7, "num_pages_retained": 12},
      "tiers": [{"medium": "CPU", "epoch": "...", "last_seq": 9, "events": [...], "snapshot": None | {...}}, ...],
                                                    # per shared tier medium (CPU: Redis, DISK: the disk tier): the
                                                    # pages this replica stored there that the tier still holds
      "stream": ["10.0.0.7", 41235, b"<32-byte token>", "<node id>" | None],
                                                    # the replica's page stream while it serves one
                                                    # (replica/page_stream.py): the router names it with a peer_hint
    }

``tiers`` follow the same rule as the replica's own events, each medium with its own epoch and numbering
(replica/event_log.py ``TierEventRelay``); a router indexes them under the pseudo-holder ``<replica_id>@<medium>``, and
the union over replicas is what the tier holds of the pages they wrote.

``costs`` are what the replica measured itself (replica/cost_meter.py): a fit of its own engine steps and the mean
seconds per page of its peer copies and tier fetches, all in milliseconds (attention in microseconds per computed x
context token pair). The expiry of a retained page is wall-clock (``time.time()``) and restarts on every hit, so it
is a lower bound; an idle replica's payload still does not change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from common.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from common.page_keys import KEY_NUM_BYTES, PageKey
from common.types import STREAM_TOKEN_BYTES, EngineStats, StreamLocation

logger = logging.getLogger(__name__)

ROUTING_STATS_FORMAT = 1

COST_NAMES = ("step_ms", "prefill_token_ms", "attention_pair_us", "decode_row_ms", "peer_copy_page_ms",
              "host_page_ms", "disk_page_ms")
"""The measured per-unit costs a payload may carry (``MeasuredCosts`` fields)."""

EXPORT_WAIT_S = 2.0
"""How long a replica asked for pages it is computing right now waits for them before it answers a peer's export
(``replica/async_engine.py``; below the peer client's 5 s timeout, so the requester still gets an answer, and
recomputes, if they take longer). The router prices a copy from a holder still computing the pages within this bound
(``PolicyConfig.holder_wait_s``)."""

MAX_RETAINED_KEYS = 8192
"""Retained page keys per payload (256 KiB of keys); beyond it the highest priorities, then the latest expiries."""

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
class MeasuredCosts:
    """Per-unit costs one replica measured (None: not measured yet; the router then uses its own default)."""

    step_ms: float | None = None
    """Fixed cost of one engine step."""
    prefill_token_ms: float | None = None
    """Per prompt token computed."""
    attention_pair_us: float | None = None
    """Per (computed token x context token) pair of prefill attention."""
    decode_row_ms: float | None = None
    """Per running request's decode row in a step."""
    peer_copy_page_ms: float | None = None
    """Per page copied from a peer (receiver side: request to verified page)."""
    host_page_ms: float | None = None
    """Per page fetched from the host tier (Redis)."""
    disk_page_ms: float | None = None
    """Per page fetched from the disk tier."""

    def to_wire(self) -> dict[str, float]:
        return {name: round(float(value), 6) for name in COST_NAMES
                if (value := getattr(self, name)) is not None}

    @staticmethod
    def from_wire(raw: Mapping[str, Any] | None) -> "MeasuredCosts | None":
        if not raw:
            return None
        values = {}
        for name in COST_NAMES:
            value = raw.get(name)
            if value is None:
                continue
            value = float(value)
            if not (value >= 0.0 and value < float("inf")):  # NaN, negative or infinite: not a measurement
                raise RoutingStatsError(f"cost {name}={value!r} is not a finite non-negative number")
            values[name] = value
        return MeasuredCosts(**values) if values else None


@dataclass(frozen=True)
class RetainedPages:
    """Pages a replica holds under a retention (priority > 0, TTL not expired): they stay while lower-priority pages
    can be evicted instead."""

    priority: int
    expires_at: float | None
    """Wall-clock seconds (``time.time()``) when the retention ends unless hit again; None: until unpinned."""
    keys: tuple[PageKey, ...]


@dataclass(frozen=True)
class ReplicaLoad:
    """How busy a replica is, as the policy sees it."""

    replica_id: str
    num_requests: int = 0
    """Requests running or waiting on the replica (num_running + num_waiting, or a fresher estimate)."""
    num_pages_free: int = 0
    num_pages_total: int = 0
    costs: MeasuredCosts | None = None
    """What the replica measured (None: an older replica, or nothing measured yet)."""


@dataclass(frozen=True)
class TierReport:
    """The ``tiers`` entry of one medium: this replica's pages in that shared tier, as events and snapshots."""

    medium: str
    epoch: str
    last_seq: int
    events: tuple[KVEvent, ...]
    snapshot: IndexSnapshot | None


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
    costs: MeasuredCosts | None = None
    retained: tuple[RetainedPages, ...] | None = None
    """None: the replica does not report retention (older format); () : nothing retained."""
    num_evictions: int | None = None
    num_pages_retained: int | None = None
    tiers: tuple[TierReport, ...] = ()
    """The shared tiers' entries (none: no tier, tier events off, or an older replica)."""
    stream: StreamLocation | None = None
    """Where the replica serves its pages to peers on other nodes over TCP (None: it serves no page stream)."""

    def to_load(self) -> ReplicaLoad:
        return ReplicaLoad(
            replica_id=self.replica_id,
            num_requests=self.num_running + self.num_waiting,
            num_pages_free=self.num_pages_free,
            num_pages_total=self.num_pages_total,
            costs=self.costs,
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
    costs: MeasuredCosts | None = None,
    retained: Sequence[RetainedPages] | None = None,
) -> dict[str, Any]:
    """Build one payload. ``last_seq`` defaults to the newest event's seq (0 without events); it labels the snapshot.

    ``snapshot_keys`` must describe the cache no earlier than ``last_seq`` (taken later is fine: see router/index.py).
    ``costs`` / ``retained``: the optional measured costs and retained pages (omitted when None).
    """
    if last_seq is None:
        last_seq = events[-1].seq if events else 0
    payload = {
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
        **_encode_log(events, snapshot_keys, last_seq),
    }
    kv_cache = getattr(stats, "kv_cache", None)
    payload["load"]["num_evictions"] = stats.num_evictions
    if kv_cache is not None:
        payload["load"]["num_pages_retained"] = kv_cache.num_retained_pages
    if costs is not None:
        payload["costs"] = costs.to_wire()
    if retained is not None:
        payload["retained"] = encode_retained(retained)
    return payload


def make_tier_stats(medium: str, events: Sequence[KVEvent], snapshot_keys: Iterable[PageKey] | None, *,
                    epoch: str, last_seq: int) -> dict[str, Any]:
    """One ``tiers`` entry (see the module docstring); the snapshot is labelled ``last_seq`` as in a payload."""
    return {"medium": medium, "epoch": epoch, "last_seq": last_seq, **_encode_log(events, snapshot_keys, last_seq)}


def _encode_log(events: Sequence[KVEvent], snapshot_keys: Iterable[PageKey] | None, last_seq: int) -> dict[str, Any]:
    """The ``events`` and ``snapshot`` fields of a payload or of a ``tiers`` entry."""
    return {
        "events": [encode_event(event) for event in events],
        "snapshot": None if snapshot_keys is None else {"seq": last_seq, "keys": join_keys(snapshot_keys)},
    }


def tier_holder_id(replica_id: str, medium: str) -> str:
    """The pseudo-holder a router indexes ``replica_id``'s pages in the shared tier ``medium`` under."""
    return f"{replica_id}@{medium}"


def encode_retained(groups: Sequence[RetainedPages]) -> list[list[Any]]:
    """Groups as wire lists, at most ``MAX_RETAINED_KEYS`` keys: highest priority first, then latest expiry."""
    ordered = sorted(groups, key=lambda g: (-g.priority, -(float("inf") if g.expires_at is None else g.expires_at)))
    out, budget = [], MAX_RETAINED_KEYS
    for group in ordered:
        if budget <= 0:
            break
        keys = group.keys[:budget]
        budget -= len(keys)
        out.append([int(group.priority), None if group.expires_at is None else float(group.expires_at),
                    join_keys(keys)])
    return out


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
            snapshot=_parse_snapshot(raw["snapshot"]),
            costs=MeasuredCosts.from_wire(raw.get("costs")),
            retained=None if raw.get("retained") is None else tuple(
                RetainedPages(int(priority), None if expires is None else float(expires), split_keys(blob))
                for priority, expires, blob in raw["retained"]),
            num_evictions=None if load.get("num_evictions") is None else int(load["num_evictions"]),
            num_pages_retained=None if load.get("num_pages_retained") is None else int(load["num_pages_retained"]),
            tiers=tuple(_parse_tier(entry) for entry in raw.get("tiers") or ()),
            stream=_stream_or_none(raw.get("stream"), raw.get("replica_id")),
        )
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, RoutingStatsError):
            raise
        raise RoutingStatsError(f"malformed routing stats: {error!r}") from error


def encode_stream(location: StreamLocation) -> list[Any]:
    """A page stream's location as a payload's ``stream`` entry."""
    return [location.host, location.port, location.token, location.node]


def parse_stream(raw: Sequence[Any] | None) -> StreamLocation | None:
    """A payload's ``stream`` entry (None: absent). Raises RoutingStatsError for a malformed one, without the value
    itself: the token stays out of logs."""
    if raw is None:
        return None
    malformed = RoutingStatsError("malformed page stream location in routing stats (host, port, token, node)")
    try:
        host, port, token, node = raw
    except (TypeError, ValueError):
        raise malformed from None
    if (not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536
            or not isinstance(token, bytes) or len(token) != STREAM_TOKEN_BYTES
            or not (node is None or isinstance(node, str))):
        raise malformed
    return StreamLocation(host, port, token, node)


def _stream_or_none(raw: Sequence[Any] | None, replica_id: Any) -> StreamLocation | None:
    """``parse_stream``, but a malformed entry only costs the replica's peers the page stream (logged), not its whole
    report: its events and load still count."""
    try:
        return parse_stream(raw)
    except RoutingStatsError as error:
        logger.warning("replica %s: %s; its peers copy through Ray", str(replica_id)[:64], error)
        return None


def _parse_tier(entry: Mapping[str, Any]) -> TierReport:
    medium = str(entry["medium"])
    if not medium or "@" in medium or len(medium) > 16:
        raise RoutingStatsError(f"bad tier medium {medium[:32]!r}")
    return TierReport(
        medium=medium,
        epoch=str(entry["epoch"]),
        last_seq=int(entry["last_seq"]),
        events=tuple(decode_event(item) for item in entry["events"]),
        snapshot=_parse_snapshot(entry["snapshot"]),
    )


def _parse_snapshot(raw: Mapping[str, Any] | None) -> IndexSnapshot | None:
    return None if raw is None else IndexSnapshot(int(raw["seq"]), split_keys(raw["keys"]))


def decode_event(item: Sequence[Any]) -> KVEvent:
    kind, seq, blob = item
    if kind == _KIND_STORED:
        return PagesStored(seq=int(seq), keys=split_keys(blob))
    if kind == _KIND_REMOVED:
        return PagesRemoved(seq=int(seq), keys=split_keys(blob))
    if kind == _KIND_CLEARED:
        return AllPagesCleared(seq=int(seq))
    raise RoutingStatsError(f"unknown KV event kind {kind!r}")
