"""``prefixserve bench``: a streaming load generator for any OpenAI-compatible server, and ``bench compare``.

Every request streams (``stream_options.include_usage``) with temperature 0 and ``ignore_eos``, so the server
generates exactly ``max_tokens`` tokens. Per request we time::

    send        first token           token 2 ...            last token   [DONE]
     |<-- TTFT -->|<-- ITL -->|<-- ITL -->| ...  |<-- ITL -->|
     |<----------------------------- E2E latency -------------------------->|
     TPOT = (E2E - TTFT) / (output tokens - 1)

and read ``usage.prompt_tokens_details.cached_tokens`` (missing: 0) and prefixserve's
``cached_tokens_by_source`` from the final usage chunk. The result file holds the config, every metric and one
record per request (warm-up requests too, flagged, and excluded from the metrics). A failed request is counted and
recorded, never fatal; the command exits 1 only when no measured request succeeded.

Modules (none imports torch; run with ``prefixserve bench ...`` or ``python -m bench ...``):

- :mod:`bench.workloads`: seeded prompt workloads (shared-prefix, cross-replica, unique, multi-turn).
- :mod:`bench.config`: ``ClientConfig`` (where and how requests are sent) and ``LoadConfig`` (concurrency, rate).
- :mod:`bench.client`: one streamed request: SSE parsing and timing (``StreamResult``), the HTTP client.
- :mod:`bench.runner`: the session driver: arrivals, concurrency, multi-turn conversations, warm-up.
- :mod:`bench.metrics`: per-request records, exact percentiles and the run's summary figures.
- :mod:`bench.result`: ``BenchRun`` and the JSON result file.
- :mod:`bench.report`: tables and plots of result files, and ``bench compare``'s comparison.
- :mod:`bench.cli`: the command line.
- :mod:`bench.tiny_models`: the tiny random-weight model writer used by tests and benchmarks
  (``prefixserve make-tiny-model``; needs torch, so it is not imported here).

The names below are the package's public API, so that ``import bench`` is enough to drive a run from Python.
"""

from bench.cli import main
from bench.client import StreamResult, absorb_chunk, parse_sse_data, stream_request
from bench.config import ClientConfig, LoadConfig
from bench.metrics import BenchMetrics, Distribution, RequestRecord, compute_metrics, percentile, usage_counts
from bench.result import BenchRun, load_result, write_json
from bench.runner import arrival_delays, run_benchmark
from bench.workloads import WorkloadConfig

__all__ = [
    "BenchMetrics",
    "BenchRun",
    "ClientConfig",
    "Distribution",
    "LoadConfig",
    "RequestRecord",
    "StreamResult",
    "WorkloadConfig",
    "absorb_chunk",
    "arrival_delays",
    "compute_metrics",
    "load_result",
    "main",
    "parse_sse_data",
    "percentile",
    "run_benchmark",
    "stream_request",
    "usage_counts",
    "write_json",
]
