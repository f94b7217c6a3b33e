"""Prefix-aware routing policy: send a request where its time to first token is least, within a load-balance bound.

Everything the policy decides is in this header; thresholds and per-unit costs live in ``PolicyConfig``.

Inputs per request: its page keys (``EngineRequest.page_keys``), optionally its prompt length in tokens and its
partial page keys (``PartialKey``: what identifies the tokens after a full page, e.g. ``token_partial_key`` of its
prompt's token ids), and the candidate replicas with their load.

    load(r)        = max(requests r reported running + waiting,      # from routing stats, up to one period old
                         requests this router routed to r that have not finished yet)   # covers bursts
    matched(r)     = leading request pages r holds                   # PrefixIndex.longest_prefix
                     with the cost model, + 1 where r finished, less than ``answer_report_s`` ago, a request whose
                     prompt's full pages end at page matched(r) of this one, and no candidate is known to hold more:
                     the page that prompt's tail and its answer filled is stored when it ends and reported with the
                     next routing stats (a chat's next turn sent within one stats period of the answer would
                     otherwise tie with every replica holding the system prompt); where both requests came with
                     partial keys, only if this one continues that prompt's tail (the tokens after its last full
                     page): two chats on one system prompt whose turns ended at the same page on two replicas are
                     told apart by their tails, not by load
    holder         = the candidate, overloaded or not, with the most matched pages (ties: lower load, fewer cached
                     pages, higher tie score)
    min_load       = min over candidates of load(r)
    overloaded(r)  = load(r) - min_load > balance_abs_threshold  and  load(r) > balance_rel_threshold * min_load
    eligible       = candidates that are not overloaded (never empty: a least-loaded replica is never overloaded);
                     with the cost model, an overloaded holder is eligible too when every other eligible replica would
                     evict cached pages to take the request (``enable_overload_exception``: in a cluster whose caches
                     are full, moving a request copies its prefix over another prefix that is then recomputed whole)

The cost model (``enable_cost_model``, on by default) estimates each eligible replica's time to first token:

    copied(r)      = matched(holder) - matched(r)   when peer hints are on and that is >= min_peer_copy_pages, else 0
    ready          = when the holder is expected to have computed those pages (pages this router sent to a replica
                     are expected done at its busy_until after that request, the time left counted 1.5x; now if the
                     holder already reported them)
    wait(r)        = max(0, busy_until(r) - now)     # prefill work this router already sent to r, as a fluid queue
                     (and at least until r's own matched pages are expected there, for pages r is still to copy)
                     if ready > wait(r) (the holder is still computing the pages when r would start), r either
                     computes them (copied(r) = 0) or, when ready - wait(r) <= holder_wait_s, waits for the holder
                     and copies them (wait(r) = ready: the holder's export waits that long for pages it is computing);
                     the estimate takes whichever has the lesser ttft + duplicate_work_weight * work
    fetched(r)     = pages after matched(r) + copied(r) that the shared tiers hold (host, then disk: the replica's
                     fetch order), from the tiers' entries of the routing stats (``tier_index``, below)
    computed(r)    = prompt tokens - (matched(r) + copied(r) + fetched(r)) * page_size   (at least 1: logits need one)
    work(r)        = copied(r) * peer_copy_page_ms + fetched host pages * host_page_ms + fetched disk pages *
                     disk_page_ms + computed * prefill_token_ms
                     + attention_pair_us/1000 * computed * (reused tokens + computed / 2)
    ttft(r)        = wait(r) + work(r) + ceil(computed / max_num_batched_tokens) * (step_ms + load(r) * decode_row_ms)
                                                     # engine steps, each slowed by r's running requests' decode rows
    evict(r)       = eviction_weight * max(0, prompt pages - matched(r) - empty(r)) * work(no page reused) / prompt
                     pages, empty(r) = max(0, pages free - pages cached): the cached pages r would push out (a replica
                     whose cache is full of other prefixes), each priced as recomputing an average page of this prompt

    1. new prefix (no candidate holds page 0): the eligible replica with the least ttft + evict; ties -> fewest
       cached pages -> higher tie score (the prefix must be computed anyway: among equally fast replicas new prefixes
       are partitioned evenly over the caches; a full cache costs its evictions)
    2. otherwise: the eligible replica with the least
           ttft(r) + duplicate_work_weight * (work(r) - least work over the eligible) + evict(r)
       i.e. time to first token, plus the work r spends beyond the least any eligible replica needs (recomputing pages
       a peer holds delays r's later requests; a cheap copy costs little), plus the cache it would overwrite;
       ties -> more matched pages -> lower load -> fewer cached pages -> higher tie score
    3. busy_until(chosen) = max(busy_until, now) + its estimated busy time (work and steps)

Without the cost model (``enable_cost_model=False``: pure affinity with fallback) step 2 is: the eligible replica
with the most matched pages (same ties).

    reason = no_match       nobody holds page 0
             prefix_hit     chosen holds as many leading pages as anyone
             balanced_away  the holder holds more but is overloaded
             cost_away      the holder holds more and is eligible, but waiting for it costs more than copying the
                            pages (or computing them) on the chosen, less busy replica
             session_move   a chat's turn leaves a home its chats have outgrown ("Sessions" below)
    peer_hint = holder for balanced_away / cost_away / session_move when it holds at least ``min_peer_copy_pages``
                more than chosen (and hints are enabled), so chosen copies the pages from holder instead of
                recomputing them; with the cost model only when chosen's estimate copies (a replica given a hint
                waits, bounded, for pages the holder is still computing: useless when the estimate chose to compute
                them)

    tie score(r) = mix(blake2b(first page key) ^ blake2b(r)) (rendezvous hashing): when loads and cache sizes tie,
                   requests sharing their first page pick the same replica in every router process; a request with no
                   full page scores on the replica id alone. Within one router a new prefix also sticks to the replica
                   it was sent to before that replica's stored events arrive: the index expects the routed keys there.

Measured costs. ``step_ms``, ``prefill_token_ms``, ``attention_pair_us``, ``decode_row_ms`` and ``peer_copy_page_ms``
are taken per candidate from what that replica measured and sent in its routing stats (``ReplicaLoad.costs``,
replica/cost_meter.py); the ``PolicyConfig`` values are the defaults for a replica that sent none (or not that one).
A candidate that measured its host-tier fetch (``host_page_ms``, so it has a shared tier that keeps reused pages)
prices an evicted page at the least of recomputing it and fetching it back.

Shared tiers (``enable_tier_routing``, off by default: see its docstring). Replicas report the pages they stored in
the host (Redis) and disk tiers that the tiers still hold (routing stats ``tiers``, replica/event_log.py ``TierEventRelay``); ``tier_index`` holds them
under pseudo-holders ``<replica>@CPU`` / ``<replica>@DISK``, never candidates. The leading run of request pages held
by any host holder (then by any disk holder) is what every replica can fetch instead of computing: a prefix evicted
from every replica but kept in Redis is priced as a fetch, so the router moves it to a less loaded replica as readily
as a peer copy (the holder's matched pages, when it has more, still come first). Each candidate's own measured
``host_page_ms`` / ``disk_page_ms`` price the pages; the config's are the defaults.

Sessions (cost model and ``session_growth`` > 0). A request continues a session when its prompt holds the last full
page of a request routed less than ``session_window_s`` ago and that request's tail (the tokens after that page, told
by partial keys; a prompt that ended at the page's end has none, and every prompt holding the page continues it): a
chat's next turn. The session's home is the replica that request went to (where Serve sent it, when that was not the
policy's choice). Requests without partial keys start no session (their continuations could not be told apart). A
retry of a request (Serve asking again after its replicas refused it; ``choose``'s ``request_id``) continues nothing
new: it goes by the session its first choice continued, not the one its first choice recorded.

    sessions(r)    = sessions homed on r that have been continued at least once (chats), plus p times those not
                     continued yet, p the recent rate at which a session's first request is continued before its
                     window ends (a moving average, 1 at start): one-off requests do not count as chats where
                     they are seldom continued; each session ends session_window_s after its latest request
    tight(r)       = pages(r) / (sessions(r) + 1) < session_growth * the mean pages of those sessions' latest prompts
                     (weighted alike),
                     pages(r) the replica's page count: the chats there, one more, and their expected growth would
                     not fit its cache
    a continuing request may go to a replica r, when tight(r) and r is neither its home nor a holder of the most
    leading pages, only if sessions(r) < sessions(home) - 1: the move evens the chats out. The other candidates stay
    (all of them when that would leave none).
    a continuing request whose home is the holder (the replica with the most leading pages that others would copy
    from) keeps the home a candidate when tight(home), however busy the home is (an addition to the overload
    exception, ``enable_overload_exception``, which does so in a full cluster): the estimate, not the load bound,
    decides whether the chat moves
    a request that starts a session (continues none) goes to a holder of the most leading pages, when they are at
    least half its prompt's pages, and tight'(h) and sessions(h) < the candidates' mean sessions + 1 for h, the
    eligible holder with the fewest sessions (tight' judged with session_start_growth in place of session_growth: a
    chat starting now grows more than the sessions' mean): its only candidates are then the eligible holders with at
    most sessions(h) + 2 sessions (all of eligible when none is). The cap and the slack keep a popular system prompt's
    chats from collecting on one of its holders
    demand(r)      = the pages of the latest prompts of the sessions homed on r (weighted as in sessions(r); a
                     system prompt that several of them share counts once per session: an upper bound)
    idle           a session whose latest request finished more than max(session_idle_factor x q99, 1 s) ago,
                     q99 the 99th percentile of the latest 256 gaps between a session's request finishing and its
                     next turn being routed (none is idle before 16 gaps were seen; recomputed every 16 gaps, and at
                     once when an idle session goes on after all), counts in neither sessions(r) nor demand(r) (nor
                     the mean session length) until its next turn, which still continues it: a chat that ended no
                     longer holds a place on its replica for the rest of its window
    a continuing request whose home holds the most leading pages and whose chats have outgrown it, demand(home) >
    session_move_fill * pages(home) (within the load bound or not), goes to an eligible replica r other than the
    home where the chats there and its own pages would fit, demand(r) + its pages <= session_move_fill * pages(r),
    when there is one; the home is then no candidate (neither exception adds it back). A replica that has not
    reported its page count is neither. A retry of such a request is judged again from the books as its first
    choice left them

Why: the cost model moves a chat's turn to a less busy replica (copying its history) for this turn's TTFT, and the chat
then lives there. Where caches have room that is free; where chats outgrow them, moves leave some replicas with more
chats than others, and those replicas recompute their chats' histories over and over (tight multi-turn in the
simulator: BENCHMARKS.md 0s). The same holds for the two ways a chat still moved (session 29, BENCHMARKS.md 0u): a
new chat whose system prompt one replica holds was copied to a less busy one, so chats sharing a system prompt were
spread and each replica stored it again; and a chat whose home had more requests in flight than the load bound allows
was moved however tight the caches, and the move rippled on as sessions were evened out. A request holding less than
half its prompt on its holder (a chat whose window lapsed and whose history its home evicted) is left to the estimate:
moving it copies little. Keeping chats home has a cost of its own (session 32, BENCHMARKS.md 0x): chats end at
different times, and a home whose chats all run long ends up with more than its cache holds while replicas whose chats
ended sit empty. Its chats then evict each other's histories turn after turn (the last turns of a simulated run kept
20-47% of their prompts) and queue behind each other's recomputes; the estimate sees the history still on the home when
the turn is routed and keeps it there. Moving one chat to a replica where it fits copies its history once and ends
that. All of these rules compare counts of chats, and a chat that ended is known only by the absence of its next turn
(session 33, BENCHMARKS.md 0y): counted for its whole window (30 s, against turns that come seconds after their
answers), chats that had ended held places on their replicas, so a replica whose chats were over still looked full
to a new or moving chat, and a home looked outgrown by chats that were gone. An idle session leaves the counts at a
multiple of the gaps actually seen, and comes back with its next turn if it was not over.

Residency ahead (cost model and ``enable_residency_aging``, off by default). ``matched(r)`` counts only the leading pages expected still on r when the request
is admitted there (now + wait(r)): pages r holds under a retention until it ends, pages of requests this router sent
to r until they finish (``note_routed`` with the request's keys; a running request's pages cannot be evicted), other
pages while fewer than r's LRU queue length have been evicted there since their last touch (a routed request's
admission, or the release by the last request using them), counting r's evictions until the admission at its
recent rate (router/index.py ``expected_resident``). So a prefix held under a
retention stays a prefix hit on its replica however fast that replica churns, while an unretained one on a churning,
busy replica counts as (partly) gone.

The load bound follows sgl-router's cache-aware policy: both an absolute and a relative gap are needed before a
replica is excluded. The per-unit costs default to the engine's measured numbers (BENCHMARKS.md sections 0-2 and 6,
tiny Llama on one CPU core, float32); set them from the deployment's own measurements. Free pages enter only through
``evict`` (pages free as reported, less the pages the index says are cached there). benchmarks/router_sim compares the
rule with the published ones at DP 4-64.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Sequence

import msgpack

from common.page_keys import PageKey
from router.index import PrefixIndex
from common.events import MEDIUM_DISK, MEDIUM_HOST
from common.routing_stats import EXPORT_WAIT_S, ReplicaLoad, tier_holder_id

HOST_HOLDER_SUFFIX = tier_holder_id("", MEDIUM_HOST)
DISK_HOLDER_SUFFIX = tier_holder_id("", MEDIUM_DISK)
"""How ``tier_index``'s pseudo-holders (``tier_holder_id``) of the host and disk tiers end."""

