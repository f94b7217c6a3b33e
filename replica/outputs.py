"""Typed requests and results at the engine boundary (what the Serve replica and the ingress exchange)."""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.page_keys import PageKey
from replica.sampling import SamplingParams


@dataclass
class EngineRequest:
    """One generation request as the engine sees it: token ids in, tokens out."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    """Isolates a tenant's cache: folded into the key of page 0, so different salts never share pages."""
    page_keys: list[PageKey] | None = None
    """Keys of the prompt's full pages, when the caller (the ingress) already computed them; checked, not trusted."""
    peer_hint: str | None = None
    """Id of a replica that the router believes holds more of this prompt's pages (for peer copy)."""
    target_replica: str | None = None
    """Pin the request to this replica (operators, tests); the router still names the best holder in peer_hint."""


@dataclass(frozen=True)
class CachedTokens:
    """Where a request's reused prompt tokens came from."""

    local: int = 0
    peer: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.local + self.peer + self.host + self.disk

    def as_dict(self) -> dict[str, int]:
        return {"local": self.local, "peer": self.peer, "host": self.host, "disk": self.disk}


@dataclass(frozen=True)
class RequestOutput:
    """A streamed increment of one request. The last one has ``finished=True`` and a ``finish_reason``."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    """"stop" (EOS, stop token or stop string), "length" (max_tokens or max_model_len) or "abort"."""
    num_prompt_tokens: int
    num_output_tokens: int
    cached_tokens: CachedTokens
    replica_id: str = ""


@dataclass(frozen=True)
class EngineStats:
    """Counters of one replica's engine (monotonic counters are totals since start)."""

    replica_id: str
    num_prompt_tokens_queried: int
    num_prompt_tokens_hit: int
    num_pages_total: int
    num_pages_free: int
    num_pages_cached: int
    num_pages_in_use: int
    num_evictions: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    num_requests_finished: int
    page_size: int
