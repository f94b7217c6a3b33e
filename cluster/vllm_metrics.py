"""vLLM's metric names on our /metrics, so dashboards, alerts and probes written for vLLM work unchanged.

Same names, types, units and label conventions as vLLM's Prometheus logger (``vllm/v1/metrics/loggers.py``): every
series carries ``model_name`` (the served model name) and ``engine`` (vLLM: the engine index; here the replica id
that served the request, the same string as our ``replica`` label), and the histograms use vLLM's default buckets.
They are a second view of what cluster/metrics.py measures; the ``prefixserve_*`` series are unchanged::

    vllm:* name (type)                            read from         equals, per replica (prefixserve_*)
    prefix_cache_queries_total (counter)          EngineStats       prefix_cache_queries_total
    prefix_cache_hits_total (counter)             EngineStats       the local part of prefix_cache_hits_total (as
                                                                    vLLM: external hits are counted below)
    num_requests_running, _waiting (gauges)       EngineStats       num_requests_running, _waiting
    kv_cache_usage_perc (gauge, 0..1)             EngineStats       kv_pages{state="in_use"} / kv_pages{state="total"}
    num_preemptions_total (counter)               EngineStats       preemptions_total
    prompt_tokens_total (counter)                 finished request  prompt_tokens_total
    prompt_tokens_cached_total (counter)          finished request  cached_prompt_tokens_total, summed over sources
    prompt_tokens_cached_by_source_total          finished request  cached_prompt_tokens_total{source=local|peer|
        {source=device|p2p|host|disk}                                 host|disk}
    prompt_tokens_by_source_total{source=         finished request  prompt - cached; local; peer + host + disk
        local_compute|local_cache_hit|external_kv_transfer}
    generation_tokens_total (counter)             finished request
    external_prefix_cache_queries_total           finished request  prompt - local cached tokens (what the local
        (counter)                                                     cache missed and the peer / host / disk
                                                                    sources were asked for)
    external_prefix_cache_hits_total (counter)    finished request  cached_prompt_tokens_total{source=peer|host|disk}
    request_success_total{finished_reason=        finished request  routing_decisions_total, summed over cache
        stop|length}
    request_success_total{finished_reason=        ingress           aborted_requests_total: client_gone, deadline,
        abort|error}                                                  cancelled, shutdown -> abort; replica_lost,
                                                                    replica_ended, error -> error (where known, the
                                                                    replica that was serving it, else "unknown")
    time_to_first_token_seconds (histogram)       ingress           time_to_first_token_seconds
    e2e_request_latency_seconds (histogram)       ingress           (parsed request -> last token)
    inter_token_latency_seconds (histogram)       EngineStats       one observation per output token after the
                                                                    first: the time since that request's previous
                                                                    token, on the engine thread
    request_time_per_output_token_seconds         EngineStats       decode time / (tokens - 1), once per request
    request_queue_time_seconds (histogram)        EngineStats       queued in the engine -> first scheduled
    request_prefill_time_seconds (histogram)      EngineStats       first scheduled -> first token
    request_decode_time_seconds (histogram)       EngineStats       first token -> last token

TTFT and e2e latency are measured at the ingress (vLLM measures them in its API server process). The engine-side
times (common/types.py ``RequestLatencyStats``) come from the replica's engine thread, as vLLM's come from its engine
core's timestamps: an inter-token interval is the time between two engine steps that each produced one token of the
request. The Serve stream between replica and ingress coalesces tokens that queue up while the ingress is busy into
one message; that changes when the client sees them, not these intervals (a client-side ITL, SSE chunk to chunk, is
what ``prefixserve bench`` reports). As vLLM does, ``request_success`` has a series for every finish reason of every
replica from the start (0 until it happens).
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from typing import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from common.types import (VLLM_INTER_TOKEN_LATENCY_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS, EngineStats, RequestOutput,
                          TimeHistogram)

TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = VLLM_INTER_TOKEN_LATENCY_BUCKETS
REQUEST_LATENCY_BUCKETS = VLLM_REQUEST_LATENCY_BUCKETS
"""vLLM's default buckets (``vllm/v1/metrics/buckets.py``)."""
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's ``FINISH_REASON_STRINGS``: every replica gets a ``request_success`` series for each."""
ABORT_REASON_TO_FINISH_REASON = {"replica_lost": "error", "replica_ended": "error", "error": "error"}
"""Our ``aborted_requests`` reasons that are vLLM's "error" (a request-level internal failure); the others (the
client went away, the deadline, a cancel, shutdown) are "abort"."""
ENGINE_HISTOGRAMS = {
    "inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", "inter_token"),
    "request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                              "time_per_output_token"),
    "request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.", "queue"),
    "request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.", "prefill"),
    "request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.", "decode"),
}
"""vLLM's engine-side histograms -> ``RequestLatencyStats`` attributes (measured on the replicas)."""
SOURCE_TO_VLLM_CACHE_SOURCE = {"local": "device", "peer": "p2p", "host": "host", "disk": "disk"}
"""Our CacheSource values -> vLLM's ``CacheHitSource`` label values."""
MAX_TRACKED_REQUESTS = 65536
"""Requests between first token and finish whose timing is kept; beyond it the oldest are forgotten (a client that
went away mid-stream never finishes)."""