_READY_MARGIN = 1.5
"""The fluid queue underestimates (decodes of other routers' requests): pages expected at t are counted at 1.5 t."""

_SESSION_RATE_WEIGHT = 0.05
"""Weight of each outcome (a session's first request continued or not) in ``session_continue_rate``."""

_SESSION_GAP_QUANTILE = 0.99
"""The quantile of the recent gaps between a session's request finishing and its next turn that ``session_idle_factor``
multiplies (module docstring, "Sessions"). The 95th percentile took 26 chats of a real multi-round-qa run for ended,
19 of which went on (its turns wait for the client's 4 slots: most gaps are near 0); the 99th and the maximum simulate
as well (BENCHMARKS.md 0y)."""

_SESSION_GAPS_KEPT = 256
"""How many of the latest such gaps the quantile is taken over."""

_SESSION_MIN_GAPS = 16
"""No session is idle before this many gaps were seen (the quantile would be a guess); the idle time is recomputed
each time this many more were seen."""

_SESSION_MIN_IDLE_S = 1.0
"""The idle time is at least this long (where turns follow their answers at once, the quantile is 0)."""

_HOLDER_SESSION_SLACK = 2
"""A new chat kept with its prefix's holders goes to those with at most this many sessions more than the one with the
fewest (module docstring, "Sessions"). Simulated tight multi-turn, mean p99 (BENCHMARKS.md 0u): every holder 6.06 s at
DP 16 (32 seeds) and 6.66 s at DP 64 (16 seeds); slack 1 5.70 / 6.93 s; slack 2 5.88 / 6.54 s."""


PartialKey = Callable[[int, int], "bytes | None"]
"""A request's partial page keys: ``(num_pages, num_tokens)`` -> the key of the ``num_tokens`` prompt tokens after its
first ``num_pages`` full pages, chained to the key of the last of those pages (``num_pages`` >= 1), or None when the
prompt has no such tokens. Equal keys mean equal tokens after equal prefixes, as with page keys. The policy uses them to
tell which finished request a new one continues (module docstring, ``matched``): a replica finished prompt P, whose
tail (tokens after its last full page) is T; request Q continues P there when Q's partial key over ``len(T)`` tokens
after P's last full page equals P's over T. ``token_partial_key`` makes one from token ids; the simulator derives one
from its segments."""


class PromptTail(NamedTuple):
    """The tokens of a prompt after its last full page, as a partial key (``PartialKey``) and their number."""

    num_tokens: int
    key: bytes


class RoutingReason(str, enum.Enum):
    PREFIX_HIT = "prefix_hit"
    BALANCED_AWAY = "balanced_away"
    COST_AWAY = "cost_away"
    NO_MATCH = "no_match"
    SESSION_MOVE = "session_move"
    """A chat's turn sent away from a home its chats have outgrown (module docstring, "Sessions")."""


