"""Prefix-aware routing policy: send a request where its prompt's pages already are, unless that replica is swamped.

Everything the policy decides is in this header; thresholds live in ``PolicyConfig``.

Inputs per request: its page keys (``EngineRequest.page_keys``) and the candidate replicas with their load.

    load(r)        = max(requests r reported running + waiting,      # from routing stats, up to one period old
                         requests this router routed to r that have not finished yet)   # covers bursts
    matched(r)     = leading request pages r holds                   # PrefixIndex.longest_prefix
    min_load       = min over candidates of load(r)
    overloaded(r)  = load(r) - min_load > balance_abs_threshold  and  load(r) > balance_rel_threshold * min_load

    1. eligible = candidates that are not overloaded (never empty: a least-loaded replica is never overloaded)
    2. chosen   = the eligible replica with the most matched pages; ties -> lower load -> fewer cached pages -> higher
                  tie score. When no eligible replica holds page 0 (a new prefix), fewer cached pages comes first: the
                  prefix must be computed anyway, so new prefixes are partitioned evenly over the replicas' caches
    3. holder   = the candidate, overloaded or not, with the most matched pages; same tie-breaks
    4. reason   = no_match       nobody holds page 0: chosen is the least-loaded replica
                  prefix_hit     chosen holds as many leading pages as anyone
                  balanced_away  holder holds more but is overloaded; ``peer_hint`` = holder when it holds at least
                                 ``min_peer_copy_pages`` more than chosen (and hints are enabled), so chosen can copy
                                 the pages from holder instead of recomputing them

    tie score(r) = blake2b(first page key + r) (rendezvous hashing): when loads and cache sizes tie, requests sharing
                   their first page pick the same replica in every router process; a request with no full page scores
                   on the replica id alone. Within one router a new prefix also sticks to the replica it was sent to
                   before that replica's stored events arrive: the index expects the routed keys there.

The thresholds follow sgl-router's cache-aware policy: both an absolute and a relative gap are needed before affinity
is given up, so a replica holding the prefix keeps it under moderate skew (recomputing a long prefix costs more than
waiting behind a few requests) but not under a pile-up. Free pages are carried but not scored: a replica short of pages
evicts its least recently used cached pages first and then queues requests, which shows up in ``load``.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from common.page_keys import PageKey
from router.index import PrefixIndex
from common.routing_stats import ReplicaLoad


class RoutingReason(str, enum.Enum):
    PREFIX_HIT = "prefix_hit"
    BALANCED_AWAY = "balanced_away"
    NO_MATCH = "no_match"


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of the rule in the module docstring."""

    balance_abs_threshold: int = 4
    """Load gap (requests) to the least-loaded replica that must be exceeded before affinity is given up."""
    balance_rel_threshold: float = 1.5
    """... and the load ratio to the least-loaded replica that must be exceeded as well."""
    min_peer_copy_pages: int = 1
    """Fewest extra pages the holder must have over the chosen replica for a ``peer_hint``."""
    enable_peer_hint: bool = True
    """False when cross-replica prefix copy is disabled (--no-enable-dp-cross-replica-prefix-copy)."""

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"balance_rel_threshold must be >= 1.0 (a ratio to the least-loaded replica), "
                f"got {self.balance_rel_threshold}"
            )
        if self.min_peer_copy_pages < 1:
            raise ValueError(f"min_peer_copy_pages must be >= 1, got {self.min_peer_copy_pages}")


@dataclass(frozen=True)
class RoutingDecision:
    replica_id: str
    matched_pages: int
    """Leading request pages the chosen replica holds, per the index."""
    peer_hint: str | None
    """A replica holding more leading pages than the chosen one (only for ``balanced_away``)."""
    reason: RoutingReason
    peer_matched_pages: int = 0
    """Leading request pages ``peer_hint`` holds (0 without a hint)."""


class _Scored(NamedTuple):
    replica_id: str
    matched: int
    load: int
    num_cached: int
    tie: int


