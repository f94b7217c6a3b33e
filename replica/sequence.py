"""One request's state inside the engine: its tokens, how many have KV computed, and the pages that hold them.

    token_ids      | prompt ..................................... | outputs ... |
    computed       |<------ num_computed_tokens ------>|
    page_ids       | page 0 | page 1 | page 2 | page 3 (partial) |
    committed      | pages whose key is registered in the prefix cache (full, computed) |

A step computes tokens [num_computed_tokens, num_computed_tokens + n); when that reaches the last token, the engine
samples one new token, which is appended and computed in the next step (decode).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from common.page_keys import PageKey, compute_page_keys
from common.types import CacheSource, Retention, SamplingParams
from replica.page_record import PageRecord


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_index: int
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    page_keys: list[PageKey] = field(default_factory=list)
    num_committed_pages: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_prompt_tokens: int | None = None
    """Prompt tokens reused from the cache, fixed when the request is first scheduled (None before)."""
    cached_by_source: dict[CacheSource, int] = field(default_factory=dict)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    fetched: tuple[PageRecord, ...] = ()
    """Verified pages fetched from a peer or a shared tier before admission, for page indices ``first_fetched_index``
    on; the scheduler uses those that continue the local hit when it admits the request, then drops them all."""
    first_fetched_index: int = 0
    retention: Retention | None = None
    """Keep the first ``num_retained_pages`` pages cached with this priority and TTL (None: the default eviction
    order)."""
    num_retained_pages: int = 0
    num_cache_write_tokens: int = 0
    """Prompt tokens of pages this request computed that entered the prefix cache (usage: written to cache)."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def extend_page_keys(self, page_size: int, model_fingerprint: str) -> list[PageKey]:
        """Keys of every full page of the current tokens (extends the chain; earlier keys are kept)."""
        if len(self.page_keys) < self.num_tokens // page_size:
            self.page_keys = compute_page_keys(
                self.token_ids,
                page_size=page_size,
                model_fingerprint=model_fingerprint,
                salt=self.cache_salt,
                parent_keys=self.page_keys,
            )
        return self.page_keys

    def reset_for_recompute(self) -> None:
        """After preemption: no pages held, nothing computed; outputs so far are kept and recomputed as prompt."""
        self.page_ids = []
        self.num_computed_tokens = 0
        self.num_committed_pages = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
