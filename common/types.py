"""Typed values that cross a process boundary: requests in, streamed outputs and stats out (no torch here).

    ingress --EngineRequest--> replica --RequestOutput*--> ingress        (one request)
    ingress --broadcast--> replica: EngineStats, KVSourceStats              (/metrics)
    ingress --info()--> replica: ReplicaInfo                                (once, at start-up)
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from dataclasses import dataclass, field

from common.page_keys import PageKey


class CacheSource(str, enum.Enum):
    """Where a reused prompt page came from (the order a replica tries them in)."""

    LOCAL = "local"
    """The replica's own prefix cache."""
    PEER = "peer"
    """Copied from another replica (cross-replica prefix copy)."""
    HOST = "host"
    """The shared host-memory tier (Redis)."""
    DISK = "disk"
    """The shared disk tier (Arrow IPC files)."""


FETCH_SOURCES = (CacheSource.PEER, CacheSource.HOST, CacheSource.DISK)
"""The sources outside the replica, in the order they are asked."""


STREAM_TOKEN_BYTES = 32
"""The length of a page stream's token."""


@dataclass(frozen=True)
class StreamLocation:
    """Where and how to ask a holder for pages over TCP (its page stream, replica/page_stream.py): its address, the
    token both sides prove they know, and the holder's node (``replica.shared_pool.node_id()``; a peer on that node
    copies out of the holder's shared memory instead)."""

    host: str
    port: int
    token: bytes
    node: str | None = None

    def __repr__(self) -> str:  # the token stays out of logs
        return f"StreamLocation({self.host}:{self.port})"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Generation stops before any of these strings; they are not included in the output text."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise ValueError(f"at most 16 stop strings are allowed, got {len(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


RETENTION_MAX_PRIORITY = 100
RETENTION_DEFAULT_PRIORITY = 50
"""Priority given when a request asks for retention without naming one (Anthropic-style ``cache_control``)."""
RETENTION_MAX_TTL_S = 24 * 3600.0
"""Longest TTL a request may ask for (OpenAI's ``prompt_cache_retention: "24h"``); admin pins may have none."""


@dataclass(frozen=True)
class Retention:
    """How long and how firmly to keep a prompt's prefix cached (the pages fully inside its first ``num_tokens``).

    Pages with a higher ``priority`` are evicted only after every lower-priority page; among equals, least recently used
    first. Priority 0 is the default eviction order (the segmented LRU of replica/page_pool.py). After ``ttl_s``
    seconds without a hit, a page drops back to priority 0 (each hit restarts the clock). ``ttl_s`` None: kept until
    unpinned (admin pins only)."""

    priority: int = RETENTION_DEFAULT_PRIORITY
    ttl_s: float | None = 300.0
    num_tokens: int | None = None
    """Prefix length in tokens the retention covers (a cache breakpoint); None: the whole prompt."""

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not (
                0 <= self.priority <= RETENTION_MAX_PRIORITY):
            raise ValueError(f"retention priority must be an integer in [0, {RETENTION_MAX_PRIORITY}], "
                             f"got {self.priority!r}")
        if self.ttl_s is not None and (isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float))
                                       or not 0 < self.ttl_s <= RETENTION_MAX_TTL_S):
            raise ValueError(f"retention ttl must be a number of seconds in (0, {RETENTION_MAX_TTL_S:.0f}], "
                             f"got {self.ttl_s!r}")
        if self.num_tokens is not None and (not isinstance(self.num_tokens, int) or self.num_tokens < 0):
            raise ValueError(f"retention num_tokens must be an integer >= 0, got {self.num_tokens!r}")

    def num_pages(self, num_prompt_tokens: int, page_size: int) -> int:
        """Full pages of the prompt the retention covers (a breakpoint inside a page leaves that page out)."""
        limit = num_prompt_tokens if self.num_tokens is None else min(self.num_tokens, num_prompt_tokens)
        return limit // page_size


