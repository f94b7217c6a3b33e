"""Prometheus metrics of the ingress, in its own ``CollectorRegistry`` (never the process-global one).

Two sources:

- measured here, per request: time to first token, routing decisions (which replica served, prefix hit or miss) and
  prompt / cached prompt tokens by source;
- read from the replicas at scrape time (``handle.broadcast("stats")``: one ``EngineStats`` per replica): prefix-cache
  queries and hits in tokens, pages total / free / cached / in use, running and waiting requests, evictions,
  preemptions. Each is labelled ``replica``; a replica that does not answer is left out of that scrape.

Names (all prefixed ``prefixserve_``)::

    time_to_first_token_seconds            histogram  measured at the ingress, from parsed request to first token
    routing_decisions_total{replica,cache} counter    cache = hit (some prompt tokens reused) | miss
    router_decisions_total{replica,reason} counter    the prefix-aware router's choices in this process (counted at
                                                      decision time): reason = prefix_hit | cost_away |
                                                      balanced_away | no_match | session_move (router/policy.py)
    router_session_events_total{replica,event}  counter  chats the router took for ended (event = idle) and idle chats
                                                      whose next turn came after all (resumed), by home replica
    prompt_tokens_total{replica}           counter    prompt tokens of finished requests
    cached_prompt_tokens_total{replica,source}  counter  reused prompt tokens, source = local|peer|host|disk
    prefix_cache_queries_total{replica}    counter    prompt tokens looked up in the replica's prefix cache
    prefix_cache_hits_total{replica}       counter    ... of which found cached
    kv_pages{replica,state}                gauge      state = total | free | cached | in_use
    num_requests_running{replica}          gauge
    num_requests_waiting{replica}          gauge
    kv_evictions_total{replica}            counter
    preemptions_total{replica}             counter
    requests_finished_total{replica}       counter
    kv_fetch_{pages,bytes,seconds,errors}_total{replica,source}   counter  source = peer | host | disk
    kv_tier_{pages_stored,bytes_stored,pages_dropped,discarded_corrupt,pages_evicted,errors,events_stored,
             events_removed,retention_updates,retention_updates_dropped,retention_expired,
             oom_refused}_total{replica,tier}  counter
    kv_tier_available{replica,tier}        gauge      1 while the shared tier answers
    kv_peer_pages_total{replica,transport} counter    transport = cuda_ipc (device to device) | shared_memory (a
                                                      peer's pool on this node) | host (Ray's object store) | tcp
                                                      (a peer on another node's page stream)
    kv_page_lifetime_seconds{replica}      histogram  cached -> evicted (like vLLM's --kv-cache-metrics)
    kv_page_idle_before_evict_seconds{replica}  histogram  last use -> evicted
    kv_page_reuse_gap_seconds{replica}     histogram  last use -> next prefix hit
    kv_page_evictions_total{replica,reason,priority}  counter  reason = capacity | ttl | reset
    kv_retained_pages{replica,kind}        gauge      kind = retained (priority > 0, TTL not expired) | budget
    kv_retention_demotions_total{replica,reason}      counter  retention ended: ttl | budget | unpin | reset
    rejected_requests_total{reason}        counter    refused before generating: invalid_request (400),
                                                      request_too_large (413), overloaded (429), unauthorized (401),
                                                      shutting_down (503 while draining), ...
    aborted_requests_total{reason}         counter    ended before finishing: client_gone, deadline, shutdown,
                                                      replica_lost (mid-stream)
    retried_requests_total                 counter    sent again to another replica after theirs was lost
                                                      before the first token
    drained_requests_total{outcome}        counter    in flight at SIGTERM: completed | aborted (past the timeout)
    streamed_outputs_total{path}           counter    outputs the ingress received from the replicas: on the request's
                                                      own stream (request) or on an output channel (channel)
    lane_requests_total{path}              counter    generation requests sent to a replica: on a request lane (lane)
                                                      or through Serve's handle (handle); busy: those of the lane
                                                      ones whose replica was full, sent on through the handle
    output_channel_messages_total          counter    output-channel messages (one per engine step and replica, for
                                                      all of this ingress's requests there)
    hot_prefix_copies_total{outcome}       counter    hot-prefix replication (the ingress's planner): copies
                                                      planned | started | done | cancelled | failed
    hot_prefix_copy_pages_total{stage}     counter    pages of those copies: started (budget) | copied (reported)
    hot_prefix_prefetches_total{replica,outcome}  counter  copies a target replica answered: ok | failed
    hot_prefix_pages_total{replica,kind}   counter    pages a target replica copied ahead of need | found present
    hot_prefix_hit_pages_total{replica}    counter    local prefix-cache hits on pages that arrived by a proactive copy
    hot_prefix_hit_requests_total{replica} counter    requests whose local hit included such a page
"""

