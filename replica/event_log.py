"""A replica's bounded log of recent KV events, and the rule deciding what each routing-stats payload carries
(common/routing_stats.py documents the rule and the wire format); and ``TierEventRelay``, which carries the shared
tiers' events (replica/tiers/events.py) in the same payloads under the same rule, one log per tier medium."""

from __future__ import annotations

import dataclasses
import secrets
from collections import deque
from typing import Any, Callable, Iterable, Sequence

from common.events import KVEvent, PagesRemoved, PagesStored
from common.page_keys import PageKey
from common.routing_stats import MeasuredCosts, RetainedPages, make_routing_stats, make_tier_stats, tier_holder_id
from common.types import EngineStats


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
        self, engine_stats: EngineStats, snapshot_keys_fn: Callable[[], Iterable[PageKey]], *,
        costs: MeasuredCosts | None = None, retained: Iterable[RetainedPages] | None = None,
    ) -> dict[str, Any]:
        """The dict ``record_routing_stats()`` returns now. Calls ``snapshot_keys_fn`` only when a snapshot is due.
        ``costs`` and ``retained`` ride along as they are (common/routing_stats.py)."""
        events, snapshot_keys = self._next_payload(snapshot_keys_fn)
        return make_routing_stats(
            self.replica_id,
            engine_stats,
            events,
            snapshot_keys,
            epoch=self.epoch,
            last_seq=self._last_seq,
            costs=costs,
            retained=None if retained is None else list(retained),
        )

    def tier_payload(self, medium: str, snapshot_keys_fn: Callable[[], Iterable[PageKey]]) -> dict[str, Any]:
        """One entry of a payload's ``tiers`` list: this log's events and snapshot for the tier ``medium``."""
        events, snapshot_keys = self._next_payload(snapshot_keys_fn)
        return make_tier_stats(medium, events, snapshot_keys, epoch=self.epoch, last_seq=self._last_seq)

    def _next_payload(self, snapshot_keys_fn: Callable[[], Iterable[PageKey]]
                      ) -> tuple[list[KVEvent], list[PageKey] | None]:
        snapshot_keys = list(snapshot_keys_fn()) if self.snapshot_due else None
        self._snapshot_due = False
        self._payload_last_seqs.append(self._last_seq)
        self._num_payloads += 1
        self._trim_published()
        return list(self._events), snapshot_keys

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


class TierEventRelay:
    """The shared tiers' KV events, for the routers: which pages this replica stored in each tier (host, disk) that
    the tier still holds (a tier's ``TierEventTracker``, replica/tiers/events.py), carried in this replica's
    routing-stats payloads as ``tiers`` entries (common/routing_stats.py), one ``ReplicaEventLog`` per medium under the
    same payload rule. The union over replicas is what the tier holds of the pages they wrote; the router prices
    those pages at the replicas' measured tier fetch cost instead of recomputing them (router/policy.py).

    ``sink`` is the trackers' callback (any thread: a deque append); ``payloads`` runs on the replica's event loop
    with ``record_routing_stats``. The tracker numbers nothing, so the relay numbers each medium's events itself.
    A snapshot is the tracker's announced pages, read after the drain (never older than the events' last seq)."""

    def __init__(self, replica_id: str, **log_options: Any) -> None:
        self.replica_id = replica_id
        self._log_options = log_options
        self._pending: deque[tuple[str, list[KVEvent]]] = deque()
        self._medium_to_log: dict[str, ReplicaEventLog] = {}
        self._medium_to_tracker: dict[str, Any] = {}

    def watch(self, tiers: Sequence[Any], sinks: Sequence[Callable[[str, list[KVEvent]], None]] = ()) -> None:
        """Enable each tier's events (``KVTier.enable_events``) with this relay as a sink, beside ``sinks`` (the KV
        event publisher's, when outside routers subscribe too). A tier that cannot publish events is skipped."""
        extra = list(sinks)

        def sink(medium: str, events: list[KVEvent]) -> None:
            self.sink(medium, events)
            for other in extra:
                other(medium, events)

        for tier in tiers:
            try:
                tier.enable_events(sink)
            except NotImplementedError:
                continue
            tracker = tier.event_tracker
            if tracker is not None:
                self._medium_to_tracker[tracker.medium] = tracker

    def sink(self, medium: str, events: Iterable[KVEvent]) -> None:
        self._pending.append((medium, list(events)))

    def payloads(self) -> list[dict[str, Any]]:
        """The ``tiers`` entries of the next routing-stats payload (empty when no tier publishes events)."""
        while self._pending:
            medium, events = self._pending.popleft()
            log = self._log_of(medium)
            seq = log.last_seq
            numbered = []
            for event in events:
                seq += 1
                numbered.append(dataclasses.replace(event, seq=seq))
            log.append(numbered)
        out = []
        for medium in sorted(set(self._medium_to_tracker) | set(self._medium_to_log)):
            tracker = self._medium_to_tracker.get(medium)
            out.append(self._log_of(medium).tier_payload(
                medium, lambda tracker=tracker: list(tracker.announced.values()) if tracker is not None else []))
        return out

    def _log_of(self, medium: str) -> ReplicaEventLog:
        log = self._medium_to_log.get(medium)
        if log is None:
            log = self._medium_to_log[medium] = ReplicaEventLog(tier_holder_id(self.replica_id, medium),
                                                                 **self._log_options)
        return log