@dataclass
class EngineRequest:
    """One generation request as the engine sees it: token ids in, tokens out."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    """Isolates a tenant's cache: folded into the key of page 0, so different salts never share pages."""
    page_keys: list[PageKey] | None = None
    """Keys of the prompt's full pages, computed once by the ingress. The replica checks their number and re-hashes
    page 0 against its own fingerprint and salt (a wrong fingerprint or salt changes every key), then uses them."""
    peer_hint: str | None = None
    """Id of a replica that the router believes holds more of this prompt's pages (for peer copy)."""
    peer_stream: StreamLocation | None = None
    """``peer_hint``'s page stream, as its routing stats name it (set by the router only, with ``peer_hint``): a
    replica on another node asks there at once instead of first through Ray's object store."""
    target_replica: str | None = None
    """Pin the request to this replica (operators, tests); the router still names the best holder in peer_hint."""
    avoid_replica: str | None = None
    """A replica that answered "busy" to this request on its request lane (cluster/request_lanes.py): the router sends
    it elsewhere when another replica is there, and does not count its demand again."""
    retention: Retention | None = None
    """Keep the prompt's prefix cached with this priority and TTL (None: the default eviction order)."""
    output_channel: str | None = None
    """The caller's output channel (``OutputChannelRequest.channel_id``): when the replica serving this request has
    that channel open, the outputs after the first go there, batched with the other requests' outputs of each step,
    instead of one message per output on this request's own stream. None: every output on the request's stream."""


@dataclass(frozen=True)
class OutputChannelRequest:
    """Open an output channel from one replica to its caller: a stream of ``list[RequestOutput]``, one message per
    engine step (or fewer, when the caller reads slower) carrying the outputs of every request that named
    ``channel_id`` in ``EngineRequest.output_channel``. Routed to ``target_replica`` only."""

    channel_id: str
    target_replica: str


@dataclass(frozen=True)
class LaneOpen:
    """Open a request lane from the caller to ``target_replica`` (replica/request_lane.py): a stream whose first
    message names the replica's lane server (a ``StreamLocation``, or nothing when it serves none), then held open
    until the lane ``lane_id`` closes. Routed to ``target_replica`` only."""

    target_replica: str
    lane_id: str


@dataclass(frozen=True)
class CachedTokens:
    """Where a request's reused prompt tokens came from."""

    local: int = 0
    peer: int = 0
    host: int = 0
    disk: int = 0

    @classmethod
    def of(cls, by_source: dict[CacheSource, int]) -> "CachedTokens":
        return cls(**{source.value: num for source, num in by_source.items()})

    @property
    def total(self) -> int:
        return self.local + self.peer + self.host + self.disk

    def as_dict(self) -> dict[str, int]:
        return {"local": self.local, "peer": self.peer, "host": self.host, "disk": self.disk}


@dataclass(frozen=True)
class RequestOutput:
    """A streamed increment of one request. The last one has ``finished=True`` and a ``finish_reason``."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    """"stop" (EOS, stop token or stop string), "length" (max_tokens or max_model_len) or "abort"."""
    num_prompt_tokens: int
    num_output_tokens: int
    cached_tokens: CachedTokens
    replica_id: str = ""
    cache_write_tokens: int = 0
    """Prompt tokens this request computed and wrote into the prefix cache (full pages new to the cache)."""
    via_channel: bool = False
    """Set on a request's first output only: its later outputs come on the caller's output channel (the request's
    own stream then ends without another output)."""


@dataclass(frozen=True)
class EngineStats:
    """Counters of one replica's engine (monotonic counters are totals since start)."""

    replica_id: str
    num_prompt_tokens_queried: int
    num_prompt_tokens_hit: int
    num_pages_total: int
    num_pages_free: int
    num_pages_cached: int
    num_pages_in_use: int
    num_evictions: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    num_requests_finished: int
    page_size: int
    kv_cache: "KVCacheMetrics | None" = None
    """Page lifetime, idle-before-evict, reuse gaps, evictions by reason and priority (None from older replicas)."""
    proactive: "ProactiveCopyStats | None" = None
    """Hot-prefix replication on this replica: prefixes copied here ahead of need and the hits on them."""
    latency: "RequestLatencyStats | None" = None
    """Inter-token, queue, prefill and decode times measured on the engine thread (None from older replicas)."""
    num_prompt_tokens_hit_local: int | None = None
    """The part of ``num_prompt_tokens_hit`` found in this replica's own pages (vLLM's ``prefix_cache_hits``; pages
    from a peer or a tier are its ``external_prefix_cache_hits``). None from older replicas."""