from __future__ import annotations

from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cluster.vllm_metrics import VllmMetrics
from common.types import EngineStats, KVSourceStats, RequestOutput
from router.decision_metrics import DECISIONS, SESSION_EVENTS, DecisionCounts
from router.policy import RoutingReason
from router.replication import ReplicationStats

PREFIX = "prefixserve_"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                10.0, 20.0, 60.0)


class ReplicaStatsCollector(Collector):
    """Exposes the replicas' latest ``EngineStats`` (replaced before each scrape)."""

    def __init__(self) -> None:
        self._stats: list[EngineStats] = []
        self._kv_sources: list[KVSourceStats] = []

    def set(self, stats: Iterable[EngineStats], kv_sources: Iterable[KVSourceStats] = ()) -> None:
        self._stats = sorted(stats, key=lambda s: s.replica_id)
        self._kv_sources = sorted(kv_sources, key=lambda report: report.replica_id)

    def collect(self):
        counters = {
            "prefix_cache_queries": ("prompt tokens looked up in the prefix cache", "num_prompt_tokens_queried"),
            "prefix_cache_hits": ("prompt tokens found in the prefix cache", "num_prompt_tokens_hit"),
            "kv_evictions": ("cached pages evicted", "num_evictions"),
            "preemptions": ("requests preempted for lack of pages", "num_preemptions"),
            "requests_finished": ("requests finished by the replica", "num_requests_finished"),
        }
        for name, (documentation, attribute) in counters.items():
            family = CounterMetricFamily(PREFIX + name, documentation, labels=["replica"])
            for stats in self._stats:
                family.add_metric([stats.replica_id], getattr(stats, attribute))
            yield family
        pages = GaugeMetricFamily(PREFIX + "kv_pages", "KV pages of the replica by state", labels=["replica", "state"])
        running = GaugeMetricFamily(PREFIX + "num_requests_running", "requests running", labels=["replica"])
        waiting = GaugeMetricFamily(PREFIX + "num_requests_waiting", "requests waiting", labels=["replica"])
        for stats in self._stats:
            for state, value in (("total", stats.num_pages_total), ("free", stats.num_pages_free),
                                 ("cached", stats.num_pages_cached), ("in_use", stats.num_pages_in_use)):
                pages.add_metric([stats.replica_id, state], value)
            running.add_metric([stats.replica_id], stats.num_running)
            waiting.add_metric([stats.replica_id], stats.num_waiting)
        yield from (pages, running, waiting)
        yield from self._collect_kv_cache_metrics()
        yield from self._collect_kv_sources()

    def _collect_kv_cache_metrics(self):
        """Page-time histograms, evictions by reason and priority, retention gauges (``EngineStats.kv_cache``)."""
        reports = [(stats.replica_id, stats.kv_cache) for stats in self._stats if stats.kv_cache is not None]
        histograms = {"kv_page_lifetime_seconds": ("seconds a page stayed cached, until evicted", "lifetime"),
                      "kv_page_idle_before_evict_seconds": ("seconds since a page's last use when evicted",
                                                            "idle_before_evict"),
                      "kv_page_reuse_gap_seconds": ("seconds between a cached page's uses", "reuse_gap")}
        for name, (documentation, attribute) in histograms.items():
            family = HistogramMetricFamily(PREFIX + name, documentation, labels=["replica"])
            for replica_id, metrics in reports:
                histogram = getattr(metrics, attribute)
                cumulative, buckets = 0, []
                for bound, count in zip(list(histogram.bounds) + [float("inf")], histogram.counts):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
                family.add_metric([replica_id], buckets, histogram.total)
            yield family
        evictions = CounterMetricFamily(PREFIX + "kv_page_evictions", "cached pages evicted, by reason and priority",
                                        labels=["replica", "reason", "priority"])
        demotions = CounterMetricFamily(PREFIX + "kv_retention_demotions", "page retentions ended, by reason",
                                        labels=["replica", "reason"])
        retained = GaugeMetricFamily(PREFIX + "kv_retained_pages", "pages holding a retention, and the budget",
                                     labels=["replica", "kind"])
        protected = GaugeMetricFamily(PREFIX + "kv_protected_pages", "free reused pages in the segmented LRU's "
                                      "protected queue, and its bound", labels=["replica", "kind"])
        protected_demotions = CounterMetricFamily(PREFIX + "kv_protected_demotions", "protected pages sent back to "
                                                  "probation by a full protected queue", labels=["replica"])
        for replica_id, metrics in reports:
            for (reason, priority), count in sorted(metrics.evictions.items()):
                evictions.add_metric([replica_id, reason, str(priority)], count)
            for reason, count in sorted(metrics.retention_demotions.items()):
                demotions.add_metric([replica_id, reason], count)
            retained.add_metric([replica_id, "retained"], metrics.num_retained_pages)
            retained.add_metric([replica_id, "budget"], metrics.max_retained_pages)
            protected.add_metric([replica_id, "protected"], metrics.num_protected_pages)
            protected.add_metric([replica_id, "max"], metrics.max_protected_pages)
            protected_demotions.add_metric([replica_id], metrics.protected_demotions)
        yield from (evictions, demotions, retained, protected, protected_demotions)

    def _collect_kv_sources(self):
        """Pages, bytes and seconds obtained per path (peer copy, host tier, disk tier), and the tiers' health."""
        fetch_fields = {"pages": "pages obtained", "bytes": "KV bytes obtained", "seconds": "seconds spent obtaining",
                        "errors": "failed attempts (fell back to the next source)"}
        for field_name, documentation in fetch_fields.items():
            family = CounterMetricFamily(PREFIX + f"kv_fetch_{field_name}",
                                         f"prompt pages from outside the replica: {documentation}",
                                         labels=["replica", "source"])
            for report in self._kv_sources:
                for source, values in report.fetch.items():
                    family.add_metric([report.replica_id, source.value], getattr(values, field_name))
            yield family
        tier_fields = {"pages_stored": "pages written", "bytes_stored": "KV bytes written",
                       "pages_dropped": "pages not written (queue full or store unreachable)",
                       "discarded_corrupt": "entries discarded as corrupt, stale or foreign",
                       "pages_evicted": "entries this tier deleted to stay within its budget (disk; Redis evicts "
                                        "on its own)",
                       "errors": "failed operations against the store",
                       "events_stored": "pages announced as stored in KV events (--kv-events-config)",
                       "events_removed": "pages announced as removed in KV events (evicted, expired or deleted)",
                       "retention_updates": "retention changes (pin, unpin, retention of stored pages) applied",
                       "retention_updates_dropped": "retention changes not applied (queue full or command failed)",
                       "retention_expired": "retained pages that became plain LRU again here (ended or demoted)",
                       "oom_refused": "page writes the store refused for lack of memory (Redis: only retained "
                                      "pages left)"}
        for field_name, documentation in tier_fields.items():
            family = CounterMetricFamily(PREFIX + f"kv_tier_{field_name}", f"shared tier: {documentation}",
                                         labels=["replica", "tier"])
            for report in self._kv_sources:
                for tier, tier_report in report.tiers.items():
                    family.add_metric([report.replica_id, tier], getattr(tier_report.stats, field_name))
            yield family
        peer_counters = (
            ("kv_peer_pages", "transport", "peer_transport",
             "pages copied from a peer, by transport: cuda_ipc (device to device) | "
             "shared_memory (from the pool of a CPU peer on this node) | host (through Ray's object store) | "
             "tcp (from a peer on another node, over its page stream)"),
            ("kv_peer_export_calls", "path", "peer_export_calls",
             "peer copy: calls asking a holder for its pages, by path: handle (through Ray) | "
             "socket (the holder's export socket on this node) | socket_failed (then through Ray) | "
             "stream (a holder on another node's page stream) | stream_failed (then through Ray)"),
        )
        for metric, label, report_field, documentation in peer_counters:
            family = CounterMetricFamily(PREFIX + metric, documentation, labels=["replica", label])
            for report in self._kv_sources:
                for name, value in getattr(report, report_field).items():
                    family.add_metric([report.replica_id, name], value)
            yield family
        available = GaugeMetricFamily(PREFIX + "kv_tier_available", "1 while the shared tier answers",
                                      labels=["replica", "tier"])
        for report in self._kv_sources:
            for tier, tier_report in report.tiers.items():
                available.add_metric([report.replica_id, tier], int(tier_report.available))
        yield available


