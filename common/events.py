"""KV events a replica publishes so routers can index which replica holds which pages.

A replica appends events as pages enter or leave its prefix cache; ``seq`` numbers are consecutive per replica, so a
consumer that sees a gap knows it missed events and must rebuild from a snapshot. Stale index entries only cost a
cache miss (the replica re-checks its own cache), never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from common.page_keys import PageKey

MEDIUM_DEVICE = "GPU"
"""vLLM's medium name for the engine's own KV pool (``MEDIUM_GPU``), also for a CPU replica's page pool."""
MEDIUM_HOST = "CPU"
"""vLLM's medium name for KV offloaded to host memory (its CPU offloading connector); our Redis tier."""
MEDIUM_DISK = "DISK"
"""The medium name the KV-event consumers use for a disk tier (vLLM's schema leaves ``medium`` a free string)."""


class StoredPageInfo(NamedTuple):
    """What an outside consumer needs about one stored page besides its key (vLLM-schema KV events,
    replica/kv_event_publisher.py): the key of the page before it in its chain (None for page 0), its token ids, and
    whether a cache salt was folded into the chain (the salt itself is never published)."""

    parent_key: PageKey | None
    token_ids: tuple[int, ...]
    salted: bool = False


@dataclass(frozen=True)
class PagesStored:
    """Pages whose keys are now in the replica's prefix cache, in chain order (each one's parent precedes it).
    ``infos`` is empty or has one ``StoredPageInfo`` per key (the routing-stats wire format carries only keys; events
    compare by seq and keys)."""

    seq: int
    keys: tuple[PageKey, ...]
    infos: tuple[StoredPageInfo, ...] = field(default=(), compare=False, repr=False)


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
