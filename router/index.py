"""Prefix index: which replica holds which page keys, as far as this router has heard.

The index is fed by the KV events each replica publishes (``PagesStored`` / ``PagesRemoved`` / ``AllPagesCleared``,
numbered by a per-replica consecutive ``seq``) and by occasional full snapshots of a replica's cached keys. It answers
one question cheaply, with no remote call: for a request's page keys, how many *leading* pages does each replica hold?

    request keys   | k0 | k1 | k2 | k3 |
    replica a      | k0 | k1 |    | k3 |   -> 2  (k3 is useless without k2: only a leading run can be reused)
    replica b      | k0 |    |    |    |   -> 1
    replica c      |    | k1 | k2 |    |   -> 0  (not in the result)

Sync protocol, per replica (``sync`` applies one routing-stats report):

- ``epoch`` names one lifetime of the replica's event numbering. A new epoch drops everything known about the replica.
- Events are applied in ``seq`` order. An event with ``seq <= last_seq`` was already applied and is skipped. An event
  with ``seq > last_seq + 1`` reveals a gap (events were missed): it is applied anyway (best effort) and the replica is
  marked ``needs_snapshot``. A replica the index has never had a snapshot of also ``needs_snapshot``.
- A snapshot (the replica's full key set as of ``seq``) replaces what the index holds for the replica when the replica
  ``needs_snapshot``, when the snapshot is newer than ``last_seq``, or when the index holds guesses for the replica
  (``expect_keys``) and the snapshot is not older than ``last_seq``: an idle replica publishes no new events, so its
  snapshots keep the same label, and a wrong guess must still be dropped. Events newer than the snapshot are then
  re-applied.
  Replaying events in order over a snapshot taken at or after its label gives the right final state, because each
  event's effect on a key is overwritten by the next event touching that key.

Staleness only costs a cache miss: the chosen replica matches against its own cache and computes what it lacks.

Residency ahead (``expected_resident``). A request routed now is admitted later (after the replica's queue), and a
page the index holds may be evicted meanwhile. Each replica reports its evictions so far and how many pages its LRU
queue holds (``note_residency``); each held key keeps the replica's eviction count when it was last touched (stored,
or a request routed there that uses it). LRU evicts a page once the queue ahead of it has drained, so a page is
expected gone once ``lru_pages`` more pages than at its touch have been evicted. Only the admission wait is
extrapolated, at the replica's recent eviction rate: an idle replica ages nothing, however fast it evicted before.
Retained pages (priority > 0, the replica says until when) are not in that queue: they are certain holdings until
their retention ends, whatever the eviction rate. Nor are the pages of requests still running there: the router
``hold``s a request's keys on its replica from routing until the request finishes, and ``release`` touches them at
the replica's eviction count then, which is when its pool puts them at the LRU tail. Without that, a prefix that
long-running requests keep in use ages out in the router's eyes while it cannot be evicted (a running request's
pages stay put for its whole decode)::

    replica a: 10_000 evictions so far, lru_pages 400, 100 evictions/s, admission in 1 s -> 10_100 by then
    key   touched at eviction   retained until (router time)   admitted at now + 1 s (now = 10)
    k0    9_600                 20.0                           stays (retained past 11)
    k1    9_600                 -                              gone (10_100 - 9_600 > 400)    -> expected_resident = 1
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Collection, Iterable, Sequence

from common.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from common.page_keys import PageKey
from common.routing_stats import IndexSnapshot, RetainedPages


@dataclass(frozen=True)
class SyncResult:
    """What one ``sync`` / ``apply_events`` call did to one replica's entries."""

    num_events_applied: int = 0
    num_events_skipped: int = 0
    """Events at or below ``last_seq`` (already applied)."""
    num_gaps: int = 0
    """Places where a ``seq`` jumped ahead: events were missed."""
    applied_snapshot: bool = False
    reset_epoch: bool = False