class RouterDecisionsCollector(Collector):
    """The routing decisions of the prefix-aware routers in this process (``router.decision_metrics``), by chosen
    replica and reason, and their session events by home replica; every reason and event is exported (at 0) for each
    replica seen, so rate() queries have a series."""

    def __init__(self, counts: DecisionCounts = DECISIONS, session_events: DecisionCounts = SESSION_EVENTS) -> None:
        self.counts = counts
        self.session_events = session_events

    def collect(self):
        family = CounterMetricFamily(PREFIX + "router_decisions",
                                     "routing decisions of the prefix-aware router, by chosen replica and reason",
                                     labels=["replica", "reason"])
        totals = self.counts.by_replica()
        decided = {replica_id for replica_id, _ in totals}
        for replica_id in sorted(decided):
            for reason in RoutingReason:
                family.add_metric([replica_id, reason.value], totals.get((replica_id, reason.value), 0))
        yield family
        sessions = CounterMetricFamily(PREFIX + "router_session_events",
                                       "chats the router took for ended (idle) and idle chats that went on (resumed), "
                                       "by home replica", labels=["replica", "event"])
        events = self.session_events.by_replica()
        for replica_id in sorted(decided | {replica_id for replica_id, _ in events}):
            for event in ("idle", "resumed"):
                sessions.add_metric([replica_id, event], events.get((replica_id, event), 0))
        yield sessions


