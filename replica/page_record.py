"""``PageRecord``: one full page of KV on its way between a page pool and the world outside it.

The same record travels the whole way, so nothing is renamed or re-verified on the way:

    holder pool --export_pages--> PageRecord --bundle/CUDA IPC--> PageRecord (source=PEER) --+
    Redis / Arrow file --tier.load--> PageRecord (source=HOST | DISK) -----------------------+--> admission plan
                                                                                              --> engine writes kv into
    engine step --newly cached pages--> PageRecord --page sink--> tiers' background writers         a pool page

``token_ids`` are the tokens the page holds; a record from outside the replica has been checked against the request's
key and tokens by the ``PrefixFetcher`` (once), and is used as is after that. A tier load on a CPU replica usually
decrypts straight into pool pages reserved for it (``landing_page``, replica/landing.py): the engine then puts that
page in the request's page table instead of writing ``kv`` into another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.page_keys import PageKey
from common.types import CacheSource


@dataclass(frozen=True)
class PageRecord:
    key: PageKey
    token_ids: tuple[int, ...]
    kv: torch.Tensor
    """``[num_layers, 2, page_size, num_kv_heads, head_dim]``; a view of a pool page when exported for the tiers (the
    tiers copy it before returning), else owned by the record."""
    source: CacheSource = CacheSource.LOCAL
    retention_priority: int = 0
    """The page's retention in the pool that computed it, for the tiers (0: plain LRU)."""
    retain_until: float = 0.0
    """Wall-clock end of that retention (``math.inf``: pinned)."""
    salted: bool = False
    """Page 0 of a chain whose keys fold in a cache salt (for the tiers' KV events)."""
    landing_page: int | None = None
    """The pool page a tier load decrypted ``kv`` into (``kv`` is then that page's view; replica/landing.py): a
    request holding the record holds a reference on the page, and adopts the page instead of copying ``kv``."""

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