@dataclass
class _ReplicaState:
    bit: int
    """This replica's bit in the holder masks (1 << slot)."""
    epoch: str | None = None
    last_seq: int | None = None
    needs_snapshot: bool = True
    guessed: bool = False
    """Keys were added by ``expect_keys`` since the last snapshot: the next snapshot replaces them with the truth."""
    keys: dict[PageKey, float] = field(default_factory=dict)
    """Held key -> the replica's eviction count (``evictions``) when it was last touched (stored or routed here)."""
    retained: dict[PageKey, float] = field(default_factory=dict)
    """Keys the replica holds under a retention -> router time the retention ends (``math.inf``: pinned)."""
    evictions: int = 0
    """The replica's evictions so far, as last reported."""
    lru_pages: float = math.inf
    """Pages in its LRU queue (evicted before a page touched now), as last reported (inf: never reported)."""
    eviction_rate: float = 0.0
    """Pages evicted per second (EWMA over reports)."""
    last_report_s: float | None = None
    """Router time of the last report with an eviction count."""
    in_use: dict[PageKey, int] = field(default_factory=dict)
    """Keys that requests this router sent to the replica use and that have not finished (``hold`` / ``release``)
    -> how many such requests: the replica cannot evict them, and on release they join its LRU queue at the tail."""