class HotPrefixCollector(Collector):
    """Hot-prefix replication: the planner's copies (this ingress) and each replica's proactive pages and their hits."""

    def __init__(self) -> None:
        self._planner: ReplicationStats | None = None
        self._stats: list[EngineStats] = []

    def set(self, planner: ReplicationStats | None, stats: Iterable[EngineStats]) -> None:
        self._planner = planner
        self._stats = sorted((s for s in stats if s.proactive is not None), key=lambda s: s.replica_id)

    def collect(self):
        copies = CounterMetricFamily(PREFIX + "hot_prefix_copies", "hot-prefix copies by outcome (planner)",
                                     labels=["outcome"])
        pages = CounterMetricFamily(PREFIX + "hot_prefix_copy_pages", "pages of hot-prefix copies: started | copied",
                                    labels=["stage"])
        planner = self._planner
        if planner is not None:
            for outcome in ("planned", "started", "done", "cancelled", "failed"):
                copies.add_metric([outcome], getattr(planner, f"num_{outcome}"))
            pages.add_metric(["started"], planner.num_pages_started)
            pages.add_metric(["copied"], planner.num_pages_copied)
        prefetches = CounterMetricFamily(PREFIX + "hot_prefix_prefetches", "proactive copies a replica answered",
                                         labels=["replica", "outcome"])
        replica_pages = CounterMetricFamily(PREFIX + "hot_prefix_pages",
                                            "pages a replica copied ahead of need | found already cached",
                                            labels=["replica", "kind"])
        hit_pages = CounterMetricFamily(PREFIX + "hot_prefix_hit_pages",
                                        "local prefix-cache hits on pages that arrived by a proactive copy",
                                        labels=["replica"])
        hit_requests = CounterMetricFamily(PREFIX + "hot_prefix_hit_requests",
                                           "requests whose local hit included a proactively copied page",
                                           labels=["replica"])
        for stats in self._stats:
            report = stats.proactive
            prefetches.add_metric([stats.replica_id, "ok"], report.num_prefetches - report.num_failed)
            prefetches.add_metric([stats.replica_id, "failed"], report.num_failed)
            replica_pages.add_metric([stats.replica_id, "copied"], report.num_pages_copied)
            replica_pages.add_metric([stats.replica_id, "present"], report.num_pages_present)
            hit_pages.add_metric([stats.replica_id], report.num_hit_pages)
            hit_requests.add_metric([stats.replica_id], report.num_hit_requests)
        yield from (copies, pages, prefetches, replica_pages, hit_pages, hit_requests)