PAGE_TIME_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 4 * 3600.0)
"""Upper bounds in seconds of the page-time histograms (the last bucket, +Inf, is implied)."""


@dataclass
class TimeHistogram:
    """A fixed-bucket histogram of durations; ``counts[i]`` counts values <= ``bounds[i]`` and > the bound before
    (``counts[-1]``: above the last bound). Not cumulative; the Prometheus renderer accumulates."""

    bounds: tuple[float, ...] = PAGE_TIME_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(PAGE_TIME_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(self.bounds, seconds)  # the first bound >= seconds (le semantics)
        self.counts[index] += 1
        self.total += seconds
        self.count += 1

    def copy(self) -> "TimeHistogram":
        return TimeHistogram(self.bounds, list(self.counts), self.total, self.count)


VLLM_INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                                    10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                                240.0, 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's default buckets (``vllm/v1/metrics/buckets.py``) for inter-token and per-request latencies."""


def _itl_histogram() -> TimeHistogram:
    return TimeHistogram(VLLM_INTER_TOKEN_LATENCY_BUCKETS, [0] * (len(VLLM_INTER_TOKEN_LATENCY_BUCKETS) + 1))


def _request_histogram() -> TimeHistogram:
    return TimeHistogram(VLLM_REQUEST_LATENCY_BUCKETS, [0] * (len(VLLM_REQUEST_LATENCY_BUCKETS) + 1))


@dataclass
class RequestLatencyStats:
    """Engine-side request timings of one replica since start (vLLM measures these from its engine core's
    timestamps too), all on the replica's monotonic clock:

        add() (queued) --queue-- first scheduled --prefill-- token 1 --itl-- token 2 --itl-- ... token n
                                                              |<------------- decode ------------>|

    ``inter_token``: one observation per token after the first, the time since the request's previous token: an
    engine step produces at most one token per request, so each is one step-to-step interval, however the HTTP path
    later coalesces tokens into messages. ``queue`` / ``prefill`` / ``decode`` / ``time_per_output_token``
    (decode / (n - 1)) are observed once per request that finished in the engine (stop or length; a preemption's
    recompute stays inside the phase it hit, as in vLLM)."""

    inter_token: TimeHistogram = field(default_factory=_itl_histogram)
    time_per_output_token: TimeHistogram = field(default_factory=_itl_histogram)
    queue: TimeHistogram = field(default_factory=_request_histogram)
    prefill: TimeHistogram = field(default_factory=_request_histogram)
    decode: TimeHistogram = field(default_factory=_request_histogram)

    def copy(self) -> "RequestLatencyStats":
        return RequestLatencyStats(self.inter_token.copy(), self.time_per_output_token.copy(), self.queue.copy(),
                                   self.prefill.copy(), self.decode.copy())


@dataclass
class KVCacheMetrics:
    """What vLLM's ``--kv-cache-metrics`` reports, for one replica since start (a snapshot when sent).

    lifetime: cached (committed) -> evicted; idle_before_evict: last use -> evicted; reuse_gap: last use -> next hit.
    ``evictions``: (reason, priority) -> pages; reason = capacity (room for new tokens) | ttl (its retention expired,
    then room was needed) | reset (reset_prefix_cache). ``priority`` is the page's retention priority (0: plain LRU)."""

    lifetime: TimeHistogram = field(default_factory=TimeHistogram)
    idle_before_evict: TimeHistogram = field(default_factory=TimeHistogram)
    reuse_gap: TimeHistogram = field(default_factory=TimeHistogram)
    evictions: dict[tuple[str, int], int] = field(default_factory=dict)
    num_retained_pages: int = 0
    """Pages whose retention (priority > 0, TTL not expired) holds now."""
    max_retained_pages: int = 0
    """The replica's retention budget in pages (--kv-cache-retention-budget)."""
    retention_demotions: dict[str, int] = field(default_factory=dict)
    """Pages whose retention ended, by why: ttl | budget (a higher priority needed the room) | unpin."""
    num_protected_pages: int = 0
    """Free cached pages in the segmented LRU's protected queue now (reused pages, evicted after the others)."""
    max_protected_pages: int = 0
    """Its bound (--kv-cache-protected-fraction of the pages)."""
    protected_demotions: int = 0
    """Protected pages sent back to probation because the protected queue was full."""

    def copy(self) -> "KVCacheMetrics":
        return dataclasses.replace(self, lifetime=self.lifetime.copy(), idle_before_evict=self.idle_before_evict.copy(),
                                   reuse_gap=self.reuse_gap.copy(), evictions=dict(self.evictions),
                                   retention_demotions=dict(self.retention_demotions))


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs to know about the replicas once, at start-up (every replica answers the same)."""

    replica_id: str
    served_model_name: str
    model_fingerprint: str
    """Folded into every page key: the ingress must compute keys with the replicas' fingerprint."""
    max_model_len: int
    page_size: int
    enable_prefix_caching: bool
    vocab_size: int
    """Token ids in a prompt must be in ``[0, vocab_size)``."""
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)
    """The tokenizer as ``save_pretrained`` writes it (file name -> bytes): the ingress loads it from these, so it
    needs neither the model's folder on its node nor torch."""


