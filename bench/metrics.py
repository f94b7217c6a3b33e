"""Per-request records and the figures computed from them.

A :class:`RequestRecord` is one request's outcome as stored in the result file; :func:`compute_metrics` aggregates the
measured records of a phase into :class:`BenchMetrics` (throughputs, cached-token counts and :class:`Distribution`
summaries of TTFT, TPOT, ITL and end-to-end latency, in milliseconds, with exact percentiles). :func:`usage_counts`
reads the token counts of a response's usage object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's outcome, as stored in the result file (times in seconds)."""

    request_index: int
    session_id: int
    turn: int
    group: int
    warmup: bool
    output_len: int
    """Requested ``max_tokens``."""
    client_prompt_len: int | None
    """Prompt tokens as counted by the client (None when it cannot count: text without --tokenizer)."""
    start_s: float
    """Send time, relative to the start of the phase (warm-up or measured)."""
    success: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    usage_reported: bool = False
    finish_reason: str | None = None
    answer_source: str | None = None
    """multi-turn: where the answer resent in the next turn came from (server, tokenizer, text, synthetic)."""
    http_status: int | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if not self.success or self.e2e_s is None or self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    """Summary of a sample, in milliseconds (None for an empty sample)."""

    count: int
    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True)
class BenchMetrics:
    """The figures of one measured phase (warm-up excluded)."""

    num_requests: int
    num_completed: int
    num_errors: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_token_rate: float
    cached_tokens_by_source: dict[str, int]
    num_usage_missing: int
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile of ascending ``sorted_values`` by linear interpolation (numpy's default method).

    With n values the rank is (n - 1) * q / 100; e.g. 1..101 gives p50 = 51, p90 = 91, p99 = 100.
    """
    if not sorted_values:
        raise ValueError("percentile of an empty sample")
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def summarize(values_s: Iterable[float]) -> Distribution:
    """A :class:`Distribution` in milliseconds of ``values_s`` (seconds)."""
    values = sorted(value * 1000.0 for value in values_s)
    if not values:
        return Distribution(0, None, None, None, None, None, None, None)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((value - mean) ** 2 for value in values) / len(values))
    p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
    return Distribution(len(values), mean, std, values[0], values[-1], p50, p90, p99)


def add_counts(total: dict[str, int], counts: dict[str, int]) -> None:
    """Add ``counts`` into ``total`` key by key."""
    for key, value in counts.items():
        total[key] = total.get(key, 0) + int(value)


def usage_counts(usage: dict[str, Any] | None) -> tuple[int, int, int, dict[str, int]]:
    """(prompt, completion, cached tokens, cached tokens by source) from a usage object; missing values are 0."""
    if not usage:
        return 0, 0, 0, {}
    details = usage.get("prompt_tokens_details") or {}
    by_source = details.get("cached_tokens_by_source") or usage.get("cached_tokens_by_source") or {}
    return (
        int(usage.get("prompt_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
        int(details.get("cached_tokens") or 0),
        {str(key): int(value or 0) for key, value in by_source.items()},
    )


def compute_metrics(records: Sequence[RequestRecord], duration_s: float) -> BenchMetrics:
    """Aggregate the measured (non-warm-up) records of a phase that lasted ``duration_s`` seconds."""
    measured = [record for record in records if not record.warmup]
    done = [record for record in measured if record.success]
    prompt_tokens = sum(record.prompt_tokens for record in done)
    completion_tokens = sum(record.completion_tokens for record in done)
    cached_tokens = sum(record.cached_tokens for record in done)
    by_source: dict[str, int] = {}
    for record in done:
        add_counts(by_source, record.cached_tokens_by_source)
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    return BenchMetrics(
        num_requests=len(measured),
        num_completed=len(done),
        num_errors=len(measured) - len(done),
        duration_s=duration_s,
        request_throughput=len(done) * per_second,
        output_throughput=completion_tokens * per_second,
        total_token_throughput=(prompt_tokens + completion_tokens) * per_second,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        cached_token_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        cached_tokens_by_source=by_source,
        num_usage_missing=sum(1 for record in done if not record.usage_reported),
        ttft_ms=summarize(record.ttft_s for record in done if record.ttft_s is not None),
        tpot_ms=summarize(tpot for record in done if (tpot := record.tpot_s) is not None),
        itl_ms=summarize(gap for record in done for gap in record.itl_s),
        e2e_ms=summarize(record.e2e_s for record in done if record.e2e_s is not None),
    )
