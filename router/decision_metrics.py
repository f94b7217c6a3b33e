"""Routing decisions of every router in this process, by (chosen replica, reason), and their session events, for
Prometheus.

Ray Serve builds one ``PrefixAwareRequestRouter`` per handle, inside the process that holds the handle (the ingress),
and may run it on a thread of its own. Each decision is added here, to one process-wide table of monotonic counts,
so the ingress's ``/metrics`` (cluster/metrics.py ``RouterDecisionsCollector``) exports them without holding a
reference to any router; a router that Serve replaces does not take its counts with it. No Ray, no torch.
"""

from __future__ import annotations

import threading


class DecisionCounts:
    """Thread-safe monotonic counts of routing decisions by (deployment, replica, reason)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = {}

    def add(self, deployment: str, replica_id: str, reason: str, count: int = 1) -> None:
        key = (deployment, replica_id, reason)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + count

    def snapshot(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._counts)

    def by_replica(self) -> dict[tuple[str, str], int]:
        """The counts by (replica, reason), summed over deployments."""
        totals: dict[tuple[str, str], int] = {}
        for (_, replica_id, reason), count in self.snapshot().items():
            totals[(replica_id, reason)] = totals.get((replica_id, reason), 0) + count
        return totals

    def clear(self) -> None:
        """For tests only."""
        with self._lock:
            self._counts.clear()


DECISIONS = DecisionCounts()
"""This process's table (the Ray adapter adds to it; the ingress's /metrics reads it)."""

SESSION_EVENTS = DecisionCounts()
"""The routers' session events by (deployment, home, event): "idle" (a chat taken for ended) and "resumed" (an idle
chat's next turn came after all; router/policy.py, "Sessions")."""