class IngressMetrics:
    """The ingress's registry; ``observe_*`` are O(1) and called on the request path."""

    def __init__(self, model_name: str = "unknown") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "time from a parsed request to its first generated token, measured at the ingress",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.routing_decisions = Counter(
            PREFIX + "routing_decisions",
            "requests served per replica, by whether some prompt tokens were reused",
            ["replica", "cache"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "prompt tokens of finished requests", ["replica"], registry=self.registry
        )
        self.cached_prompt_tokens = Counter(
            PREFIX + "cached_prompt_tokens",
            "reused prompt tokens of finished requests by source",
            ["replica", "source"],
            registry=self.registry,
        )
        self.rejected = Counter(PREFIX + "rejected_requests", "requests refused before generating, by reason",
                                ["reason"], registry=self.registry)
        self.aborted = Counter(PREFIX + "aborted_requests", "requests ended before finishing, by reason", ["reason"],
                               registry=self.registry)
        self.retried = Counter(PREFIX + "retried_requests",
                               "requests sent again to another replica after theirs was lost before the first token",
                               registry=self.registry)
        self.streamed_outputs = Counter(PREFIX + "streamed_outputs", "outputs received from the replicas, by path",
                                        ["path"], registry=self.registry)
        self.lane_requests = Counter(PREFIX + "lane_requests", "generation requests sent to the replicas, by path",
                                     ["path"], registry=self.registry)
        self.channel_messages = Counter(PREFIX + "output_channel_messages",
                                        "output-channel messages received (one per engine step and replica)",
                                        registry=self.registry)
        self.drained = Counter(PREFIX + "drained_requests", "requests in flight at shutdown, by outcome",
                               ["outcome"], registry=self.registry)
        self.replica_stats = ReplicaStatsCollector()
        self.registry.register(self.replica_stats)
        self.registry.register(RouterDecisionsCollector())
        self.vllm = VllmMetrics(model_name)  # the same numbers under vLLM's names (cluster/vllm_metrics.py)
        self.registry.register(self.vllm)
        self.hot_prefix = HotPrefixCollector()
        self.registry.register(self.hot_prefix)

    def observe_first_token(self, seconds: float, output: RequestOutput | None = None) -> None:
        self.ttft.observe(seconds)
        self.vllm.observe_first_token(seconds, output)

    def observe_finished(self, output: RequestOutput) -> None:
        replica = output.replica_id or "unknown"
        cached = output.cached_tokens
        self.routing_decisions.labels(replica, "hit" if cached.total else "miss").inc()
        self.prompt_tokens.labels(replica).inc(output.num_prompt_tokens)
        for source, value in cached.as_dict().items():
            self.cached_prompt_tokens.labels(replica, source).inc(value)
        self.vllm.observe_finished(output)

    def observe_aborted(self, reason: str, replica_id: str | None, key: str | None = None) -> None:
        """A request ended before finishing (``reason``: client_gone, deadline, replica_lost, ...) on ``replica_id``
        (None: not known); ``key``: its engine request id."""
        self.aborted.labels(reason).inc()
        self.vllm.observe_aborted(reason, replica_id, key)

    def render(self, replica_stats: Sequence[EngineStats], kv_sources: Sequence[KVSourceStats] = (),
               hot_prefix: ReplicationStats | None = None) -> bytes:
        """Prometheus text exposition with ``replica_stats`` as the per-replica engine numbers, ``kv_sources``
        as each replica's ``kv_source_stats()`` and ``hot_prefix`` as the replication planner's counters (None: off)."""
        self.replica_stats.set(replica_stats, kv_sources)
        self.hot_prefix.set(hot_prefix, replica_stats)
        self.vllm.set_replicas(replica_stats)
        return generate_latest(self.registry)
