"""A replica's bounded log of recent KV events, and the rule deciding what each routing-stats payload carries
(common/routing_stats.py documents the rule and the wire format)."""

from __future__ import annotations

import secrets
from collections import deque
from typing import Any, Callable, Iterable

from common.events import KVEvent, PagesRemoved, PagesStored
from common.page_keys import PageKey
from common.routing_stats import MeasuredCosts, RetainedPages, make_routing_stats
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
            costs=costs,
            retained=None if retained is None else list(retained),
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