class PrefixIndex:
    """Page key -> mask of replicas holding it, and replica -> its keys, kept in step by the sync protocol above.

    Each tracked replica owns one bit of an int mask (freed when it leaves), so a key's holders cost one dict entry
    and no container (nothing for the garbage collector to walk). Not thread-safe; the router calls it from one event
    loop. Updates cost O(keys touched); ``longest_prefix`` costs O(leading pages matched).
    """

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._replica_id_to_state: dict[str, _ReplicaState] = {}
        self._bit_to_replica_id: dict[int, str] = {}
        self._key_to_holder_mask: dict[PageKey, int] = {}

    # ---- membership ------------------------------------------------------------------------------------------------
    def add_replica(self, replica_id: str) -> None:
        """Start tracking ``replica_id`` (no keys, needs a snapshot). No-op if already tracked."""
        self._state_of(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """Forget ``replica_id`` and every key it held. No-op if unknown."""
        state = self._replica_id_to_state.pop(replica_id, None)
        if state is not None:
            self._drop_keys(state, list(state.keys))
            del self._bit_to_replica_id[state.bit]

    def replica_ids(self) -> list[str]:
        return sorted(self._replica_id_to_state)

    def needs_snapshot(self, replica_id: str) -> bool:
        """True when the index may be missing events of ``replica_id`` (unknown replicas count as needing one)."""
        state = self._replica_id_to_state.get(replica_id)
        return state is None or state.needs_snapshot

    def last_seq(self, replica_id: str) -> int | None:
        state = self._replica_id_to_state.get(replica_id)
        return None if state is None else state.last_seq

    def num_keys(self, replica_id: str) -> int:
        state = self._replica_id_to_state.get(replica_id)
        return 0 if state is None else len(state.keys)

    def holds(self, replica_id: str, key: PageKey) -> bool:
        state = self._replica_id_to_state.get(replica_id)
        return state is not None and bool(self._key_to_holder_mask.get(key, 0) & state.bit)

    # ---- queries ---------------------------------------------------------------------------------------------------
    def longest_prefix(
        self, page_keys: Sequence[PageKey], replica_ids: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Replica id -> number of leading ``page_keys`` it holds, for replicas holding at least the first one.

        ``replica_ids`` restricts the answer to those replicas (unknown ids are ignored).
        """
        if not page_keys:
            return {}
        alive = self._key_to_holder_mask.get(page_keys[0], 0)
        if replica_ids is not None:
            alive &= self._mask_of(replica_ids)
        replica_id_to_num_pages: dict[str, int] = {}
        num_pages = 1
        for key in page_keys[1:]:
            if not alive:
                break
            still = alive & self._key_to_holder_mask.get(key, 0)
            if still != alive:
                self._record(alive & ~still, num_pages, replica_id_to_num_pages)
            alive = still
            num_pages += 1
        self._record(alive, num_pages, replica_id_to_num_pages)
        return replica_id_to_num_pages

    def longest_prefix_any(self, page_keys: Sequence[PageKey], replica_ids: Iterable[str] | None = None) -> int:
        """Number of leading ``page_keys`` each held by at least one of ``replica_ids`` (all tracked: None); unlike
        ``longest_prefix``, different pages may have different holders (a shared tier written by several replicas)."""
        mask = self._mask_of(replica_ids) if replica_ids is not None else -1
        num_pages = 0
        holders = self._key_to_holder_mask
        for key in page_keys:
            if not holders.get(key, 0) & mask:
                break
            num_pages += 1
        return num_pages

    # ---- updates ---------------------------------------------------------------------------------------------------
    def sync(
        self,
        replica_id: str,
        *,
        epoch: str,
        events: Sequence[KVEvent] = (),
        snapshot: IndexSnapshot | None = None,
    ) -> SyncResult:
        """Apply one report of ``replica_id``: its epoch, its recent events (seq order), maybe a snapshot.

        Starts tracking the replica if needed. See the module docstring for the rules.
        """
        state = self._state_of(replica_id)
        reset_epoch = state.epoch != epoch
        if reset_epoch:
            self._reset(state)
            state.epoch = epoch
        applied, skipped, gaps = self._apply(state, events)
        applied_snapshot = False
        if snapshot is not None and (
            state.needs_snapshot
            or _is_newer(snapshot.seq, state.last_seq)
            or (state.guessed and not _is_newer(state.last_seq, snapshot.seq))
        ):
            self._replace_keys(state, snapshot)
            newer = [event for event in events if _is_newer(event.seq, snapshot.seq)]
            more_applied, _, more_gaps = self._apply(state, newer)
            applied += more_applied
            gaps += more_gaps
            applied_snapshot = True
        return SyncResult(applied, skipped, gaps, applied_snapshot, reset_epoch)

    def apply_events(self, replica_id: str, events: Sequence[KVEvent]) -> SyncResult:
        """Apply ``events`` of ``replica_id`` in order (starting to track it if needed), noting gaps."""
        applied, skipped, gaps = self._apply(self._state_of(replica_id), events)
        return SyncResult(applied, skipped, gaps)

    def apply_snapshot(self, replica_id: str, snapshot: IndexSnapshot) -> None:
        """Make the index hold exactly ``snapshot.keys`` for ``replica_id``, in sync as of ``snapshot.seq``."""
        self._replace_keys(self._state_of(replica_id), snapshot)

    # ---- residency ahead (module docstring) --------------------------------------------------------------------------
    def note_residency(self, replica_id: str, *, epoch: str | None = None, num_evictions: int | None = None,
                       num_lru_pages: int | None = None, retained: Sequence[RetainedPages] | None = None,
                       wall_now: float | None = None, alpha: float = 0.5) -> None:
        """Apply a replica's report: its cumulative ``num_evictions`` (the rate is the EWMA, by ``alpha``, of its growth
        between reports), the pages in its LRU queue, and the pages it holds under a retention (replacing the previous
        list; expiries in wall-clock seconds, converted to router time). None leaves a part unchanged. Apply it before
        the same report's events, so the pages they store count as touched at its eviction count. ``epoch``: the
        report's; a new one drops what was known first, as ``sync`` does."""
        state = self._state_of(replica_id)
        if epoch is not None and state.epoch != epoch:
            self._reset(state)
            state.epoch = epoch
        now = self.clock()
        if num_evictions is not None:
            if num_evictions < state.evictions:  # the replica restarted: its keys' counts mean nothing now
                state.eviction_rate = 0.0
                for key in state.keys:
                    state.keys[key] = num_evictions
            elif state.last_report_s is not None and now > state.last_report_s:
                rate = (num_evictions - state.evictions) / (now - state.last_report_s)
                state.eviction_rate += alpha * (rate - state.eviction_rate)
            state.evictions = num_evictions
            state.last_report_s = now
        if num_lru_pages is not None:
            state.lru_pages = max(num_lru_pages, 0)
        if retained is not None:
            offset = now - (time.time() if wall_now is None else wall_now)
            state.retained = {key: math.inf if group.expires_at is None else group.expires_at + offset
                              for group in retained for key in group.keys}

    def expected_resident(self, replica_id: str, page_keys: Sequence[PageKey], num_matched: int, wait_s: float = 0.0,
                          now: float | None = None) -> int:
        """How many of the ``num_matched`` leading ``page_keys`` the replica holds (per the index) are expected still
        there when a request is admitted in ``wait_s`` seconds: retained ones until their retention ends, the others
        while fewer than ``lru_pages`` pages have been evicted since their touch (the module docstring)."""
        state = self._replica_id_to_state.get(replica_id)
        if state is None or num_matched <= 0:
            return 0
        retained, held = state.retained, state.keys
        if state.lru_pages == math.inf and not retained:
            return num_matched
        wait_s = max(wait_s, 0.0)
        at = (self.clock() if now is None else now) + wait_s
        oldest_kept = state.evictions + state.eviction_rate * wait_s - state.lru_pages  # touched before: evicted
        in_use = state.in_use
        for position in range(num_matched):
            key = page_keys[position]
            if key in in_use:
                continue
            until = retained.get(key)
            if until is not None and until >= at:
                continue
            touched = held.get(key)
            if touched is None or touched < oldest_kept:
                return position
        return num_matched

    def hold(self, replica_id: str, page_keys: Sequence[PageKey]) -> None:
        """A request using ``page_keys`` was sent to ``replica_id``: the replica keeps them (out of its LRU queue)
        until the matching ``release``. Counted per request."""
        in_use = self._state_of(replica_id).in_use
        for key in page_keys:
            in_use[key] = in_use.get(key, 0) + 1

    def release(self, replica_id: str, page_keys: Sequence[PageKey]) -> None:
        """The request ``hold`` counted finished: each key it was the last user of joins the replica's LRU queue at
        the tail, so it counts as touched at the replica's eviction count now. Keys not held are ignored (a replica
        that restarted or left meanwhile)."""
        state = self._replica_id_to_state.get(replica_id)
        if state is None:
            return
        in_use, held, now = state.in_use, state.keys, state.evictions
        for key in page_keys:
            count = in_use.get(key)
            if count is None:
                continue
            if count > 1:
                in_use[key] = count - 1
                continue
            del in_use[key]
            touched = held.get(key)
            if touched is not None and touched < now:
                held[key] = now

    def num_in_use(self, replica_id: str) -> int:
        """Distinct keys held by unfinished requests on ``replica_id`` (``hold``)."""
        state = self._replica_id_to_state.get(replica_id)
        return 0 if state is None else len(state.in_use)

    def is_retained(self, replica_id: str, key: PageKey, at: float) -> bool:
        state = self._replica_id_to_state.get(replica_id)
        return state is not None and state.retained.get(key, -math.inf) >= at

    def eviction_rate(self, replica_id: str) -> float:
        state = self._replica_id_to_state.get(replica_id)
        return 0.0 if state is None else state.eviction_rate

    # ---- checks ----------------------------------------------------------------------------------------------------
    def expect_keys(self, replica_id: str, page_keys: Sequence[PageKey], wait_s: float = 0.0) -> None:
        """Optimistically mark ``page_keys`` as held by ``replica_id`` right after a request was routed there: its
        stored events arrive only after the prefill, and without this a second request with the same new prefix,
        routed meanwhile, would find no holder and could land elsewhere (computing the prefix twice). A wrong guess
        (the request failed, the pages were evicted) costs one cache miss and is corrected by the replica's next
        snapshot or removal event. ``wait_s``: when the request is expected to be admitted there; its pages count as
        touched then (at the eviction count projected for that moment), since the request will use them."""
        state = self._state_of(replica_id)
        held = state.keys
        now = state.evictions
        if wait_s > 0.0 and state.eviction_rate > 0.0:
            now = state.evictions + state.eviction_rate * wait_s
        new_keys = []
        for key in page_keys:
            if key in held:
                if held[key] < now:
                    held[key] = now  # the routed request will use it: LRU moves it to the tail
            else:
                new_keys.append(key)
        if new_keys:
            self._add_keys(state, new_keys, now)
            state.guessed = True

    def check_integrity(self) -> None:
        """Raise AssertionError unless the key sets and the holder masks mirror each other exactly."""
        assert {state.bit for state in self._replica_id_to_state.values()} == set(self._bit_to_replica_id)
        expected: dict[PageKey, int] = {}
        for replica_id, state in self._replica_id_to_state.items():
            assert self._bit_to_replica_id[state.bit] == replica_id
            for key in state.keys:
                expected[key] = expected.get(key, 0) | state.bit
        assert expected == self._key_to_holder_mask, "holder masks disagree with the replicas' key sets"

    # ---- internals -------------------------------------------------------------------------------------------------
    def _state_of(self, replica_id: str) -> _ReplicaState:
        state = self._replica_id_to_state.get(replica_id)
        if state is None:
            slot = 0
            while (1 << slot) in self._bit_to_replica_id:
                slot += 1
            state = _ReplicaState(bit=1 << slot)
            self._replica_id_to_state[replica_id] = state
            self._bit_to_replica_id[state.bit] = replica_id
        return state

    def _mask_of(self, replica_ids: Iterable[str]) -> int:
        mask = 0
        for replica_id in replica_ids:
            state = self._replica_id_to_state.get(replica_id)
            if state is not None:
                mask |= state.bit
        return mask

    def _record(self, mask: int, num_pages: int, replica_id_to_num_pages: dict[str, int]) -> None:
        while mask:
            bit = mask & -mask
            replica_id_to_num_pages[self._bit_to_replica_id[bit]] = num_pages
            mask ^= bit

    def _apply(self, state: _ReplicaState, events: Sequence[KVEvent]) -> tuple[int, int, int]:
        num_applied = num_skipped = num_gaps = 0
        for event in events:
            if state.last_seq is not None and event.seq <= state.last_seq:
                num_skipped += 1
                continue
            if state.last_seq is not None and event.seq > state.last_seq + 1:
                num_gaps += 1
                state.needs_snapshot = True
            self._apply_one(state, event)
            state.last_seq = event.seq
            num_applied += 1
        return num_applied, num_skipped, num_gaps

    def _apply_one(self, state: _ReplicaState, event: KVEvent) -> None:
        if isinstance(event, PagesStored):
            self._add_keys(state, event.keys)
        elif isinstance(event, PagesRemoved):
            self._drop_keys(state, event.keys)
        elif isinstance(event, AllPagesCleared):
            self._drop_keys(state, list(state.keys))
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def _replace_keys(self, state: _ReplicaState, snapshot: IndexSnapshot) -> None:
        wanted = set(snapshot.keys)
        self._drop_keys(state, [key for key in state.keys if key not in wanted])
        self._add_keys(state, [key for key in wanted if key not in state.keys])
        state.last_seq = snapshot.seq
        state.needs_snapshot = False
        state.guessed = False

    def _reset(self, state: _ReplicaState) -> None:
        self._drop_keys(state, list(state.keys))
        state.retained = {}
        state.in_use = {}
        state.evictions = 0
        state.lru_pages = math.inf
        state.eviction_rate = 0.0
        state.last_report_s = None
        state.last_seq = None
        state.needs_snapshot = True
        state.guessed = False

    def _add_keys(self, state: _ReplicaState, keys: Collection[PageKey], touched: float | None = None) -> None:
        holder_masks = self._key_to_holder_mask
        bit = state.bit
        held = state.keys
        if touched is None:
            touched = state.evictions  # one object shared by the batch
        for key in keys:
            holder_masks[key] = holder_masks.get(key, 0) | bit
            before = held.get(key)
            if before is None or before < touched:  # a touch expected later (a routed request) stands
                held[key] = touched

    def _drop_keys(self, state: _ReplicaState, keys: Collection[PageKey]) -> None:
        holder_masks = self._key_to_holder_mask
        keep = ~state.bit
        for key in keys:
            mask = holder_masks.get(key, 0) & keep
            if mask:
                holder_masks[key] = mask
            else:
                holder_masks.pop(key, None)
        held = state.keys
        for key in keys:
            held.pop(key, None)


def _is_newer(seq: int, than: int | None) -> bool:
    """``seq`` comes after ``than`` (None: nothing is known yet)."""
    return than is None or seq > than