class BucketCounts:
    """One histogram series: counts per upper bound (not cumulative), sum and count."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Record ``value`` ``times`` times (O(log buckets), whatever ``times`` is)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def cumulative(self) -> list[tuple[str, int]]:
        running, out = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += count
            out.append((bound, running))
        return out


class VllmMetrics(Collector):
    """The vLLM-named series (module docstring). ``observe_*`` are O(1) and run on the ingress's event loop;
    ``set_replicas`` replaces the replicas' numbers before each scrape; ``collect`` renders everything."""

    HISTOGRAMS = {
        "time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS),
        "e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    }
    """Measured at the ingress; the engine-side ones are ``ENGINE_HISTOGRAMS``."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._histograms: dict[tuple[str, str], BucketCounts] = {}
        self._counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self._request_to_started: OrderedDict[str, float] = OrderedDict()
        self._stats: list[EngineStats] = []

    # ---- observations ----------------------------------------------------------------------------------------------
    def observe_first_token(self, seconds: float, output: RequestOutput | None) -> None:
        """The first output of a request arrived ``seconds`` after it was parsed."""
        engine = (output.replica_id if output is not None else "") or "unknown"
        self._histogram("time_to_first_token_seconds", engine).observe(seconds)
        if output is None:
            return
        self._request_to_started[output.request_id] = time.perf_counter() - seconds
        while len(self._request_to_started) > MAX_TRACKED_REQUESTS:
            self._request_to_started.popitem(last=False)

    def observe_finished(self, output: RequestOutput) -> None:
        """The last output of a request (``finished``)."""
        engine = output.replica_id or "unknown"
        cached = output.cached_tokens.as_dict()
        num_cached = sum(cached.values())
        self._add("request_success", (engine, output.finish_reason or "stop"), 1)
        self._add("prompt_tokens", (engine,), output.num_prompt_tokens)
        self._add("generation_tokens", (engine,), output.num_output_tokens)
        self._add("prompt_tokens_cached", (engine,), num_cached)
        for source, value in cached.items():
            self._add("prompt_tokens_cached_by_source", (engine, SOURCE_TO_VLLM_CACHE_SOURCE[source]), value)
        for source, value in (("local_compute", output.num_prompt_tokens - num_cached),
                              ("local_cache_hit", cached["local"]),
                              ("external_kv_transfer", num_cached - cached["local"])):
            self._add("prompt_tokens_by_source", (engine, source), value)
        self._add("external_prefix_cache_queries", (engine,), output.num_prompt_tokens - cached["local"])
        self._add("external_prefix_cache_hits", (engine,), num_cached - cached["local"])
        started = self._request_to_started.pop(output.request_id, None)
        if started is not None:
            self._histogram("e2e_request_latency_seconds", engine).observe(time.perf_counter() - started)

    def observe_aborted(self, reason: str, replica_id: str | None, request_id: str | None = None) -> None:
        """A request ended before finishing (our ``aborted_requests`` ``reason``), on ``replica_id`` where known."""
        finish_reason = ABORT_REASON_TO_FINISH_REASON.get(reason, "abort")
        self._add("request_success", (replica_id or "unknown", finish_reason), 1)
        if request_id is not None:
            self._request_to_started.pop(request_id, None)

    def set_replicas(self, stats: Iterable[EngineStats]) -> None:
        self._stats = sorted(stats, key=lambda s: s.replica_id)

    # ---- rendering -------------------------------------------------------------------------------------------------
    def collect(self):
        labels = ["model_name", "engine"]
        model = self.model_name
        for name, (documentation, attribute) in {
            "prefix_cache_queries": ("Prefix cache queries, in terms of number of queried tokens.",
                                     "num_prompt_tokens_queried"),
            "prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.",
                                  "num_prompt_tokens_hit_local"),
            "num_preemptions": ("Cumulative number of preemption from the engine.", "num_preemptions"),
        }.items():
            family = CounterMetricFamily("vllm:" + name, documentation, labels=labels)
            for stats in self._stats:
                value = getattr(stats, attribute)
                if value is None:  # an older replica: no local/external split, its total
                    value = stats.num_prompt_tokens_hit
                family.add_metric([model, stats.replica_id], value)
            yield family
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=labels)
        for stats in self._stats:
            running.add_metric([model, stats.replica_id], stats.num_running)
            waiting.add_metric([model, stats.replica_id], stats.num_waiting)
            usage.add_metric([model, stats.replica_id], stats.num_pages_in_use / max(1, stats.num_pages_total))
        yield from (running, waiting, usage)
        for name, documentation, extra in (
            ("prompt_tokens", "Number of prefill tokens processed.", []),
            ("generation_tokens", "Number of generation tokens processed.", []),
            ("prompt_tokens_cached", "Number of cached prompt tokens (local + external).", []),
            ("prompt_tokens_by_source", "Number of prompt tokens by source.", ["source"]),
            ("prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that supplied them: device "
             "(the replica's own pages), host (Redis), disk (Arrow files), p2p (copied from another replica).",
             ["source"]),
            ("request_success", "Count of successfully processed requests.", ["finished_reason"]),
            ("external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache "
             "sharing, in terms of number of queried tokens.", []),
            ("external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
             "sharing, in terms of number of cached tokens.", []),
        ):
            family = CounterMetricFamily("vllm:" + name, documentation, labels=labels + extra)
            counters = {key: value for key, value in self._counters.items() if key[0] == name}
            if name == "request_success":  # every reason of every replica, from the start (vLLM's convention)
                for stats in self._stats:
                    for reason in FINISH_REASONS:
                        counters.setdefault((name, (stats.replica_id, reason)), 0)
            for (_, label_values), value in sorted(counters.items()):
                family.add_metric([model, *label_values], value)
            yield family
        for name, (documentation, _) in self.HISTOGRAMS.items():
            family = HistogramMetricFamily("vllm:" + name, documentation, labels=labels)
            for (histogram, engine), counts in sorted(self._histograms.items()):
                if histogram == name:
                    family.add_metric([model, engine], counts.cumulative(), counts.sum)
            yield family
        for name, (documentation, attribute) in ENGINE_HISTOGRAMS.items():
            family = HistogramMetricFamily("vllm:" + name, documentation, labels=labels)
            for stats in self._stats:
                if stats.latency is not None:
                    histogram = getattr(stats.latency, attribute)
                    family.add_metric([model, stats.replica_id], cumulative_buckets(histogram), histogram.total)
            yield family

    # ---- internals -------------------------------------------------------------------------------------------------
    def _histogram(self, name: str, engine: str) -> BucketCounts:
        counts = self._histograms.get((name, engine))
        if counts is None:
            counts = self._histograms[(name, engine)] = BucketCounts(self.HISTOGRAMS[name][1])
        return counts

    def _add(self, name: str, label_values: tuple[str, ...], value: float) -> None:
        key = (name, label_values)
        self._counters[key] = self._counters.get(key, 0) + value


def cumulative_buckets(histogram: TimeHistogram) -> list[tuple[str, int]]:
    """A ``TimeHistogram``'s counts as Prometheus' cumulative ``(le, count)`` pairs, +Inf last."""
    running, out = 0, []
    for bound, count in zip((*map(str, histogram.bounds), "+Inf"), histogram.counts):
        running += count
        out.append((bound, running))
    return out
