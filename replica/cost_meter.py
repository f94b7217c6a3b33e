"""What this replica's work costs, measured here and sent to the routers (``MeasuredCosts`` in the routing stats).

Two meters, both cheap enough for every engine step and every routing-stats period:

- ``StepCostFit``: each engine step's wall time (forward + sampling) against what the step did, fitted by
  exponentially weighted least squares (each step's weight decays by ``decay`` per later step, ~1/(1 - decay) steps
  remembered) to the router's own step model (router/policy.py)::

      step seconds * 1000 = step_ms + prefill_token_ms * P + attention_pair_us / 1000 * A + row_ms * D
                            + context_us / 1000 * C
          P = prompt tokens computed in the step, A = sum over prefill chunks of new * (context + new / 2),
          D = decode rows (requests generating one token), C = the sum of their contexts in tokens

  and ``decode_row_ms`` reported = row_ms + context_us / 1000 * (the decode rows' mean context, same weighting): the
  router prices a running request's row at a typical context, and fitting the context term separately keeps it out of
  the other coefficients.

  Outliers (a step slower than ``outlier_factor`` x the fit's prediction + 50 ms, once 16 steps are in: a compile, a
  stall of the machine) are counted and left out.
  A ridge prior pulls each coefficient toward the router's default with the weight of ``prior_steps`` typical steps,
  so a replica that has only ever run one kind of step (say, decodes) reports the defaults for what it cannot tell
  apart instead of noise. Coefficients are clamped at 0.
- ``SourceCostMeter``: per source (peer copy, host tier, disk tier), the seconds per page of the fetches made since the
  last period (from the fetcher's cumulative ``SourceStats``: seconds and pages, so no hook in the fetch path), folded
  into an EWMA (``alpha`` per period that fetched something).

``ReplicaCostMeter.costs()`` reports only what was measured: a source never used, or fewer than ``min_steps`` steps,
leaves that cost None and the router keeps its default.
"""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

from common.routing_stats import MeasuredCosts, RetainedPages
from common.types import CacheSource, SourceStats

STEP_FEATURES = ("step_ms", "prefill_token_ms", "attention_pair_us", "decode_row_ms")
DEFAULT_STEP_COSTS = (16.0, 0.417, 0.35, 6.0)
"""router/policy.py ``PolicyConfig`` defaults (in the order of ``STEP_FEATURES``)."""
_PRIOR = (16.0, 0.417, 0.35, 4.0, 2.0)
"""The fit's prior: the defaults with the decode row split into 4.0 ms + 2.0 us per context token (benchmarks/
router_sim/costs.py); the last coefficient is the context term."""
_TYPICAL = (1.0, 256.0, 256.0 * 512.0 * 1e-3, 4.0, 4.0 * 1024 * 1e-3)
"""A typical step's feature values (scales the prior; attention pairs and contexts in thousands)."""


class StepCostFit:
    """Exponentially weighted ridge regression of step time on (1, P, A/1000, D); see the module docstring."""

    def __init__(self, *, decay: float = 0.995, prior_steps: float = 0.05, prior: Sequence[float] = _PRIOR,
                 outlier_factor: float = 5.0) -> None:
        if not 0.0 < decay <= 1.0 or prior_steps <= 0:
            raise ValueError(f"decay must be in (0, 1] and prior_steps > 0, got {decay}, {prior_steps}")
        self.decay = decay
        self.prior = tuple(float(value) for value in prior)
        self._ridge = [prior_steps * scale * scale for scale in _TYPICAL]
        n = len(_PRIOR)
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self._rows = 0.0
        self._contexts = 0.0
        self.num_steps = 0
        self.num_outliers = 0
        self.outlier_factor = outlier_factor
        self._solution: list[float] | None = None
        """The fit as of the last refresh (every 32 steps), for the outlier test."""

    def observe(self, seconds: float, num_prefill_tokens: int, attention_pairs: float, num_decode_rows: int,
                decode_context: float = 0.0) -> None:
        if not seconds >= 0.0:
            return
        x = (1.0, float(num_prefill_tokens), attention_pairs * 1e-3, float(num_decode_rows), decode_context * 1e-3)
        y = seconds * 1000.0
        if self.num_steps >= 16:
            if self._solution is None or self.num_steps % 32 == 0:
                self._solution = self._solve()
            predicted = sum(c * v for c, v in zip(self._solution, x))
            if y > self.outlier_factor * predicted + 50.0:
                self.num_outliers += 1
                return
        decay, xtx, xty = self.decay, self._xtx, self._xty
        n = len(x)
        for i in range(n):
            row, xi = xtx[i], x[i]
            for j in range(n):
                row[j] = row[j] * decay + xi * x[j]
            xty[i] = xty[i] * decay + xi * y
        self._rows = self._rows * decay + num_decode_rows
        self._contexts = self._contexts * decay + decode_context
        self.num_steps += 1

    def coefficients(self) -> tuple[float, ...]:
        """(step_ms, prefill_token_ms, attention_pair_us, decode_row_ms at the mean context), each >= 0."""
        step_ms, prefill_ms, pair_us, row_ms, context_us = (max(0.0, value) for value in self._solve())
        mean_context = self._contexts / self._rows if self._rows > 1e-9 else 1024.0
        return step_ms, prefill_ms, pair_us, row_ms + context_us * 1e-3 * mean_context


    def _solve(self) -> list[float]:
        n = len(_PRIOR)
        a = [[self._xtx[i][j] + (self._ridge[i] if i == j else 0.0) for j in range(n)] for i in range(n)]
        b = [self._xty[i] + self._ridge[i] * self.prior[i] for i in range(n)]
        return _solve(a, b) or list(self.prior)


