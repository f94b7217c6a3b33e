"""KV events a replica publishes so routers can index which replica holds which pages.

A replica appends events as pages enter or leave its prefix cache; ``seq`` numbers are consecutive per replica, so a
consumer that sees a gap knows it missed events and must rebuild from a snapshot. Stale index entries only cost a
cache miss (the replica re-checks its own cache), never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.page_keys import PageKey


@dataclass(frozen=True)
class PagesStored:
    """Pages whose keys are now in the replica's prefix cache, in chain order (each one's parent precedes it)."""

    seq: int
    keys: tuple[PageKey, ...]


@dataclass(frozen=True)
class PagesRemoved:
    """Pages evicted from the replica's prefix cache."""

    seq: int
    keys: tuple[PageKey, ...]


@dataclass(frozen=True)
class AllPagesCleared:
    """The replica dropped every cached page (reset_prefix_cache)."""

    seq: int


KVEvent = PagesStored | PagesRemoved | AllPagesCleared