@dataclass
class SourceStats:
    """Prompt pages a replica obtained from one source outside itself (peer, host, disk), since start."""

    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    errors: int = 0
    """Failed attempts (the request fell back to the next source)."""


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier since it was created (a snapshot; see ``KVTier.stats``)."""

    pages_loaded: int = 0
    bytes_loaded: int = 0
    """KV bytes of the pages returned by ``load`` (headers not included)."""
    pages_stored: int = 0
    bytes_stored: int = 0
    pages_dropped: int = 0
    """Pages given to ``store`` that were not written: queue full, tier unavailable or refused, write failed."""
    discarded_corrupt: int = 0
    """Entries deleted by ``load``: truncated, corrupt, foreign format, or other token ids than expected."""
    pages_evicted: int = 0
    """Entries this tier deleted to stay within its budget (disk tier; Redis evicts on its own)."""
    errors: int = 0
    """Failed operations against the store (connection refused, timeout, I/O error)."""
    load_seconds: float = 0.0
    """Wall time spent in ``load`` (caller's thread)."""
    store_seconds: float = 0.0
    """Wall time the background writer spent writing."""
    events_stored: int = 0
    """Pages this replica announced as stored in the tier (KV events, ``--kv-events-config``; replica/tiers/events.py)."""
    events_removed: int = 0
    """Of those, pages announced as removed (evicted, expired or deleted by anyone)."""
    retention_updates: int = 0
    """Retention changes (pin, unpin, a retention given to pages already stored) applied to pages this tier held."""
    retention_updates_dropped: int = 0
    """Retention changes not applied: queue full, tier unavailable, or the command failed."""
    retention_expired: int = 0
    """Retained pages whose retention ended here and that became plain LRU again (Redis: the sweeper's work)."""
    oom_refused: int = 0
    """Writes the store refused for lack of memory (Redis ``OOM`` under a ``volatile-*`` policy when only retained
    pages are left); the pages are dropped and the lowest-priority retentions are ended so later writes fit."""


@dataclass(frozen=True)
class TierReport:
    """One shared tier's counters and whether it answers now."""

    stats: TierStats
    available: bool


@dataclass(frozen=True)
class KVSourceStats:
    """One replica's KV traffic with the world outside it, for /metrics."""

    replica_id: str
    fetch: dict[CacheSource, SourceStats] = field(default_factory=dict)
    tiers: dict[str, TierReport] = field(default_factory=dict)
    """By tier name ("host", "disk")."""
    peer_transport: dict[str, int] = field(default_factory=dict)
    """Pages copied from peers by transport: "cuda_ipc" (device to device), "shared_memory" (straight from the pool
    of a CPU peer on this node) or "host" (through the object store)."""
    peer_export_calls: dict[str, int] = field(default_factory=dict)
    """Export calls to holders by path: "handle" (through Ray), "socket" (a holder's export socket on this node),
    "socket_failed" (then asked through Ray)."""


@dataclass(frozen=True)
class PinPrefix:
    """Admin: keep the prefix with these page keys cached on every replica (pages cached later are retained too)."""

    page_keys: tuple[PageKey, ...]
    priority: int = RETENTION_MAX_PRIORITY
    ttl_s: float | None = None
    """None: until unpinned."""
    label: str = ""
    """The start of the prompt text, for listings."""
    pin_id: str = ""
    """Names this pin call, so that a take-back (its warm-up failed) undoes this pin and no later one."""


@dataclass(frozen=True)
class PrefixReport:
    """One retained prefix as one replica sees it (the admin endpoint merges the replicas' reports)."""

    replica_id: str
    prefix_id: str
    source: str
    """"admin" or "request"."""
    label: str
    priority: int
    ttl_s: float | None
    num_pages: int
    num_pages_resident: int
    """Leading pages of the prefix in this replica's cache now."""
    num_pages_retained: int
    """... of which hold a retention now."""
    num_requests: int
    num_hits: int
    cached_tokens: int
    idle_s: float
    """Seconds since a request last used it here."""
    tiers: tuple[tuple[str, int, int], ...] = ()
    """(tier name, leading pages of the prefix the shared tier holds, of which retained) per tier this replica uses
    (the tiers are shared: every replica pointed at one sees the same)."""
    page_keys: tuple[bytes, ...] = field(default=(), repr=False, compare=False)
    """The prefix's page keys, inside the replica only (``AsyncEngine.prefix_reports`` asks the tiers about them and
    drops them before the report leaves the replica)."""


# ---- hot-prefix replication (router/replication.py plans, the ingress sends, the target replica copies) ------------
@dataclass(frozen=True)
class PrefetchRequest:
    """Copy a prompt prefix's full pages from the replica ``peer_hint`` into ``target_replica``'s prefix cache, ahead
    of the requests that will need them (no compute). The router sends a request carrying ``target_replica`` to exactly
    that replica. The target hashes the page keys itself from ``token_ids`` (its fingerprint, ``cache_salt``) and
    checks every copied page's key and token ids, as every peer copy does."""

    copy_id: str
    target_replica: str
    peer_hint: str
    token_ids: list[int]
    """The prompt the prefix was seen in; its first ``num_pages`` full pages are copied."""
    num_pages: int
    cache_salt: str | None = None
    peer_stream: StreamLocation | None = None
    """``peer_hint``'s page stream, as its routing stats name it (set by the router only, as on ``EngineRequest``)."""


@dataclass(frozen=True)
class PrefetchResult:
    """What a ``prefetch_prefix`` call did on the target replica."""

    replica_id: str
    num_pages: int
    """Pages of the prefix asked for."""
    num_pages_present: int = 0
    """... already cached here before the copy."""
    num_pages_copied: int = 0
    """... copied from the peer (or a shared tier) and cached here now."""
    error: str | None = None
    """Why nothing (or less than asked) was copied: peer copy off, wrong replica, the peer had no pages, no room."""


@dataclass
class ProactiveCopyStats:
    """One replica's side of hot-prefix replication, since start."""

    num_prefetches: int = 0
    """``prefetch_prefix`` calls answered."""
    num_failed: int = 0
    """... that copied nothing they were asked for (error set)."""
    num_pages_copied: int = 0
    """Pages that arrived by a proactive copy and entered the prefix cache."""
    num_pages_present: int = 0
    """Pages a proactive copy found already cached (nothing to do)."""
    num_hit_pages: int = 0
    """Local prefix-cache hits of requests on pages that arrived by a proactive copy (a page hit by three requests
    counts three)."""
    num_hit_requests: int = 0
    """Requests whose local hit included at least one such page."""