class SourceCostMeter:
    """EWMA of seconds per page per fetch source, from the fetcher's cumulative counters."""

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._last: dict[CacheSource, tuple[int, float]] = {}
        self.page_ms: dict[CacheSource, float] = {}

    def observe(self, source_to_stats: Mapping[CacheSource, SourceStats]) -> None:
        for source, stats in source_to_stats.items():
            pages, seconds = stats.pages, stats.seconds
            last_pages, last_seconds = self._last.get(source, (0, 0.0))
            self._last[source] = (pages, seconds)
            new_pages = pages - last_pages
            if new_pages <= 0:
                continue
            sample = max(0.0, seconds - last_seconds) * 1000.0 / new_pages
            previous = self.page_ms.get(source)
            self.page_ms[source] = sample if previous is None else previous + self.alpha * (sample - previous)


class ReplicaCostMeter:
    """Both meters; ``observe_step`` runs on the engine thread, the rest on the replica's event loop."""

    def __init__(self, *, min_steps: int = 16, step_fit: StepCostFit | None = None,
                 sources: SourceCostMeter | None = None) -> None:
        self.min_steps = min_steps
        self.step_fit = step_fit or StepCostFit()
        self.sources = sources or SourceCostMeter()
        self._lock = threading.Lock()

    def observe_step(self, seconds: float, chunks: Sequence) -> None:
        """The engine's step observer: ``chunks`` are the step's scheduled chunks (``seq``, ``num_new_tokens``),
        before their ``num_computed_tokens`` advanced."""
        prefill_tokens, pairs, decode_rows, decode_context = step_features(chunks)
        with self._lock:
            self.step_fit.observe(seconds, prefill_tokens, pairs, decode_rows, decode_context)

    def observe_sources(self, source_to_stats: Mapping[CacheSource, SourceStats]) -> None:
        self.sources.observe(source_to_stats)

    def costs(self) -> MeasuredCosts | None:
        """What was measured so far (None: nothing)."""
        values: dict[str, float] = {}
        with self._lock:
            if self.step_fit.num_steps >= self.min_steps:
                values.update(zip(STEP_FEATURES, self.step_fit.coefficients()))
        for source, name in ((CacheSource.PEER, "peer_copy_page_ms"), (CacheSource.HOST, "host_page_ms"),
                             (CacheSource.DISK, "disk_page_ms")):
            if source in self.sources.page_ms:
                values[name] = self.sources.page_ms[source]
        return MeasuredCosts(**values) if values else None


def step_features(chunks: Sequence) -> tuple[int, float, int, int]:
    """(prompt tokens computed, attention pairs of those, decode rows, their contexts summed) of one step's chunks."""
    prefill_tokens, pairs, decode_rows, decode_context = 0, 0.0, 0, 0
    for chunk in chunks:
        num_new = chunk.num_new_tokens
        start = chunk.seq.num_computed_tokens
        if num_new == 1 and start >= chunk.seq.num_prompt_tokens:
            decode_rows += 1
            decode_context += start
        else:
            prefill_tokens += num_new
            pairs += num_new * (start + num_new / 2)
    return prefill_tokens, pairs, decode_rows, decode_context


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            if factor:
                for c in range(col, n + 1):
                    m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def retained_groups(retained: Sequence[tuple[bytes, int, float]], *, now_wall: float | None = None,
                    granularity_s: float = 1.0) -> list[RetainedPages]:
    """``KVCacheManager.retained_keys()`` as wire groups: keys sharing a priority and an expiry (wall clock, rounded
    up to ``granularity_s`` so a payload does not change at every period; None for no expiry)."""
    import math
    import time

    if now_wall is None:
        now_wall = time.time()
    groups: dict[tuple[int, float | None], list[bytes]] = {}
    for key, priority, seconds_left in retained:
        expires = None if seconds_left == math.inf else math.ceil((now_wall + seconds_left) / granularity_s) * (
            granularity_s)
        groups.setdefault((priority, expires), []).append(key)
    return [RetainedPages(priority, expires, tuple(keys)) for (priority, expires), keys in groups.items()]
