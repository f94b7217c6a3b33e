"""A circuit breaker for a remote store: after a failure, calls are refused until a backoff passes, then one probes.

    available --failure--> down (refuse; next probe at t + backoff) --probe fails--> down (backoff doubles, capped)
        ^                                                             |
        +---------------------------- probe succeeds ----------------+

While down, callers get an immediate "no" instead of waiting on a dead socket, so a request never pays more than
one short socket timeout per backoff period.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class BackoffPolicy:
    """Seconds between reconnection attempts: ``initial_s``, doubling after each failed attempt up to ``max_s``."""

    initial_s: float = 0.25
    max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.max_s < self.initial_s:
            raise ValueError(f"need 0 <= initial_s <= max_s, got {self.initial_s} and {self.max_s}")


class CircuitBreaker:
    """Tracks whether a store is reachable and when the next attempt is allowed. Thread-safe."""

    def __init__(self, policy: BackoffPolicy = BackoffPolicy(), clock: Callable[[], float] = time.monotonic):
        self._policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._available = True
        self._backoff_s = policy.initial_s
        self._next_attempt_time = 0.0

    @property
    def available(self) -> bool:
        with self._lock:
            return self._available

    def allow(self) -> bool:
        """True if a call may go to the store now. While down, only one caller per backoff period gets True."""
        with self._lock:
            if self._available:
                return True
            now = self._clock()
            if now < self._next_attempt_time:
                return False
            self._next_attempt_time = now + self._backoff_s  # other callers wait while this one probes
            return True

    def record_success(self) -> bool:
        """Mark the store reachable; True if it was down until now (it just recovered)."""
        with self._lock:
            recovered = not self._available
            self._available = True
            self._backoff_s = self._policy.initial_s
            return recovered

    def record_failure(self) -> bool:
        """Mark the store unreachable and schedule the next probe; True if it was available until now."""
        with self._lock:
            went_down = self._available
            if went_down:
                self._backoff_s = self._policy.initial_s
            else:
                self._backoff_s = min(self._policy.max_s, max(self._backoff_s * 2, self._policy.initial_s))
            self._available = False
            self._next_attempt_time = self._clock() + self._backoff_s
            return went_down
