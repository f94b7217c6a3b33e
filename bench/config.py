"""What a benchmark run is configured with besides its workload: :class:`ClientConfig` (where and how requests are
sent) and :class:`LoadConfig` (how they are offered). The workload's own config, ``WorkloadConfig``, is in
:mod:`bench.workloads`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class ClientConfig:
    """Where and how requests are sent."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    timeout_s: float = 600.0
    return_token_ids: bool = False
    """Ask for the generated token ids (vLLM's ``return_token_ids``); multi-turn token-id prompts then resend them."""
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; choose one of {', '.join(ENDPOINTS)}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")

    @property
    def api_root(self) -> str:
        """``base_url`` without a trailing ``/`` or ``/v1``."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def request_url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.api_root + path

    @property
    def headers(self) -> dict[str, str]:
        """The headers of every request: the API key as a Bearer token, when there is one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class LoadConfig:
    """How requests are offered: at most ``concurrency`` in flight (0: no limit), sessions arriving as a seeded
    Poisson process of ``request_rate`` per second (inf: all at once), after ``warmup_requests`` warm-up requests."""

    concurrency: int = 4
    request_rate: float = math.inf
    warmup_requests: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 0:
            raise ValueError(f"--concurrency must be >= 0 (0: unlimited), got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")