PLAIN_LRU_EVICTION_WEIGHT = 1.0
"""``PolicyConfig.eviction_weight`` when the replicas evict by plain LRU: a request then pushes out shared prefixes
as readily as pages nobody reused."""


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds and per-unit costs of the rule in the module docstring."""

    balance_abs_threshold: int = 3
    """Load gap (requests) to the least-loaded replica that must be exceeded before a replica is excluded. 3, not
    SGLang's wide gap: in the simulator 4 let chats pile up (multi-turn at DP 64: busiest/mean 1.33, 1.17 with 3),
    and 3 changes no hit rate by more than 0.001 nor p99 by more than 4% (BENCHMARKS.md 0f); 8 or 16 made zipf at DP
    64 worse (section 8)."""
    balance_rel_threshold: float = 1.5
    """... and the load ratio to the least-loaded replica that must be exceeded as well."""
    min_peer_copy_pages: int = 1
    """Fewest extra pages the holder must have over the chosen replica for a ``peer_hint``."""
    enable_peer_hint: bool = True
    """False when cross-replica prefix copy is disabled (--no-enable-dp-cross-replica-prefix-copy)."""
    enable_cost_model: bool = True
    """False: pure affinity with fallback (most matched pages among the eligible replicas)."""
    page_size: int = 128
    """Tokens per page (to turn matched pages into tokens not computed)."""
    step_ms: float = 16.0
    """Fixed cost of one engine step."""
    prefill_token_ms: float = 0.417
    """Cost per prompt token computed (weights part)."""
    attention_pair_us: float = 0.35
    """Cost per (computed token x context token) pair of prefill attention, in microseconds."""
    decode_row_ms: float = 6.0
    """Cost a running request adds to every engine step (its decode row)."""
    peer_copy_page_ms: float = 3.5
    """Cost of copying one page from a peer replica, on the receiver's critical path."""
    host_page_ms: float = 4.0
    """Cost of fetching one page from the host tier (Redis), for a replica that measured none (a 2 MiB float32 page
    of the tiny Llama: 63 ms per 16 pages, BENCHMARKS.md section 0b)."""
    disk_page_ms: float = 2.0
    """Cost of fetching one page from the disk tier, for a replica that measured none (24 ms per 16 such pages)."""
    enable_tier_routing: bool = False
    """Price the pages the shared tiers hold (``tier_index``) as fetches instead of recomputation. Off by default:
    simulated with replica pools too small for the prefixes and a shared host tier (BENCHMARKS.md section 0b), it
    raised llm-d shared prefix's p99 TTFT by 5% at DP 4 and 14% at DP 16 (prefixes spread over more replicas, whose
    small pools then churn), and changed nothing on the other workloads."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill is chunked to it)."""
    eviction_weight: float = 0.5
    """Weight of the cached pages a candidate would evict (pages beyond its empty ones), each priced as the mean cost
    per page of recomputing this prompt. 0.5 since the replicas' segmented LRU (replica/page_pool.py): the pages a
    request pushes out are mostly pages no request reused (a finished request's own question and answer), worth less
    than a page of a shared prefix (1.0 had been chosen under plain LRU; BENCHMARKS.md 0r).
    ``PLAIN_LRU_EVICTION_WEIGHT`` is the weight for replicas on plain LRU (``--kv-cache-protected-fraction 0``)."""
    enable_overload_exception: bool = True
    """Keep an overloaded holder as a candidate when every eligible replica would evict cached pages to take over."""
    enable_residency_aging: bool = False
    """Count only the pages expected still on a replica at admission (router/index.py ``expected_resident``):
    retained pages until their TTL, pages of requests this router sent there until they finish, others by the
    replica's LRU eviction count since their last touch (a routed request's admission, or its release). Off by
    default: in the simulator it ties with aging off on 20 of 24 points and moves llm-d shared prefix at DP 4 both
    ways (p99 24.5 -> 14.8 s, 14.8 -> 14.9 s, 12.5 -> 14.1 s, 38.1 -> 46.4 s), with 0.3-0.8 % fewer cached tokens
    there (BENCHMARKS.md section 0a). Before running requests held their pages (session 9) it raised that p99 18x."""
    holder_wait_s: float = EXPORT_WAIT_S
    """How long a holder waits for pages it is computing before it answers a peer's copy (``EXPORT_WAIT_S``): a
    candidate that would start before the holder is done may still copy the pages once they are, so its estimate is
    the lesser of computing them and waiting for the holder, then copying (0: only pages expected done when the
    candidate starts are priced as copies)."""
    answer_report_s: float = 0.55
    """How long after a replica finished a request its answer pages may still be missing from the index: they are
    stored when the request ends and reported with the next routing stats (every 0.5 s, up to 1.1x with the jitter).
    Within it, a request that continues the finished one's prompt expects one more page there (module docstring,
    ``matched``); longer, it would guess at replicas whose reports are already in."""
    duplicate_work_weight: float = 1.0
    """Weight of the copy and compute work a candidate needs beyond the least any eligible replica needs (work that
    delays the replica's later requests and, for recomputed pages, stores a second copy)."""
    session_growth: float = 4.0
    """A replica is tight for sessions (module docstring, "Sessions") when its pages per session, one more counted,
    are fewer than this many times a session's mean length; a continuing request then moves to it only to even the
    sessions out. 0: off. 4 in the simulator's tight multi-turn (DP 4 / 16, 32 seeds): 3-8 gave the same within 0.002
    hit rate, 2 less (BENCHMARKS.md 0s)."""
    session_window_s: float = 30.0
    """How long after its last request a session is remembered (a chat's think time and answer fit within it): its
    next turn within the window continues it. It counts on its home until then, or until it is idle
    (``session_idle_factor``)."""
    session_start_growth: float = 8.0
    """The growth factor by which a request starting a session judges its holder tight (module docstring,
    "Sessions"): when the holder is, the request stays with the holders of its leading pages. 0: off. 8 (twice
    ``session_growth``) in the simulator's tight multi-turn: 6 lost p99 at DP 16, 12 was the same
    (BENCHMARKS.md 0u)."""
    session_move_fill: float = 1.0
    """A chat leaves a home whose sessions' pages exceed this fraction of its page count, for a replica where they
    and the chat fit within the same fraction (module docstring, "Sessions"; with the cost model and
    ``session_growth`` > 0 only). 0: off. Simulated tight multi-turn (32 seeds): 1, 1.1 and 1.2 gave p99 7.02 / 6.91
    / 6.93 s at DP 4 and 4.52 / 4.63 / 4.46 s at DP 16; 0.8 and 0.9 0.3-0.7 s more (BENCHMARKS.md 0x)."""
    session_idle_factor: float = 1.5
    """A session whose latest request finished longer ago than this many times the 99th percentile of the recent gaps
    between a session's request finishing and its next turn being routed (and at least 1 s ago) is idle: it counts in
    neither sessions(r) nor demand(r) until its next turn (module docstring, "Sessions"). 0: off (a session counts
    until its window ends). Simulated tight multi-turn and a real run: BENCHMARKS.md 0y."""

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
        if self.page_size < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"page_size and max_num_batched_tokens must be >= 1, got {self.page_size}, "
                f"{self.max_num_batched_tokens}"
            )
        for name in ("step_ms", "prefill_token_ms", "attention_pair_us", "decode_row_ms", "peer_copy_page_ms",
                     "host_page_ms", "disk_page_ms", "duplicate_work_weight", "eviction_weight", "holder_wait_s",
                     "answer_report_s", "session_growth", "session_window_s", "session_start_growth",
                     "session_move_fill", "session_idle_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (a measured cost), got {getattr(self, name)}")
        for name in ("session_growth", "session_window_s", "session_start_growth", "session_move_fill",
                     "session_idle_factor"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")


def eviction_weight_for(protected_fraction: float) -> float:
    """``PolicyConfig.eviction_weight`` for replicas with this ``--kv-cache-protected-fraction``: the default for their
    segmented LRU, ``PLAIN_LRU_EVICTION_WEIGHT`` at 0 (plain LRU)."""
    return PolicyConfig.eviction_weight if protected_fraction else PLAIN_LRU_EVICTION_WEIGHT


@dataclass(frozen=True)
class RoutingDecision:
    replica_id: str
    matched_pages: int
    """Leading request pages the chosen replica holds, per the index."""
    peer_hint: str | None
    """A replica holding more leading pages than the chosen one (only for ``balanced_away`` / ``cost_away`` /
    ``session_move``)."""
    reason: RoutingReason
    peer_matched_pages: int = 0
    """Leading request pages ``peer_hint`` holds (0 without a hint)."""
    estimated_ttft_ms: float = field(default=0.0, compare=False)
    """The cost model's estimate for the chosen replica (0.0 without the cost model)."""


class _Costs(NamedTuple):
    """The per-unit costs of one candidate: its measured ones where it sent them, else the config's."""

    step_ms: float
    prefill_token_ms: float
    attention_pair_us: float
    decode_row_ms: float
    peer_copy_page_ms: float
    host_page_ms: float | None
    """Measured only (None: not measured; the eviction term then prices an evicted page as recomputed)."""
    host_fetch_ms: float
    """Per page fetched from the host tier: measured, else the config's."""
    disk_fetch_ms: float


class _Session(NamedTuple):
    """An active session (module docstring, "Sessions"): where its latest request went, when, that request's full
    prompt pages, last page key and tail, and whether it was continued (a chat: counted in ``sessions(r)``); that
    request's id (when ``choose`` was told it) and the session it continued, for a retry of it; when that request
    finished (None: not yet), and whether the session is idle (then it is in no per-replica book)."""

    replica_id: str
    routed_s: float
    num_pages: int
    key: PageKey
    tail: PromptTail | None
    counted: bool
    request_id: str | None = None
    continues: "_Session | None" = None
    finished_s: float | None = None
    idle: bool = False


class _Scored(NamedTuple):
    replica_id: str
    matched: int
    load: int
    num_cached: int
    load_report: ReplicaLoad


class PrefixAwarePolicy:
    """The rule in the module docstring, plus this router's count of unfinished requests per replica and its fluid
    estimate of the prefill work queued on each replica.

    Plain Python, no Ray; not thread-safe (the router calls it from one event loop).
    """

    def __init__(self, index: PrefixIndex, config: PolicyConfig | None = None) -> None:
        self.index = index
        self.config = config or PolicyConfig()
        self._request_id_to_replica_id: dict[str, str] = {}
        self._replica_id_to_num_inflight: dict[str, int] = {}
        self._replica_id_to_busy_until: dict[str, float] = {}
        self._key_to_ready_s: dict[tuple[str, PageKey], float] = {}
        """Pages this router sent to be computed, by replica: when they are expected to be done."""
        self._ready_order: deque[tuple[float, str, PageKey]] = deque()
        self.num_decisions_by_reason: dict[RoutingReason, int] = {reason: 0 for reason in RoutingReason}
        """Decisions made so far, by reason (for metrics; ``choose`` counts, ``hint_for_pinned`` does not)."""
        self.num_decisions_by_replica_reason: dict[tuple[str, RoutingReason], int] = {}
        """The same, by (chosen replica, reason)."""
        self._default_costs = _Costs(self.config.step_ms, self.config.prefill_token_ms, self.config.attention_pair_us,
                                     self.config.decode_row_ms, self.config.peer_copy_page_ms, None,
                                     self.config.host_page_ms, self.config.disk_page_ms)
        self.tier_index = PrefixIndex()
        """The shared tiers' pages by pseudo-holder ``<replica>@<medium>`` (module docstring); the router feeds it."""
        self._measured_to_costs: dict[int, tuple[object, _Costs]] = {}
        self._holds_keys = self.config.enable_cost_model and self.config.enable_residency_aging
        self._request_id_to_keys: dict[str, Sequence[PageKey]] = {}
        """With residency aging: the page keys of each counted request, held in use on its replica (``note_routed``)."""
        self._request_id_to_last_key: dict[str, PageKey] = {}
        """The last full prompt page of each counted request (``note_routed``)."""
        self._request_id_to_tail: dict[str, PromptTail] = {}
        """The prompt tail of each counted request that came with partial keys (``note_routed``)."""
        self._answered: dict[tuple[str, PageKey], dict[PromptTail | None, float]] = {}
        """(replica, last full prompt page of a request it finished) -> that request's prompt tail (None: not known)
        -> when it finished, for ``answer_report_s``; an entry goes when its latest finish is that old."""
        self._answered_order: deque[tuple[float, str, PageKey, PromptTail | None]] = deque()
        self._sessions: dict[PageKey, dict[PromptTail | None, _Session]] = {}
        """Active sessions by the last full page and tail of their latest request (module docstring, "Sessions")."""
        self._session_tail_lengths: dict[PageKey, dict[int, int]] = {}
        """Per page in ``_sessions``: how many of its sessions' tails have each length (a request's partial key is
        computed once per length, however many sessions end at the page)."""
        self._session_order: deque[tuple[float, PageKey, PromptTail | None]] = deque()
        self._replica_id_to_num_sessions: dict[str, int] = {}
        """Continued sessions by home."""
        self._replica_id_to_num_new_sessions: dict[str, int] = {}
        """Sessions not continued yet (one request so far) by home."""
        self._replica_id_to_session_pages: dict[str, int] = {}
        """The latest prompts' full pages of the continued sessions, by home."""
        self._replica_id_to_new_session_pages: dict[str, int] = {}
        """The same for the sessions not continued yet."""
        self.session_continue_rate = 1.0
        """The moving average of whether a session's first request was continued before its window ended."""
        self._session_gaps: deque[float] = deque(maxlen=_SESSION_GAPS_KEPT)
        """The latest gaps between a session's request finishing and its next turn being routed (seconds)."""
        self._num_gaps_seen = 0
        self._num_gaps_at_idle = 0
        self._session_idle_s = math.inf
        self._finished_order: deque[tuple[float, PageKey, PromptTail | None]] = deque()
        """(finish, last page, tail) of sessions' latest requests, in finishing order: when each may turn idle."""
        self.session_events: dict[tuple[str, str], int] = {}
        """Sessions that turned idle and idle sessions that were continued ("resumed"), by (home, event), since the
        last ``drain_session_events``. Many resumed against idle: the idle time is too short for these chats."""

    # ---- the decision ----------------------------------------------------------------------------------------------
    def choose(
        self,
        page_keys: Sequence[PageKey],
        candidates: Sequence[ReplicaLoad],
        *,
        num_prompt_tokens: int | None = None,
        now: float | None = None,
        partial_key: PartialKey | None = None,
        request_id: str | None = None,
    ) -> RoutingDecision:
        """Pick one of ``candidates`` for a request with ``page_keys``. Raises ValueError when there are none.

        ``num_prompt_tokens`` defaults to the full pages' tokens; ``now`` (seconds) to the index's clock
        (``time.monotonic()`` unless the index was given another).
        ``partial_key`` (optional) tells which recently finished request this one continues (module docstring).
        ``request_id`` (optional, the id ``note_routed`` / ``note_finished`` get) tells a retry of a request already
        chosen for (Serve asks again when the replicas refused it): the session its first choice recorded is not one
        it continues; it goes by the session its first choice continued and records none again.
        """
        if not candidates:
            raise ValueError("no candidate replicas to route to")
        replica_id_to_matched = self.index.longest_prefix(page_keys, [c.replica_id for c in candidates])
        anchor = page_keys[0] if page_keys else b""
        inflight = self._replica_id_to_num_inflight
        num_keys = self.index.num_keys
        scored = []
        for c in candidates:
            replica_id = c.replica_id
            load = inflight.get(replica_id, 0)
            if c.num_requests > load:
                load = c.num_requests
            scored.append(_Scored(replica_id, replica_id_to_matched.get(replica_id, 0), load, num_keys(replica_id), c))
        if self.config.enable_cost_model and now is None:
            now = self.index.clock()  # the clock finishes are stamped with (``note_finished``)
        if self.config.enable_cost_model and self.config.enable_residency_aging and replica_id_to_matched:
            scored = self._resident(scored, page_keys, now)
            replica_id_to_matched = {s.replica_id: s.matched for s in scored if s.matched}
        if self.config.enable_cost_model and self._answered and replica_id_to_matched:
            scored = self._with_answers(scored, page_keys, now, partial_key)
            replica_id_to_matched = {s.replica_id: s.matched for s in scored if s.matched}
        min_load = min(s.load for s in scored)
        abs_bound = min_load + self.config.balance_abs_threshold
        rel_bound = self.config.balance_rel_threshold * min_load
        eligible = [s for s in scored if s.load <= abs_bound or s.load <= rel_bound]  # not is_overloaded
        top = max(replica_id_to_matched.values(), default=0)
        session = None
        moving = False  # a chat leaving a home it outgrew: the home is no candidate
        recorded = None  # a retry's: the session its first choice recorded
        if self.config.enable_cost_model and self.config.session_growth and page_keys:
            session = self._session_of(page_keys, partial_key, now)
            if session is not None and request_id is not None and session.request_id == request_id:
                recorded, session = session, session.continues
                if session is not None and not any(c.replica_id == session.replica_id for c in candidates):
                    session = None  # the home it continued is no candidate now (it may have left)
            if session is not None:
                if len(eligible) > 1:
                    eligible = self._keep_session_home(eligible, session.replica_id, top)
                roomy = self._roomier_than_home(scored, eligible, session.replica_id, top, len(page_keys))
                if roomy:
                    eligible, moving = roomy, True
            elif partial_key is not None and top and 2 * top >= len(page_keys) and len(eligible) > 1:
                eligible = self._keep_with_holders(eligible, scored, top)
        holders = [s for s in scored if s.matched == top] if top else [scored[0]]
        if len(holders) > 1 and self.config.enable_cost_model:
            # the holder to copy from: the one expected to have the pages soonest (a replica this router just sent
            # the prefix to holds it only once it has computed or copied it)
            ready_s = self._key_to_ready_s
            last = page_keys[top - 1]
            holder = _best(holders, lambda s: (-max(ready_s.get((s.replica_id, last), now), now), _preference(s)),
                           anchor)
        else:
            holder = _best(holders, _preference, anchor)
        if not self.config.enable_cost_model:
            if holder.matched and any(s.matched for s in eligible):
                chosen = _best(eligible, _preference, anchor)
            else:
                chosen = _best(eligible, _new_prefix_preference, anchor)
            decision = self._explain(chosen, holder, min_load, cost_chosen=False)
            self.index.expect_keys(decision.replica_id, page_keys)
            self._count(decision)
            return decision
        if num_prompt_tokens is None:
            num_prompt_tokens = len(page_keys) * self.config.page_size
        self._forget_ready_pages(now)
        tier_runs = self.tier_runs(page_keys)
        if holder.matched and self.config.enable_overload_exception and holder not in eligible and not moving:
            # the holder is over the load bound; it stays a candidate only if every eligible replica would have to
            # evict cached pages to take the request (a full cluster: moving would cost another prefix)
            eligible = eligible + [holder]
            estimates = self._estimate_all(eligible, holder, page_keys, num_prompt_tokens, now, tier_runs)
            # a chat's busy home in caches its chats would outgrow stays too: the estimate decides (docstring)
            keeps_home = session is not None and session.replica_id == holder.replica_id and self._tight(holder)
            if not keeps_home and any(estimate[3] == estimate[0] for estimate in estimates[:-1]):
                eligible, estimates = eligible[:-1], estimates[:-1]
        else:
            estimates = self._estimate_all(eligible, holder, page_keys, num_prompt_tokens, now, tier_runs)
        if holder.matched == 0:
            # nobody holds page 0: everyone must compute it; the least estimate, and among equals the emptiest cache
            # (keeps new prefixes partitioned evenly over the caches)
            pair = _best(list(zip(eligible, estimates)), lambda pair: (-pair[1][3], -pair[0].num_cached), anchor,
                         lambda pair: pair[0])
        else:
            least_work_ms = min(estimate[2] for estimate in estimates)
            weight = self.config.duplicate_work_weight
            scores = [estimate[3] + weight * (estimate[2] - least_work_ms) for estimate in estimates]
            least = min(scores)
            tied = [pair for pair, score in zip(zip(eligible, estimates), scores) if score == least]
            pair = tied[0] if len(tied) == 1 else _best(tied, lambda pair: _preference(pair[0]), anchor,
                                                        lambda pair: pair[0])
        chosen, (estimate_ms, busy_ms, _, _, copies) = pair
        replica_id = chosen.replica_id
        busy_until = max(self._replica_id_to_busy_until.get(replica_id, now), now) + busy_ms / 1000.0
        self._replica_id_to_busy_until[replica_id] = busy_until
        # its new pages are there at its first token: after its queue, or after the holder it waits for to copy from
        ready_at = max(busy_until, now + estimate_ms / 1000.0)
        key_to_ready_s = self._key_to_ready_s
        ready_order = self._ready_order
        for key in page_keys[chosen.matched:]:
            key_to_ready_s[(replica_id, key)] = ready_at
            ready_order.append((ready_at, replica_id, key))
        decision = self._explain(chosen, holder, min_load, cost_chosen=True, estimate_ms=estimate_ms, copies=copies)
        if moving:
            decision = replace(decision, reason=RoutingReason.SESSION_MOVE)
        self.index.expect_keys(replica_id, page_keys, busy_until - now - busy_ms / 1000.0)  # its admission
        if recorded is not None:
            # a retry: its first choice refused it (recorded like a finish), so its session is live again
            self._revive_session(recorded)
            if recorded.replica_id != replica_id:  # sent elsewhere: its session lives there now
                self._move_session(recorded, replica_id)
        elif self.config.session_growth and page_keys:
            self._note_session(session, page_keys, num_prompt_tokens, partial_key, replica_id, now, request_id)
        self._count(decision)
        return decision

    # ---- sessions (module docstring, "Sessions") -------------------------------------------------------------------
    def _session_of(self, page_keys: Sequence[PageKey], partial_key: PartialKey | None,
                    now: float) -> "_Session | None":
        """The active session this request continues (the deepest, then the longest tail), or None."""
        self._forget_sessions(now)
        sessions = self._sessions
        if not sessions:
            return None
        for index in range(len(page_keys) - 1, -1, -1):
            key = page_keys[index]
            tails = sessions.get(key)
            if not tails:
                continue
            lengths = self._session_tail_lengths.get(key)
            if lengths and partial_key is not None:
                for num_tokens in sorted(lengths, reverse=True):
                    tail_key = partial_key(index + 1, num_tokens)
                    session = None if tail_key is None else tails.get(PromptTail(num_tokens, tail_key))
                    if session is not None:
                        return session
            session = tails.get(None)  # a prompt that ended at this page's end
            if session is not None:
                return session
        return None

    def _num_sessions(self, replica_id: str) -> float:
        """sessions(r) of the module docstring."""
        return (self._replica_id_to_num_sessions.get(replica_id, 0)
                + self.session_continue_rate * self._replica_id_to_num_new_sessions.get(replica_id, 0))

    def _growth_pages(self, growth: float) -> float:
        """``growth`` times the mean pages of the sessions' latest prompts (sessions weighted as in sessions(r));
        0 when there are none."""
        rate = self.session_continue_rate
        total = (sum(self._replica_id_to_num_sessions.values())
                 + rate * sum(self._replica_id_to_num_new_sessions.values()))
        if total <= 0:
            return 0.0
        pages = (sum(self._replica_id_to_session_pages.values())
                 + rate * sum(self._replica_id_to_new_session_pages.values()))
        return growth * pages / total

    def _tight(self, s: "_Scored", growth_pages: float | None = None) -> bool:
        """tight(r) of the module docstring (``growth_pages``: ``_growth_pages(session_growth)`` by default)."""
        if growth_pages is None:
            growth_pages = self._growth_pages(self.config.session_growth)
        pages_total = s.load_report.num_pages_total
        return 0 < pages_total < growth_pages * (self._num_sessions(s.replica_id) + 1)

    def _keep_session_home(self, eligible: list, home: str, top: int) -> list:
        """``eligible`` less the tight replicas, neither the home of the session being continued nor holding the most
        leading pages (``top``), that moving the session to would not even out (module docstring); all of
        ``eligible`` when that would leave none."""
        growth_pages = self._growth_pages(self.config.session_growth)
        if growth_pages <= 0:
            return eligible
        most = self._num_sessions(home) - 1
        keep = [s for s in eligible
                if s.replica_id == home
                or (top and s.matched == top)
                or not self._tight(s, growth_pages)
                or self._num_sessions(s.replica_id) < most]
        return keep or eligible

    def _session_demand(self, replica_id: str) -> float:
        """demand(r) of the module docstring."""
        return (self._replica_id_to_session_pages.get(replica_id, 0)
                + self.session_continue_rate * self._replica_id_to_new_session_pages.get(replica_id, 0))

    def _roomier_than_home(self, scored: list, eligible: list, home_id: str, top: int, num_pages: int) -> list:
        """For a chat's turn of ``num_pages`` pages whose session lives on ``home_id``: the eligible replicas other than
        the home where the chats there and this turn fit, when the home holds the most leading pages (``top``: a
        replica holding more, where the history went, is left to the other rules) and its chats have outgrown it
        (module docstring, "Sessions"), whether or not the home is within the load bound; else (or when none fits) [].
        A replica with no page count yet (no stats) is never judged outgrown nor taken for roomy."""
        fill = self.config.session_move_fill
        home = next((s for s in scored if s.replica_id == home_id), None)
        if not fill or home is None or home.matched != top:
            return []
        home_pages = home.load_report.num_pages_total
        if home_pages <= 0 or not self._session_demand(home_id) > fill * home_pages:
            return []
        return [s for s in eligible if s.replica_id != home_id and 0 < s.load_report.num_pages_total
                and self._session_demand(s.replica_id) + num_pages <= fill * s.load_report.num_pages_total]

    def _keep_with_holders(self, eligible: list, scored: list, top: int) -> list:
        """For a request starting a session: the eligible holders of the most leading pages (``top``) with at most
        ``_HOLDER_SESSION_SLACK`` sessions more than the one with the fewest, when that one is tight by
        ``session_start_growth`` and has fewer sessions than the candidates' mean plus one (module docstring); else,
        or when no holder is eligible, ``eligible``."""
        growth = self.config.session_start_growth
        holders = [s for s in eligible if s.matched == top]
        if not growth or not holders:
            return eligible
        holder = min(holders, key=lambda s: self._num_sessions(s.replica_id))
        fewest = self._num_sessions(holder.replica_id)
        if not self._tight(holder, self._growth_pages(growth)):
            return eligible
        mean = sum(self._num_sessions(s.replica_id) for s in scored) / len(scored)
        if fewest >= mean + 1:
            return eligible  # the holders have their share of the chats already
        return [s for s in holders if self._num_sessions(s.replica_id) <= fewest + _HOLDER_SESSION_SLACK]

    def _note_session(self, continued: "_Session | None", page_keys: Sequence[PageKey], num_prompt_tokens: int | None,
                      partial_key: PartialKey | None, replica_id: str, now: float,
                      request_id: str | None = None) -> None:
        """Record the request just routed to ``replica_id`` as its session's latest: a continued session when it
        continues one. A request without partial keys ends the session it continues and starts none."""
        if continued is not None:
            if not continued.counted:
                self._note_continued(True)
            if continued.finished_s is not None:
                self._session_gaps.append(max(now - continued.finished_s, 0.0))
                self._num_gaps_seen += 1
            if continued.idle:  # taken for ended too soon: the idle time is recomputed with this gap at once
                self._note_session_event(continued.replica_id, "resumed")
                self._session_idle_s = math.inf
            self._end_session(continued)
        if partial_key is None or num_prompt_tokens is None:
            return
        key = page_keys[-1]
        tail = self._tail(page_keys, num_prompt_tokens, partial_key)
        counted = continued is not None  # the same prompt again is found as the session it continues, and ended above
        continues = None if continued is None else continued._replace(continues=None)  # no chain of past turns
        self._sessions.setdefault(key, {})[tail] = _Session(replica_id, now, len(page_keys), key, tail, counted,
                                                            request_id, continues)
        if tail is not None:
            lengths = self._session_tail_lengths.setdefault(key, {})
            lengths[tail.num_tokens] = lengths.get(tail.num_tokens, 0) + 1
        self._session_order.append((now, key, tail))
        self._add_session(replica_id, counted, len(page_keys))

    def _add_session(self, replica_id: str, counted: bool, num_pages: int) -> None:
        """Count a session on ``replica_id`` (``num_pages`` < 0: uncount it)."""
        step = 1 if num_pages >= 0 else -1
        if counted:
            self._replica_id_to_num_sessions[replica_id] = self._replica_id_to_num_sessions.get(replica_id, 0) + step
            pages = self._replica_id_to_session_pages
        else:
            self._replica_id_to_num_new_sessions[replica_id] = (self._replica_id_to_num_new_sessions.get(replica_id, 0)
                                                                + step)
            pages = self._replica_id_to_new_session_pages
        pages[replica_id] = pages.get(replica_id, 0) + num_pages

    def _note_continued(self, continued: bool) -> None:
        """A session's first request was continued (True) or its window ended first: the moving average moves."""
        self.session_continue_rate += _SESSION_RATE_WEIGHT * (float(continued) - self.session_continue_rate)

    def _end_session(self, session: "_Session") -> None:
        key, tail = session.key, session.tail
        tails = self._sessions[key]
        del tails[tail]
        if not tails:
            del self._sessions[key]
        if tail is not None:
            lengths = self._session_tail_lengths[key]
            lengths[tail.num_tokens] -= 1
            if not lengths[tail.num_tokens]:
                del lengths[tail.num_tokens]
                if not lengths:
                    del self._session_tail_lengths[key]
        if not session.idle:
            self._add_session(session.replica_id, session.counted, -session.num_pages)

    def _rehome_session(self, request_id: str, previous: str, replica_id: str) -> None:
        """A request the policy routed to ``previous`` was sent to ``replica_id`` instead (Serve's fallback when the
        chosen replica was full): its session lives there now."""
        key = self._request_id_to_last_key.get(request_id)
        tails = self._sessions.get(key) if key is not None else None
        session = tails.get(self._request_id_to_tail.get(request_id)) if tails else None
        if session is None or session.replica_id != previous:
            return
        self._move_session(session, replica_id)

    def _revive_session(self, session: "_Session") -> None:
        """``session`` (an active one) is not finished nor idle (its request was refused and is retried)."""
        current = self._sessions.get(session.key, {}).get(session.tail)
        if current is None or (current.finished_s is None and not current.idle):
            return
        self._sessions[session.key][session.tail] = current._replace(finished_s=None, idle=False)
        if current.idle:
            self._add_session(current.replica_id, current.counted, current.num_pages)

    def _move_session(self, session: "_Session", replica_id: str) -> None:
        """Home ``session`` (an active one) on ``replica_id`` instead."""
        session = self._sessions[session.key][session.tail]
        self._sessions[session.key][session.tail] = session._replace(replica_id=replica_id)
        if not session.idle:
            self._add_session(session.replica_id, session.counted, -session.num_pages)
            self._add_session(replica_id, session.counted, session.num_pages)

    def _forget_sessions(self, now: float) -> None:
        """End the sessions whose latest request was routed ``session_window_s`` or longer ago, and take those whose
        latest request finished more than the idle time ago out of the books (module docstring, "Sessions")."""
        sessions = self._sessions
        finished = self._finished_order
        if finished:
            idle_cutoff = now - self._idle_s()
            # an entry past the window goes too, idle or not: its session ends below
            drop_cutoff = max(idle_cutoff, now - self.config.session_window_s)
            while finished and finished[0][0] < drop_cutoff:
                finished_s, key, tail = finished.popleft()
                session = sessions.get(key, {}).get(tail)
                if (finished_s < idle_cutoff and session is not None and session.finished_s == finished_s
                        and not session.idle):
                    sessions[key][tail] = session._replace(idle=True)
                    self._add_session(session.replica_id, session.counted, -session.num_pages)
                    self._note_session_event(session.replica_id, "idle")
        cutoff = now - self.config.session_window_s
        order = self._session_order
        while order and order[0][0] <= cutoff:
            routed_s, key, tail = order.popleft()
            session = sessions.get(key, {}).get(tail)
            if session is not None and session.routed_s == routed_s:  # not continued or routed again since
                if not session.counted:
                    self._note_continued(False)
                self._end_session(session)

    def _idle_s(self) -> float:
        """How long after its latest request finished a session turns idle: ``session_idle_factor`` times the
        ``_SESSION_GAP_QUANTILE`` of the recent gaps, at least ``_SESSION_MIN_IDLE_S`` (inf while off or before
        ``_SESSION_MIN_GAPS`` gaps were seen; recomputed every ``_SESSION_MIN_GAPS`` new gaps, and at once after an
        idle session went on)."""
        gaps = self._session_gaps
        factor = self.config.session_idle_factor
        if not factor or len(gaps) < _SESSION_MIN_GAPS:
            return math.inf
        num_seen = self._num_gaps_seen
        if num_seen - self._num_gaps_at_idle >= _SESSION_MIN_GAPS or self._session_idle_s == math.inf:
            ordered = sorted(gaps)
            quantile = ordered[min(int(_SESSION_GAP_QUANTILE * len(ordered)), len(ordered) - 1)]
            self._session_idle_s = max(factor * quantile, _SESSION_MIN_IDLE_S)
            self._num_gaps_at_idle = num_seen
        return self._session_idle_s

    def _note_session_finished(self, request_id: str, replica_id: str, key: PageKey, tail: PromptTail | None,
                               finished_s: float) -> None:
        """``request_id``, which ended at ``key`` / ``tail`` on ``replica_id``, finished: if it is its session's latest
        request (by id, when ``choose`` was told the session's), the session may turn idle from now on. Another request
        with the same prompt, which the session's latest continued, finishing is not the session's end."""
        tails = self._sessions.get(key)
        session = tails.get(tail) if tails else None
        if (session is None or session.replica_id != replica_id or session.idle
                or session.request_id not in (None, request_id)
                or (session.finished_s is not None and session.finished_s >= finished_s)):
            return
        tails[tail] = session._replace(finished_s=finished_s)
        self._finished_order.append((finished_s, key, tail))

    def _note_session_event(self, replica_id: str, event: str) -> None:
        events = self.session_events
        events[(replica_id, event)] = events.get((replica_id, event), 0) + 1

    def drain_session_events(self) -> dict[tuple[str, str], int]:
        """``session_events`` so far, and start counting from zero (the Ray adapter exports them as counters)."""
        events, self.session_events = self.session_events, {}
        return events

    def _count(self, decision: RoutingDecision) -> None:
        self.num_decisions_by_reason[decision.reason] += 1
        key = (decision.replica_id, decision.reason)
        counts = self.num_decisions_by_replica_reason
        counts[key] = counts.get(key, 0) + 1

    def _resident(self, scored: list, page_keys: Sequence[PageKey], now: float) -> list:
        """``scored`` with each holder's matched pages cut to those expected still there at its admission."""
        busy_until = self._replica_id_to_busy_until
        out = []
        for s in scored:
            if s.matched:
                wait_s = busy_until.get(s.replica_id, now) - now if s.load else 0.0
                resident = self.index.expected_resident(s.replica_id, page_keys, s.matched, wait_s, now)
                if resident != s.matched:
                    s = s._replace(matched=resident)
            out.append(s)
        return out

    def _with_answers(self, scored: list, page_keys: Sequence[PageKey], now: float,
                      partial_key: PartialKey | None = None) -> list:
        """``scored`` with one more matched page on each replica that finished, within ``answer_report_s``, a request
        whose prompt's full pages are exactly the ones it matches and that this request continues: the page the
        finished prompt's tail and its answer filled was stored when it ended and is not reported yet (a chat's next
        turn sent within one stats period of the answer; every replica holding the system prompt matches as much).
        With ``partial_key``, a finished request whose tail is known counts only if this request's tokens after that
        page begin with its tail: other chats' turns ending at the same page of a shared system prompt filled that
        page with their own tails, so their replicas hold nothing more of this request."""
        answered = self._answered
        self._forget_answers(now)
        if not answered:
            return scored
        # only where no replica is known to hold more: a replica that reported the continuation already holds it
        top = max(s.matched for s in scored)
        if top >= len(page_keys):
            return scored
        last = page_keys[top - 1]
        length_to_key: dict[int, bytes | None] = {}  # this request's partial keys after page ``top``, by length
        out = []
        for s in scored:
            if s.matched == top:
                tails = answered.get((s.replica_id, last))
                if tails and (partial_key is None or _continues_any(tails, top, partial_key, length_to_key)):
                    s = s._replace(matched=top + 1)
            out.append(s)
        return out

    def comparable_costs(self, loads: Sequence[ReplicaLoad]) -> list[_Costs]:
        """``costs_of`` each candidate, with every compute cost (step, prompt token, attention pair, decode row) that
        not all of them measured set to the default for all of them: one replica's measurement against another's
        default would favour whichever number is lower, not whichever replica is faster (a replica that has served
        requests would attract every new prefix from one that has not measured yet). A peer copy is work only the
        copying candidate does, so its measured cost per page stays its own."""
        costs = [self.costs_of(load) for load in loads]
        default = self._default_costs
        unmeasured = [i for i, name in enumerate(_Costs._fields[:4])
                      if any(load.costs is None or getattr(load.costs, name) is None for load in loads)]
        if not unmeasured or all(c is default for c in costs):
            return costs
        return [c._replace(**{_Costs._fields[i]: default[i] for i in unmeasured}) for c in costs]

    def costs_of(self, load: ReplicaLoad) -> _Costs:
        """The per-unit costs used for ``load``'s replica (its measured ones where present)."""
        measured = load.costs
        if measured is None:
            return self._default_costs
        cached = self._measured_to_costs.get(id(measured))
        if cached is not None and cached[0] is measured:
            return cached[1]
        default = self._default_costs
        costs = _Costs(*(default[i] if getattr(measured, name) is None else getattr(measured, name)
                         for i, name in enumerate(_Costs._fields[:5])), measured.host_page_ms,
                       default.host_fetch_ms if measured.host_page_ms is None else measured.host_page_ms,
                       default.disk_fetch_ms if measured.disk_page_ms is None else measured.disk_page_ms)
        if len(self._measured_to_costs) > 4096:
            self._measured_to_costs.clear()
        self._measured_to_costs[id(measured)] = (measured, costs)
        return costs

    def tier_runs(self, page_keys: Sequence[PageKey]) -> tuple[int, int]:
        """Leading request pages the host tier holds, and the disk tier (by any replica's report; 0, 0 when tier
        routing is off or no replica reports tiers)."""
        if not self.config.enable_tier_routing or not page_keys:
            return 0, 0
        holders = self.tier_index.replica_ids()
        if not holders:
            return 0, 0
        host = [h for h in holders if h.endswith(HOST_HOLDER_SUFFIX)]
        disk = [h for h in holders if h.endswith(DISK_HOLDER_SUFFIX)]
        return (self.tier_index.longest_prefix_any(page_keys, host) if host else 0,
                self.tier_index.longest_prefix_any(page_keys, disk) if disk else 0)

    def _estimate_all(self, eligible: list, holder: "_Scored", page_keys: Sequence[PageKey], num_prompt_tokens: int,
                      now: float, tier_runs: tuple[int, int] = (0, 0)) -> list:
        """Per eligible replica: (ttft, busy, work, ttft + eviction cost) in ms and whether it copies pages from the
        holder; the terms of the module docstring.
        Work and step counts depend only on the pages reused, so they are computed once per distinct count."""
        config = self.config
        copy_from = holder.matched if config.enable_peer_hint else 0
        copy_ready_s = 0.0
        if copy_from:
            copy_ready_s = (self._key_to_ready_s.get((holder.replica_id, page_keys[copy_from - 1]), now) - now
                            ) * _READY_MARGIN
        busy_until = self._replica_id_to_busy_until
        ready_of = self._key_to_ready_s
        prompt_pages = -(-num_prompt_tokens // config.page_size)
        host_run, disk_run = tier_runs
        reused_to_work: dict[tuple, tuple[float, int]] = {}
        estimates = []
        for s, costs in zip(eligible, self.comparable_costs([s.load_report for s in eligible])):
            cold = reused_to_work.get((costs, 0, 0))
            if cold is None:
                cold = reused_to_work[(costs, 0, 0)] = self._work_ms(0, 0, num_prompt_tokens, costs)
            # an evicted page is priced as this prompt's pages cost on average to recompute (the attention term makes
            # deep pages of long prompts dearer than the weights alone), or as fetching it back from a shared tier
            eviction_page_ms = config.eviction_weight * cold[0] / max(prompt_pages, 1)
            if costs.host_page_ms is not None and costs.host_page_ms < eviction_page_ms:
                eviction_page_ms = config.eviction_weight * costs.host_page_ms
            # the forecast of queued work only counts while the replica has requests: one with none is idle now,
            # however long the model expected its last requests to take (it has no other feedback that they ended)
            wait_s = busy_until.get(s.replica_id, now) - now if s.load else 0.0
            if s.matched and s.load:
                # pages this router sent it that it gets by waiting for another holder are there only then
                own_ready_s = ready_of.get((s.replica_id, page_keys[s.matched - 1]), now) - now
                if own_ready_s > wait_s:
                    wait_s = own_ready_s
            if wait_s < 0.0:
                wait_s = 0.0
            copied = copy_from - s.matched
            copy_wait_s = wait_s
            if copied < config.min_peer_copy_pages:
                copied = 0
            elif copy_ready_s > wait_s:
                # the holder is still computing the pages when this replica would start: it copies them once they
                # are done (the holder's export waits up to holder_wait_s for pages it is computing) or computes
                # them itself, whichever the estimate says is sooner
                copy_wait_s = copy_ready_s
                if copy_ready_s - wait_s > config.holder_wait_s:
                    copied = 0
            ttft_ms, busy_ms, work_ms = self._estimate_one(s, costs, copied, wait_s, num_prompt_tokens, host_run,
                                                            disk_run, reused_to_work)
            copies = copied > 0
            if copied and copy_wait_s > wait_s:
                ttft_ms += (copy_wait_s - wait_s) * 1000.0  # starts when the holder is done
                computing = self._estimate_one(s, costs, 0, wait_s, num_prompt_tokens, host_run, disk_run,
                                               reused_to_work)
                weight = config.duplicate_work_weight
                if computing[0] + weight * computing[2] <= ttft_ms + weight * work_ms:
                    ttft_ms, busy_ms, work_ms = computing
                    copies = False
            scored_ms = ttft_ms
            load = s.load_report
            if eviction_page_ms and load.num_pages_total > 0:
                empty = load.num_pages_free - s.num_cached
                evicted = prompt_pages - s.matched - (empty if empty > 0 else 0)
                if evicted > 0:
                    scored_ms += evicted * eviction_page_ms
            estimates.append((ttft_ms, busy_ms, work_ms, scored_ms, copies))
        return estimates

    def _estimate_one(self, s: "_Scored", costs: _Costs, copied: int, wait_s: float, num_prompt_tokens: int,
                      host_run: int, disk_run: int, reused_to_work: dict) -> tuple[float, float, float]:
        """(ttft, busy, work) in ms of ``s`` copying ``copied`` pages from the holder after ``wait_s`` of queued work;
        the shared tiers continue the run (the replica fetches host pages, then disk pages, after its own and the
        copied ones). ``reused_to_work`` caches the work per distinct reuse."""
        reused = s.matched + copied
        from_host = host_run - reused if host_run > reused else 0
        from_disk = disk_run - reused - from_host if disk_run > reused + from_host else 0
        work_key = (costs, s.matched, copied, from_host, from_disk)
        work = reused_to_work.get(work_key)
        if work is None:
            work = reused_to_work[work_key] = self._work_ms(s.matched, copied, num_prompt_tokens, costs, from_host,
                                                            from_disk)
        work_ms, num_steps = work
        busy_ms = work_ms + num_steps * (costs.step_ms + s.load * costs.decode_row_ms)
        return wait_s * 1000.0 + busy_ms, busy_ms, work_ms

    def _work_ms(self, matched: int, copied: int, num_prompt_tokens: int, costs: _Costs | None = None,
                 from_host: int = 0, from_disk: int = 0) -> tuple[float, int]:
        """(copy, fetch and compute work, engine steps) of a prompt with ``matched`` pages local, ``copied`` copied
        from a peer and ``from_host`` / ``from_disk`` fetched from the shared tiers."""
        config = self.config
        costs = costs or self._default_costs
        reused_tokens = min((matched + copied + from_host + from_disk) * config.page_size, max(num_prompt_tokens - 1, 0))
        computed = max(num_prompt_tokens - reused_tokens, 1)
        work_ms = (
            copied * costs.peer_copy_page_ms
            + from_host * costs.host_fetch_ms
            + from_disk * costs.disk_fetch_ms
            + computed * costs.prefill_token_ms
            + costs.attention_pair_us / 1000.0 * computed * (reused_tokens + computed / 2)
        )
        return work_ms, -(-computed // config.max_num_batched_tokens)

    def estimate_ttft_ms(self, load: int, matched: int, copied: int, num_prompt_tokens: int, wait_s: float = 0.0
                         ) -> tuple[float, float, float]:
        """(estimated TTFT, the part of it the replica is busy, the copy and compute work in it), in ms, for a replica
        with ``load`` requests, ``matched`` pages local, ``copied`` pages copied and ``wait_s`` of queued prefill."""
        return self._estimate_one(_Scored("", matched, load, 0, ReplicaLoad("")), self._default_costs, copied, wait_s,
                                  num_prompt_tokens, 0, 0, {})

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
    def note_routed(self, request_id: str, replica_id: str, page_keys: Sequence[PageKey] = (), *,
                    num_prompt_tokens: int | None = None, partial_key: PartialKey | None = None) -> None:
        """Count ``request_id`` against ``replica_id`` until ``note_finished``. Routing it again moves it.

        With residency aging, ``page_keys`` (the request's) are held in use on the replica until then
        (``PrefixIndex.hold``): a running request's pages are not in its LRU queue. With ``num_prompt_tokens`` and
        ``partial_key`` its prompt's tail is kept until it finishes, to tell its continuation from other requests
        that ended at the same page (``choose``)."""
        previous = self._request_id_to_replica_id.get(request_id)
        if previous == replica_id:
            return
        keys = page_keys
        if previous is not None:
            self._decrement(previous)
            held = self._request_id_to_keys.pop(request_id, None)
            if held:  # release only what this request held there: other requests' holds on the same keys stay
                self.index.release(previous, held)
                keys = held
        self._request_id_to_replica_id[request_id] = replica_id
        self._replica_id_to_num_inflight[replica_id] = self._replica_id_to_num_inflight.get(replica_id, 0) + 1
        if previous is not None and self._sessions:
            self._rehome_session(request_id, previous, replica_id)
        if page_keys and self.config.enable_cost_model:
            self._request_id_to_last_key[request_id] = page_keys[-1]
            tail = self._tail(page_keys, num_prompt_tokens, partial_key)
            if tail is None:
                self._request_id_to_tail.pop(request_id, None)
            else:
                self._request_id_to_tail[request_id] = tail
        if keys and self._holds_keys:
            self._request_id_to_keys[request_id] = keys
            self.index.hold(replica_id, keys)

    def note_finished(self, request_id: str, replica_id: str | None = None, *, answered: bool = True) -> None:
        """Stop counting ``request_id`` (if counted, and against ``replica_id`` when given). Idempotent.
        ``answered=False``: it did not run there (a request lane's replica answered "busy", or it was never sent), so
        neither its answer nor its session's turn is recorded as finished there."""
        counted_on = self._request_id_to_replica_id.get(request_id)
        if counted_on is None or (replica_id is not None and counted_on != replica_id):
            return
        del self._request_id_to_replica_id[request_id]
        self._decrement(counted_on)
        keys = self._request_id_to_keys.pop(request_id, None)
        if keys:
            self.index.release(counted_on, keys)
        last_key = self._request_id_to_last_key.pop(request_id, None)
        tail = self._request_id_to_tail.pop(request_id, None)
        if last_key is not None and answered:  # its answer pages are stored there now, reported with the next stats
            finished_s = self.index.clock()
            if self._sessions and self.config.session_idle_factor:
                self._note_session_finished(request_id, counted_on, last_key, tail, finished_s)
            self._answered.setdefault((counted_on, last_key), {})[tail] = finished_s
            self._answered_order.append((finished_s, counted_on, last_key, tail))
            self._forget_answers(finished_s)

    def counted_on(self, request_id: str) -> str | None:
        """The replica ``request_id`` is counted in flight on, or None."""
        return self._request_id_to_replica_id.get(request_id)

    def num_inflight(self, replica_id: str) -> int:
        return self._replica_id_to_num_inflight.get(replica_id, 0)

    def forget_replica(self, replica_id: str) -> None:
        """Drop the in-flight count of a replica that left (its index entries are the index's business), and the
        tier pages it reported: nobody reports their removal any more, so they would only go stale (the tiers still
        hold them; a replica that stores them again reports them again)."""
        for medium in (MEDIUM_HOST, MEDIUM_DISK):
            self.tier_index.remove_replica(tier_holder_id(replica_id, medium))
        self._replica_id_to_num_inflight.pop(replica_id, None)
        self._replica_id_to_busy_until.pop(replica_id, None)
        for tails in list(self._sessions.values()):  # its sessions start over wherever their next request goes
            for session in [session for session in tails.values() if session.replica_id == replica_id]:
                self._end_session(session)
        for counts in (self._replica_id_to_num_sessions, self._replica_id_to_num_new_sessions,
                       self._replica_id_to_session_pages, self._replica_id_to_new_session_pages):
            counts.pop(replica_id, None)
        for request_id in [r for r, owner in self._request_id_to_replica_id.items() if owner == replica_id]:
            del self._request_id_to_replica_id[request_id]
            self._request_id_to_keys.pop(request_id, None)
            self._request_id_to_last_key.pop(request_id, None)
            self._request_id_to_tail.pop(request_id, None)

    # ---- internals -------------------------------------------------------------------------------------------------
    def _forget_answers(self, now: float) -> None:
        """Drop the finished requests whose answer pages the index has heard of by ``now`` (``answer_report_s``): each
        (replica, page, tail) goes with its latest finish, so what is kept is what finished within that time."""
        cutoff = now - self.config.answer_report_s
        order = self._answered_order
        answered = self._answered
        while order and order[0][0] < cutoff:
            at, replica_id, key, tail = order.popleft()
            tails = answered.get((replica_id, key))
            if tails is not None and tails.get(tail) == at:  # not finished again since
                del tails[tail]
                if not tails:
                    del answered[(replica_id, key)]

    def _tail(self, page_keys: Sequence[PageKey], num_prompt_tokens: int | None,
              partial_key: PartialKey | None) -> PromptTail | None:
        """The prompt's tokens after its last full page as a ``PromptTail``; None without partial keys or prompt
        length, or when the prompt ends at a page's end (nothing then tells its continuation from another's)."""
        if partial_key is None or num_prompt_tokens is None:
            return None
        num_tokens = num_prompt_tokens - len(page_keys) * self.config.page_size
        if not 0 < num_tokens < self.config.page_size:
            return None
        key = partial_key(len(page_keys), num_tokens)
        return None if key is None else PromptTail(num_tokens, key)

    def _forget_ready_pages(self, now: float) -> None:
        _expire(self._ready_order, self._key_to_ready_s, now, inclusive=True)

    def _explain(self, chosen: _Scored, holder: _Scored, min_load: int, *, cost_chosen: bool,
                 estimate_ms: float = 0.0, copies: bool = True) -> RoutingDecision:
        """The decision for ``chosen``; a peer hint only where ``chosen`` is to copy (``copies``: with the cost model,
        whether its estimate copied; a hint to a holder still computing the pages makes the replica wait for them)."""
        if holder.matched == 0:
            return RoutingDecision(chosen.replica_id, 0, None, RoutingReason.NO_MATCH, estimated_ttft_ms=estimate_ms)
        if chosen.matched >= holder.matched:
            return RoutingDecision(chosen.replica_id, chosen.matched, None, RoutingReason.PREFIX_HIT,
                                   estimated_ttft_ms=estimate_ms)
        holder_overloaded = self.is_overloaded(holder.load, min_load) or not cost_chosen
        reason = RoutingReason.BALANCED_AWAY if holder_overloaded else RoutingReason.COST_AWAY
        wants_hint = (
            copies and self.config.enable_peer_hint
            and holder.matched - chosen.matched >= self.config.min_peer_copy_pages
        )
        return RoutingDecision(
            chosen.replica_id,
            chosen.matched,
            holder.replica_id if wants_hint else None,
            reason,
            holder.matched if wants_hint else 0,
            estimated_ttft_ms=estimate_ms,
        )

    def _decrement(self, replica_id: str) -> None:
        num_inflight = self._replica_id_to_num_inflight.get(replica_id, 0) - 1
        if num_inflight > 0:
            self._replica_id_to_num_inflight[replica_id] = num_inflight
        else:
            self._replica_id_to_num_inflight.pop(replica_id, None)


def token_partial_key(page_keys: Sequence[PageKey], token_ids: Sequence[int], page_size: int) -> PartialKey | None:
    """The ``PartialKey`` of a prompt with these full-page keys and token ids: a digest of the parent page key and the
    tokens. None when the keys are not the prompt's full pages of ``page_size`` tokens (a router configured with
    another page size than the replicas': it would compare tails cut at the wrong token, so it gives none and the
    policy credits answers by page as without partial keys)."""
    if not page_keys or len(token_ids) // page_size != len(page_keys):
        return None

    def partial_key(num_pages: int, num_tokens: int) -> bytes | None:
        start = num_pages * page_size
        if not 0 < num_pages <= len(page_keys) or num_tokens < 0 or start + num_tokens > len(token_ids):
            return None
        tokens = msgpack.packb(list(token_ids[start:start + num_tokens]))
        return hashlib.blake2b(page_keys[num_pages - 1] + tokens, digest_size=16, person=b"partial-page").digest()

    return partial_key


def tie_score(anchor: PageKey, replica_id: str) -> int:
    """Rendezvous score of ``replica_id`` for requests whose first page key is ``anchor`` (same in every process):
    a 64-bit mix of the two digests, so a decision hashes the anchor once however many replicas tie."""
    return _mix(_digest64(anchor) ^ _digest64(replica_id.encode()))


@functools.lru_cache(maxsize=4096)
def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _mix(value: int) -> int:
    """splitmix64's finaliser: every input bit affects every output bit."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


_MASK64 = (1 << 64) - 1


def _expire(order: deque, times: dict, cutoff: float, *, inclusive: bool) -> None:
    """Pop the (time, replica, key) entries of ``order`` (in time order) up to ``cutoff`` (included or not), and drop
    each from ``times`` unless a later time replaced it there."""
    while order and (order[0][0] <= cutoff if inclusive else order[0][0] < cutoff):
        at, replica_id, key = order.popleft()
        if times.get((replica_id, key)) == at:
            del times[(replica_id, key)]


def _continues_any(tails: dict, num_pages: int, partial_key: PartialKey, length_to_key: dict) -> bool:
    """Whether a request with ``partial_key`` continues one of ``tails``, finished prompts whose full pages are its
    first ``num_pages``: a tail not known (None) may be this request's; a known one must equal this request's tokens
    after those pages over its length (``length_to_key`` keeps this request's keys by length, computed once)."""
    for tail in tails:
        if tail is None:
            return True
        if tail.num_tokens not in length_to_key:
            length_to_key[tail.num_tokens] = partial_key(num_pages, tail.num_tokens)
        if length_to_key[tail.num_tokens] == tail.key:
            return True
    return False


def _best(items: list, preference: Callable, anchor: PageKey, scored_of: Callable | None = None):
    """The item with the largest ``preference``; exact ties go to the higher tie score of its replica (computed only
    for the tied items: hashing every candidate would dominate the decision's cost)."""
    best_key = None
    tied: list = []
    for item in items:
        key = preference(item)
        if best_key is None or key > best_key:
            best_key, tied = key, [item]
        elif key == best_key:
            tied.append(item)
    if len(tied) == 1:
        return tied[0]
    scored_of = scored_of or (lambda item: item)
    return max(tied, key=lambda item: tie_score(anchor, scored_of(item).replica_id))


def _new_prefix_preference(scored: _Scored) -> tuple[int, int]:
    """For a prefix no eligible replica holds: fewer cached pages, then lower load (then the tie score)."""
    return (-scored.num_cached, -scored.load)


def _preference(scored: _Scored) -> tuple[int, int, int]:
    """Larger is better: more matched pages, then lower load, then fewer cached pages (then the tie score)."""
    return (scored.matched, -scored.load, -scored.num_cached)