class PrefixAwarePolicy:
    """The rule in the module docstring, plus this router's count of unfinished requests per replica.

    Plain Python, no Ray; not thread-safe (the router calls it from one event loop).
    """

    def __init__(self, index: PrefixIndex, config: PolicyConfig | None = None) -> None:
        self.index = index
        self.config = config or PolicyConfig()
        self._request_id_to_replica_id: dict[str, str] = {}
        self._replica_id_to_num_inflight: dict[str, int] = {}

    # ---- the decision ----------------------------------------------------------------------------------------------
    def choose(self, page_keys: Sequence[PageKey], candidates: Sequence[ReplicaLoad]) -> RoutingDecision:
        """Pick one of ``candidates`` for a request with ``page_keys``. Raises ValueError when there are none."""
        if not candidates:
            raise ValueError("no candidate replicas to route to")
        replica_id_to_matched = self.index.longest_prefix(page_keys, [c.replica_id for c in candidates])
        anchor = page_keys[0] if page_keys else b""
        scored = [
            _Scored(c.replica_id, replica_id_to_matched.get(c.replica_id, 0), self.effective_load(c),
                    self.index.num_keys(c.replica_id), tie_score(anchor, c.replica_id))
            for c in candidates
        ]
        min_load = min(s.load for s in scored)
        eligible = [s for s in scored if not self.is_overloaded(s.load, min_load)]
        if any(s.matched for s in eligible):
            chosen = max(eligible, key=_preference)
        else:
            # nobody eligible holds page 0: everyone must compute it, so place the new prefix where the fewest pages
            # are cached (keeps prefixes partitioned evenly), then by load
            chosen = max(eligible, key=_new_prefix_preference)
        holder = max(scored, key=_preference)
        decision = self._explain(chosen, holder)
        self.index.expect_keys(decision.replica_id, page_keys)
        return decision

    def hint_for_pinned(self, page_keys: Sequence[PageKey], target: str) -> str | None:
        """A request pinned to ``target`` (no choice to make): the replica holding more of its leading pages than the
        target, to copy them from, or None. The target is expected to hold the pages from now on, as after ``choose``."""
        replica_id_to_matched = self.index.longest_prefix(page_keys)
        holder = max(sorted(replica_id_to_matched), key=replica_id_to_matched.__getitem__, default=None)
        self.index.expect_keys(target, page_keys)
        if holder is None or replica_id_to_matched[holder] <= replica_id_to_matched.get(target, 0):
            return None
        return holder

    def is_overloaded(self, load: int, min_load: int) -> bool:
        return (
            load - min_load > self.config.balance_abs_threshold
            and load > self.config.balance_rel_threshold * min_load
        )

    def effective_load(self, candidate: ReplicaLoad) -> int:
        return max(candidate.num_requests, self.num_inflight(candidate.replica_id))

    # ---- in-flight accounting --------------------------------------------------------------------------------------
    def note_routed(self, request_id: str, replica_id: str) -> None:
        """Count ``request_id`` against ``replica_id`` until ``note_finished``. Routing it again moves it."""
        previous = self._request_id_to_replica_id.get(request_id)
        if previous == replica_id:
            return
        if previous is not None:
            self._decrement(previous)
        self._request_id_to_replica_id[request_id] = replica_id
        self._replica_id_to_num_inflight[replica_id] = self._replica_id_to_num_inflight.get(replica_id, 0) + 1

    def note_finished(self, request_id: str, replica_id: str | None = None) -> None:
        """Stop counting ``request_id`` (if counted, and against ``replica_id`` when given). Idempotent."""
        counted_on = self._request_id_to_replica_id.get(request_id)
        if counted_on is None or (replica_id is not None and counted_on != replica_id):
            return
        del self._request_id_to_replica_id[request_id]
        self._decrement(counted_on)

    def num_inflight(self, replica_id: str) -> int:
        return self._replica_id_to_num_inflight.get(replica_id, 0)

    def forget_replica(self, replica_id: str) -> None:
        """Drop the in-flight count of a replica that left (its index entries are the index's business)."""
        self._replica_id_to_num_inflight.pop(replica_id, None)
        for request_id in [r for r, owner in self._request_id_to_replica_id.items() if owner == replica_id]:
            del self._request_id_to_replica_id[request_id]

    # ---- internals -------------------------------------------------------------------------------------------------
    def _explain(self, chosen: _Scored, holder: _Scored) -> RoutingDecision:
        if holder.matched == 0:
            return RoutingDecision(chosen.replica_id, 0, None, RoutingReason.NO_MATCH)
        if chosen.matched >= holder.matched:
            return RoutingDecision(chosen.replica_id, chosen.matched, None, RoutingReason.PREFIX_HIT)
        wants_hint = (
            self.config.enable_peer_hint and holder.matched - chosen.matched >= self.config.min_peer_copy_pages
        )
        return RoutingDecision(
            chosen.replica_id,
            chosen.matched,
            holder.replica_id if wants_hint else None,
            RoutingReason.BALANCED_AWAY,
            holder.matched if wants_hint else 0,
        )

    def _decrement(self, replica_id: str) -> None:
        num_inflight = self._replica_id_to_num_inflight.get(replica_id, 0) - 1
        if num_inflight > 0:
            self._replica_id_to_num_inflight[replica_id] = num_inflight
        else:
            self._replica_id_to_num_inflight.pop(replica_id, None)


def tie_score(anchor: PageKey, replica_id: str) -> int:
    """Rendezvous score of ``replica_id`` for requests whose first page key is ``anchor`` (same in every process)."""
    digest = hashlib.blake2b(anchor + replica_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _new_prefix_preference(scored: _Scored) -> tuple[int, int, int]:
    """For a prefix no eligible replica holds: fewer cached pages, then lower load, then higher tie score."""
    return (-scored.num_cached, -scored.load, scored.tie)


def _preference(scored: _Scored) -> tuple[int, int, int, int]:
    """Larger is better: more matched pages, then lower load, then fewer cached pages, then higher tie score."""
    return (scored.matched, -scored.load, -scored.num_cached, scored.tie)
