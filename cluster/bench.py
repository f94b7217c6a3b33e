"""``prefixserve bench``: a streaming load generator for any OpenAI-compatible server, and ``bench compare``.

Usage::

    prefixserve bench --base-url http://127.0.0.1:8000 --workload shared-prefix --num-prefixes 4 \\
        --prefix-len 1792 --suffix-len 256 --output-len 32 --num-requests 40 --concurrency 4 \\
        --warmup-requests 4 --result-file out.json --plot ttft.png
    prefixserve bench compare prefixserve.json vllm.json --plot compare.png --markdown compare.md

Every request streams (``stream_options.include_usage``) with temperature 0 and ``ignore_eos``, so the server
generates exactly ``max_tokens`` tokens. Per request we time::

    send        first token           token 2 ...            last token   [DONE]
     |<-- TTFT -->|<-- ITL -->|<-- ITL -->| ...  |<-- ITL -->|
     |<----------------------------- E2E latency -------------------------->|
     TPOT = (E2E - TTFT) / (output tokens - 1)

and read ``usage.prompt_tokens_details.cached_tokens`` (missing: 0) and prefixserve's
``cached_tokens_by_source`` from the final usage chunk. The result file holds the config, every metric and one
record per request (warm-up requests too, flagged, and excluded from the metrics). A failed request is counted and
recorded, never fatal; the command exits 1 only when no measured request succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import random
import sys
import time
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import urlparse

from cluster import bench_workloads as wl
from cluster.bench_workloads import Prompt, PromptFactory, Session, WorkloadConfig

RESULT_FORMAT_VERSION = 1
ENDPOINTS = ("completions", "chat")
PERCENTILES = (50, 90, 99)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


# ----------------------------------------------------------------------------------------------------------------
# Configuration


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


# ----------------------------------------------------------------------------------------------------------------
# Records and metrics


@dataclass
class StreamResult:
    """What one streamed request returned, timed from the moment it was sent."""

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    num_token_chunks: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and self.ttft_s is not None


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


# ----------------------------------------------------------------------------------------------------------------
# Streaming one request


def parse_sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line, or None for other lines (comments, ``event:``, blank)."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def choice_text(choice: dict[str, Any]) -> str:
    """The new text of a streamed choice (completions ``text`` or chat ``delta.content``)."""
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def choice_token_ids(choice: dict[str, Any]) -> list[int]:
    """Token ids a server attached to a streamed choice (vLLM's ``return_token_ids``), else []."""
    ids = choice.get("token_ids")
    if ids is None:
        ids = (choice.get("delta") or {}).get("token_ids")
    return list(ids or [])


def is_token_chunk(choice: dict[str, Any]) -> bool:
    """True when a streamed choice stands for generated tokens.

    Text or token ids count; so does an empty unfinished piece (a token whose bytes the detokenizer holds back).
    A chat chunk that only announces the role, and a bare closing chunk with only a finish reason, do not.
    """
    if choice_text(choice) or choice_token_ids(choice):
        return True
    if choice.get("finish_reason") is not None:
        return False
    delta = choice.get("delta")
    return not (delta is not None and "role" in delta)


def absorb_chunk(
    result: StreamResult, chunk: dict[str, Any], elapsed_s: float, last_token_s: float | None
) -> float | None:
    """Fold one parsed chunk received ``elapsed_s`` after sending into ``result``; return the new last-token time."""
    if chunk.get("error"):
        result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
        return last_token_s
    if chunk.get("usage"):
        result.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        result.text += choice_text(choice)
        result.token_ids.extend(choice_token_ids(choice))
        if choice.get("finish_reason") is not None:
            result.finish_reason = choice["finish_reason"]
        if not is_token_chunk(choice):
            continue
        if result.ttft_s is None:
            result.ttft_s = elapsed_s
        elif last_token_s is not None:
            result.itl_s.append(elapsed_s - last_token_s)
        result.num_token_chunks += 1
        last_token_s = elapsed_s
    return last_token_s


async def stream_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str]) -> StreamResult:
    """POST ``payload`` with streaming and time every chunk. Never raises: failures land in ``result.error``."""
    result = StreamResult()
    start = time.perf_counter()
    last_token_s: float | None = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            result.http_status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                data = parse_sse_data(line)
                if data is None or not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                last_token_s = absorb_chunk(result, chunk, time.perf_counter() - start, last_token_s)
                if result.error is not None:
                    break
    except Exception as exc:  # noqa: BLE001 - any failure of one request is recorded, not raised
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.e2e_s = time.perf_counter() - start
    if result.error is None and result.ttft_s is None:
        result.error = "the stream ended without any token"
    return result


# ----------------------------------------------------------------------------------------------------------------
# Building requests


@dataclass
class Conversation:
    """The prompt of a session so far: for completions one concatenated prompt, for chat a message list."""

    endpoint: str
    prompt: Prompt
    messages: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def start(cls, endpoint: str, system: Prompt) -> "Conversation":
        messages = [{"role": "system", "content": system}] if endpoint == "chat" and system else []
        return cls(endpoint=endpoint, prompt=system, messages=messages)

    def add_user(self, piece: Prompt) -> None:
        self.prompt = self.prompt + piece
        if self.endpoint == "chat":
            self.messages.append({"role": "user", "content": piece})

    def add_answer(self, piece: Prompt) -> None:
        self.prompt = self.prompt + piece
        if self.endpoint == "chat":
            self.messages.append({"role": "assistant", "content": piece})


def build_payload(client_config: ClientConfig, model: str, conversation: Conversation, output_len: int) -> dict:
    """The JSON body of one streamed request (greedy, ``ignore_eos``, exactly ``output_len`` tokens)."""
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if client_config.endpoint == "chat":
        payload["messages"] = [dict(message) for message in conversation.messages]
    else:
        payload["prompt"] = conversation.prompt
    if client_config.return_token_ids:
        payload["return_token_ids"] = True
    payload.update(client_config.extra_body)
    return payload


def count_client_prompt_len(conversation: Conversation, factory: PromptFactory, tokenizer: Any) -> int | None:
    """Prompt tokens as the client sees them (chat: through the tokenizer's chat template), or None."""
    if conversation.endpoint == "completions":
        return factory.count(conversation.prompt)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    encoded = tokenizer.apply_chat_template(conversation.messages, add_generation_prompt=True, tokenize=True)
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return len(encoded)


def answer_piece(
    result: StreamResult, factory: PromptFactory, tokenizer: Any, num_tokens: int, rng: random.Random
) -> tuple[Prompt, str]:
    """The model's answer as a piece to resend next turn, and where it came from.

    Text prompts resend the text. Token-id prompts resend the server's token ids when it returned them, else the
    text re-encoded with ``--tokenizer``, else ``num_tokens`` seeded stand-in ids (lengths right, content not).
    """
    if factory.prompt_format == "text":
        return result.text, "text"
    if result.token_ids:
        return list(result.token_ids), "server"
    if tokenizer is not None:
        return list(tokenizer.encode(result.text, add_special_tokens=False)), "tokenizer"
    return factory.make(num_tokens, rng), "synthetic"


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


def make_record(
    session: Session,
    turn_number: int,
    warmup: bool,
    client_prompt_len: int | None,
    start_s: float,
    result: StreamResult,
) -> RequestRecord:
    """A :class:`RequestRecord` from a stream result (usage missing: tokens counted from the stream)."""
    turn = session.turns[turn_number]
    prompt_tokens, completion_tokens, cached_tokens, by_source = usage_counts(result.usage)
    if result.usage is None:
        prompt_tokens = client_prompt_len or 0
        completion_tokens = result.num_token_chunks
    return RequestRecord(
        request_index=turn.request_index,
        session_id=session.session_id,
        turn=turn_number,
        group=session.group,
        warmup=warmup,
        output_len=turn.output_len,
        client_prompt_len=client_prompt_len,
        start_s=start_s,
        success=result.success,
        ttft_s=result.ttft_s,
        e2e_s=result.e2e_s,
        itl_s=result.itl_s,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        cached_tokens_by_source=by_source,
        usage_reported=result.usage is not None,
        finish_reason=result.finish_reason,
        http_status=result.http_status,
        error=result.error,
    )


def skipped_record(session: Session, turn_number: int, warmup: bool, start_s: float) -> RequestRecord:
    """The record of a turn not sent because an earlier turn of its conversation failed (counted as an error)."""
    turn = session.turns[turn_number]
    return RequestRecord(
        request_index=turn.request_index,
        session_id=session.session_id,
        turn=turn_number,
        group=session.group,
        warmup=warmup,
        output_len=turn.output_len,
        client_prompt_len=None,
        start_s=start_s,
        success=False,
        error="skipped: an earlier turn of this conversation failed",
    )


# ----------------------------------------------------------------------------------------------------------------
# Running a phase


class Progress:
    """A tqdm bar on stderr when available, else one updating stderr line; silent when disabled."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        self.total, self.description, self.enabled, self.done, self.errors = total, description, enabled, 0, 0
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=description, file=sys.stderr, unit="req", leave=True)
            except ImportError:
                self.bar = None

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += 0 if record.success else 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(errors=self.errors, refresh=False)
        else:
            sys.stderr.write(f"\r{self.description}: {self.done}/{self.total} requests, {self.errors} errors")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


@dataclass
class PhaseRunner:
    """Sends the sessions of one phase and collects their records."""

    client: Any
    client_config: ClientConfig
    load_config: LoadConfig
    model: str
    factory: PromptFactory
    tokenizer: Any
    seed: int
    warmup: bool
    progress: Progress
    limiter: Any = None
    phase_start: float = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.phase_start

    def headers(self) -> dict[str, str]:
        key = self.client_config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def slot(self) -> AbstractAsyncContextManager:
        """Holds one of ``concurrency`` request slots (no limit when concurrency is 0)."""
        return self.limiter if self.limiter is not None else nullcontext()

    async def run_session(self, session: Session) -> list[RequestRecord]:
        """Send the session's turns in order, each resending the conversation so far."""
        conversation = Conversation.start(self.client_config.endpoint, session.system)
        records: list[RequestRecord] = []
        for turn_number, turn in enumerate(session.turns):
            if records and not records[-1].success:
                records.append(skipped_record(session, turn_number, self.warmup, self.elapsed()))
                self.progress.update(records[-1])
                continue
            conversation.add_user(turn.user)
            payload = build_payload(self.client_config, self.model, conversation, turn.output_len)
            client_prompt_len = count_client_prompt_len(conversation, self.factory, self.tokenizer)
            async with self.slot():
                start_s = self.elapsed()
                result = await stream_request(self.client, self.client_config.request_url, payload, self.headers())
            record = make_record(session, turn_number, self.warmup, client_prompt_len, start_s, result)
            if turn_number + 1 < len(session.turns) and result.success:
                rng = wl.seeded_rng(self.seed, "answer", session.session_id, turn_number)
                piece, record.answer_source = answer_piece(
                    result, self.factory, self.tokenizer, record.completion_tokens, rng
                )
                conversation.add_answer(piece)
            records.append(record)
            self.progress.update(record)
        return records

    async def run_session_at(self, session: Session, delay_s: float) -> list[RequestRecord]:
        """Wait until ``delay_s`` after the phase start, then run the session."""
        wait_s = delay_s - self.elapsed()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        return await self.run_session(session)

    async def run(self, sessions: Sequence[Session]) -> tuple[list[RequestRecord], float]:
        """Run every session (Poisson arrivals, bounded concurrency); the records in request order and the duration."""
        concurrency = self.load_config.concurrency
        self.limiter = asyncio.Semaphore(concurrency) if concurrency > 0 else None
        delays = arrival_delays(len(sessions), self.load_config.request_rate, self.seed)
        self.phase_start = time.perf_counter()
        tasks = [asyncio.create_task(self.run_session_at(s, d)) for s, d in zip(sessions, delays)]
        nested = await asyncio.gather(*tasks)
        duration_s = self.elapsed()
        records = sorted((record for group in nested for record in group), key=lambda r: r.request_index)
        return records, duration_s


def arrival_delays(count: int, request_rate: float, seed: int) -> list[float]:
    """Start offsets (s) of ``count`` sessions: 0 for an infinite rate, else a seeded Poisson process."""
    if math.isinf(request_rate):
        return [0.0] * count
    rng = wl.seeded_rng(seed, "arrivals")
    delays, now = [], 0.0
    for _ in range(count):
        delays.append(now)
        now += rng.expovariate(request_rate)
    return delays


def is_loopback(url: str) -> bool:
    """True for a URL on this machine (no proxy from the environment should be used for it)."""
    return (urlparse(url).hostname or "") in LOOPBACK_HOSTS


def make_http_client(client_config: ClientConfig, concurrency: int) -> Any:
    """An ``httpx.AsyncClient`` sized for ``concurrency`` streams (environment proxies ignored for loopback)."""
    import httpx

    max_connections = None if concurrency == 0 else max(concurrency, 1) + 2
    return httpx.AsyncClient(
        timeout=httpx.Timeout(client_config.timeout_s, connect=min(30.0, client_config.timeout_s)),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        trust_env=not is_loopback(client_config.base_url),
    )


async def discover_model(client: Any, client_config: ClientConfig) -> str:
    """The first model id that ``GET /v1/models`` lists (raises RuntimeError with the remedy when it cannot)."""
    key = client_config.api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = await client.get(client_config.api_root + "/v1/models", headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(
            f"could not list models at {client_config.api_root}/v1/models ({type(exc).__name__}: {exc}); "
            f"is the server up? pass --model to skip discovery"
        ) from exc


@dataclass
class BenchRun:
    """Everything one ``prefixserve bench`` run produced."""

    label: str
    client_config: ClientConfig
    load_config: LoadConfig
    workload_config: WorkloadConfig
    prompt_format: str
    tokenizer_path: str | None
    vocab_size: int | None
    model: str
    metrics: BenchMetrics
    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    started_at: str

    def to_json(self) -> dict[str, Any]:
        """The result file's content."""
        config = {
            "workload": asdict(self.workload_config),
            "num_prefixes_used": self.workload_config.effective_num_prefixes,
            "load": {**asdict(self.load_config), "request_rate": json_number(self.load_config.request_rate)},
            "client": {**asdict(self.client_config), "api_key": "***" if self.client_config.api_key else None},
            "prompt_format": self.prompt_format,
            "tokenizer": self.tokenizer_path,
            "vocab_size": self.vocab_size,
        }
        return {
            "format_version": RESULT_FORMAT_VERSION,
            "label": self.label,
            "started_at": self.started_at,
            "server": {"base_url": self.client_config.base_url, "model": self.model},
            "config": config,
            "metrics": asdict(self.metrics),
            "requests": [request_json(record) for record in self.warmup_records + self.records],
        }


def json_number(value: float) -> float | str:
    """JSON has no infinity: write it as the string "inf"."""
    return "inf" if math.isinf(value) else value


def request_json(record: RequestRecord) -> dict[str, Any]:
    """A record as JSON (with its TPOT)."""
    return {**asdict(record), "tpot_s": record.tpot_s}


async def run_benchmark(
    client_config: ClientConfig,
    load_config: LoadConfig,
    workload_config: WorkloadConfig,
    factory: PromptFactory,
    tokenizer: Any = None,
    label: str | None = None,
    show_progress: bool = True,
    http_client: Any = None,
) -> BenchRun:
    """Warm up, then run the measured workload; return the records and metrics.

    ``http_client`` (an ``httpx.AsyncClient``, e.g. on a mock transport) replaces the one made here; it is closed.
    """
    started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    sessions = wl.build_sessions(workload_config, factory)
    warmup_sessions = wl.build_warmup_sessions(workload_config, factory, load_config.warmup_requests)
    async with http_client or make_http_client(client_config, load_config.concurrency) as client:
        model = client_config.model or await discover_model(client, client_config)

        def runner(warmup: bool, total: int) -> PhaseRunner:
            progress = Progress(total, "warm-up" if warmup else workload_config.workload, show_progress)
            return PhaseRunner(
                client, client_config, load_config, model, factory, tokenizer, workload_config.seed, warmup, progress
            )

        warmup_records: list[RequestRecord] = []
        if warmup_sessions:
            warmup_runner = runner(True, len(warmup_sessions))
            warmup_records, _ = await warmup_runner.run(warmup_sessions)
            warmup_runner.progress.close()
        main_runner = runner(False, wl.count_requests(sessions))
        records, duration_s = await main_runner.run(sessions)
        main_runner.progress.close()
    return BenchRun(
        label=label or default_label(model, client_config, workload_config),
        client_config=client_config,
        load_config=load_config,
        workload_config=workload_config,
        prompt_format=factory.prompt_format,
        tokenizer_path=None,
        vocab_size=getattr(factory, "vocab_size", None),
        model=model,
        metrics=compute_metrics(records, duration_s),
        records=records,
        warmup_records=warmup_records,
        started_at=started_at,
    )


def default_label(model: str, client_config: ClientConfig, workload_config: WorkloadConfig) -> str:
    """``workload @ host:port`` (the model name is in the result file)."""
    netloc = urlparse(client_config.api_root).netloc or client_config.api_root
    return f"{workload_config.workload} @ {netloc}"


# ----------------------------------------------------------------------------------------------------------------
# Reports


def format_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_run_table(result: dict[str, Any]) -> str:
    """The human summary of one result (as loaded from JSON) for stdout."""
    metrics = result["metrics"]
    config = result["config"]
    width = 62
    lines = [
        f" prefixserve bench: {result['label']} ".center(width, "="),
        row("Server / model", f"{result['server']['base_url']} / {result['server']['model']}"),
        row("Workload", describe_workload(config)),
        row("Load", describe_load(config["load"])),
        row("Successful requests", metrics["num_completed"]),
        row("Failed requests", metrics["num_errors"]),
        row("Benchmark duration (s)", f"{metrics['duration_s']:.2f}"),
        row("Request throughput (req/s)", f"{metrics['request_throughput']:.2f}"),
        row("Output token throughput (tok/s)", f"{metrics['output_throughput']:.2f}"),
        row("Total token throughput (tok/s)", f"{metrics['total_token_throughput']:.2f}"),
        row("Prompt / output tokens", f"{metrics['prompt_tokens']} / {metrics['completion_tokens']}"),
        row("Cached prompt tokens", f"{metrics['cached_tokens']} ({100 * metrics['cached_token_rate']:.1f}%)"),
    ]
    if metrics["cached_tokens_by_source"]:
        by_source = ", ".join(f"{key} {value}" for key, value in sorted(metrics["cached_tokens_by_source"].items()))
        lines.append(row("Cached tokens by source", by_source))
    if metrics["num_usage_missing"]:
        lines.append(row("Responses without usage", metrics["num_usage_missing"]))
    lines.append("-" * width)
    lines.append(f"{'(ms)':<14}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_ms")):
        dist = metrics[key]
        lines.append(
            f"{name:<14}{format_ms(dist['mean']):>12}{format_ms(dist['p50']):>12}"
            f"{format_ms(dist['p90']):>12}{format_ms(dist['p99']):>12}"
        )
    lines.append("=" * width)
    return "\n".join(lines)


def row(name: str, value: Any) -> str:
    return f"{name + ':':<34}{value}"


def describe_workload(config: dict[str, Any]) -> str:
    """One line: workload, sizes and prompt format."""
    workload = config["workload"]
    output = workload["output_len_range"] or workload["output_len"]
    if isinstance(output, (list, tuple)):
        output = f"{output[0]}..{output[1]}"
    text = (
        f"{workload['workload']}, {workload['num_requests']} req, prefix {workload['prefix_len']} x "
        f"{config.get('num_prefixes_used', workload['num_prefixes'])}, suffix {workload['suffix_len']}, out {output}"
    )
    if workload["workload"] == "multi-turn":
        text += f", {workload['num_turns']} turns"
    return f"{text}, {config['prompt_format']} prompts"


def describe_load(load: dict[str, Any]) -> str:
    concurrency = load["concurrency"] or "unlimited"
    return f"concurrency {concurrency}, rate {load['request_rate']}/s, warm-up {load['warmup_requests']}"


def plot_ttft(result: dict[str, Any], path: str) -> None:
    """A PNG of the run's TTFT distribution: histogram and CDF."""
    plt = import_pyplot()
    ttfts = sorted(r["ttft_s"] * 1000 for r in result["requests"] if r["success"] and not r["warmup"])
    figure, (hist_axis, cdf_axis) = plt.subplots(1, 2, figsize=(11, 4))
    hist_axis.hist(ttfts, bins=min(40, max(5, len(ttfts) // 2)), color="tab:blue")
    hist_axis.set_xlabel("TTFT (ms)")
    hist_axis.set_ylabel("requests")
    draw_cdf(cdf_axis, ttfts, result["label"])
    figure.suptitle(f"TTFT: {result['label']} ({describe_workload(result['config'])})", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def draw_cdf(axis: Any, sorted_values: Sequence[float], label: str) -> None:
    """Draw an empirical CDF of ascending values on ``axis``."""
    count = len(sorted_values)
    axis.step(sorted_values, [(index + 1) / count for index in range(count)], where="post", label=label)
    axis.set_xlabel("TTFT (ms)")
    axis.set_ylabel("fraction of requests")
    axis.grid(alpha=0.3)


def import_pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (raises SystemExit with the install command when missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or 'prefixserve[bench]')") from exc
    return plt


# ----------------------------------------------------------------------------------------------------------------
# bench compare

COMPARE_COLUMNS = (
    # (header, getter over metrics, format, higher is better)
    ("req/s", lambda m: m["request_throughput"], "{:.2f}", True),
    ("out tok/s", lambda m: m["output_throughput"], "{:.1f}", True),
    ("TTFT mean", lambda m: m["ttft_ms"]["mean"], "{:.1f}", False),
    ("TTFT p50", lambda m: m["ttft_ms"]["p50"], "{:.1f}", False),
    ("TTFT p99", lambda m: m["ttft_ms"]["p99"], "{:.1f}", False),
    ("TPOT mean", lambda m: m["tpot_ms"]["mean"], "{:.2f}", False),
    ("ITL p50", lambda m: m["itl_ms"]["p50"], "{:.2f}", False),
    ("E2E p50", lambda m: m["e2e_ms"]["p50"], "{:.1f}", False),
    ("cached", lambda m: m["cached_token_rate"] * 100, "{:.1f}%", True),
    ("errors", lambda m: m["num_errors"], "{:d}", False),
)


def load_result(path: str) -> dict[str, Any]:
    """A result file written by ``prefixserve bench --result-file``."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def format_cell(value: Any, template: str) -> str:
    return "-" if value is None else template.format(value)


def ratio(value: Any, baseline: Any) -> str:
    """``value / baseline`` as ``1.23x`` ("-" when undefined)."""
    if value is None or baseline in (None, 0):
        return "-"
    return f"{value / baseline:.2f}x"


def compare_rows(results: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison (times in ms); each metric is followed by its ratio to the first run."""
    header = ["run", "workload"]
    for name, _, _, _ in COMPARE_COLUMNS:
        header.append(name)
    rows = []
    baseline = results[0]["metrics"]
    for result in results:
        metrics = result["metrics"]
        cells = [result["label"], result["config"]["workload"]["workload"]]
        for name, getter, template, _ in COMPARE_COLUMNS:
            cell = format_cell(getter(metrics), template)
            if result is not results[0] and getter(metrics) is not None and name != "errors":
                cell += f" ({ratio(getter(metrics), getter(baseline))})"
            cells.append(cell)
        rows.append(cells)
    return header, rows


def format_text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A fixed-width table."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(header, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend("  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)) for cells in rows)
    return "\n".join(lines)


def format_markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(str(cell).replace("|", "/") for cell in cells) + " |" for cells in rows)
    return "\n".join(lines)


def plot_comparison(results: Sequence[dict[str, Any]], path: str) -> None:
    """A 2 x 2 PNG: TTFT percentiles, TTFT CDFs, request throughput and cached-token rate per run."""
    plt = import_pyplot()
    labels = [result["label"] for result in results]
    positions = list(range(len(results)))
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    ttft_axis, cdf_axis, throughput_axis, cached_axis = axes.flat
    bar_width = 0.8 / len(PERCENTILES)
    for offset, q in enumerate(PERCENTILES):
        values = [result["metrics"]["ttft_ms"][f"p{q}"] or 0.0 for result in results]
        ttft_axis.bar([p + offset * bar_width for p in positions], values, bar_width, label=f"p{q}")
    ttft_axis.set_xticks([p + bar_width for p in positions], labels, rotation=15, ha="right", fontsize=8)
    ttft_axis.set_ylabel("TTFT (ms)")
    ttft_axis.legend()
    for result in results:
        ttfts = sorted(r["ttft_s"] * 1000 for r in result["requests"] if r["success"] and not r["warmup"])
        if ttfts:
            draw_cdf(cdf_axis, ttfts, result["label"])
    cdf_axis.legend(fontsize=8)
    throughput_axis.bar(positions, [result["metrics"]["request_throughput"] for result in results])
    throughput_axis.set_xticks(positions, labels, rotation=15, ha="right", fontsize=8)
    throughput_axis.set_ylabel("requests / s")
    cached_axis.bar(positions, [100 * result["metrics"]["cached_token_rate"] for result in results], color="tab:green")
    cached_axis.set_xticks(positions, labels, rotation=15, ha="right", fontsize=8)
    cached_axis.set_ylabel("cached prompt tokens (%)")
    cached_axis.set_ylim(0, 100)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def compare_main(argv: Sequence[str]) -> int:
    """``prefixserve bench compare A.json B.json ... [--plot out.png] [--markdown out.md]``."""
    parser = argparse.ArgumentParser(
        prog="prefixserve bench compare", description="Compare result files (ratios are to the first file)."
    )
    parser.add_argument("results", nargs="+", help="result files written by prefixserve bench --result-file")
    parser.add_argument("--plot", default=None, help="write a comparison chart (PNG) here")
    parser.add_argument("--markdown", default=None, help="also write the table as markdown here")
    parser.add_argument("--labels", default=None, help="comma-separated labels replacing the files' own")
    args = parser.parse_args(argv)
    results = [load_result(path) for path in args.results]
    if args.labels:
        for result, label in zip(results, args.labels.split(",")):
            result["label"] = label.strip()
    header, rows = compare_rows(results)
    print(format_text_table(header, rows))
    if args.markdown:
        Path(args.markdown).write_text(format_markdown_table(header, rows) + "\n", encoding="utf-8")
    if args.plot:
        plot_comparison(results, args.plot)
        print(f"chart written to {args.plot}")
    return 0


# ----------------------------------------------------------------------------------------------------------------
# CLI


def parse_output_range(text: str) -> tuple[int, int]:
    """``"a:b"`` -> (a, b)."""
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a:b with integers, got {text!r}") from exc
    return low, high


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``prefixserve bench`` flags."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    server.add_argument("--model", default=None, help="model name to send (default: first id from /v1/models)")
    server.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    server.add_argument("--api-key", default=None, help="sent as a Bearer token")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    server.add_argument("--return-token-ids", action="store_true",
                        help="ask for generated token ids (vLLM); multi-turn id prompts then resend the exact answer")
    server.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", choices=wl.WORKLOADS, default="shared-prefix")
    workload.add_argument("--num-requests", type=int, default=40)
    workload.add_argument("--num-prefixes", type=int, default=4, help="K distinct prefixes / system prompts")
    workload.add_argument("--prefix-len", type=int, default=1792, help="P: tokens per shared prefix")
    workload.add_argument("--suffix-len", type=int, default=256, help="S: tokens per request suffix / user turn")
    workload.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    workload.add_argument("--replica-cache-tokens", type=int, default=None,
                          help="cross-replica: one replica's cache size; K becomes 2 x ceil(this / P)")
    workload.add_argument("--output-len", type=int, default=32)
    workload.add_argument("--output-len-range", type=parse_output_range, default=None,
                          help="a:b, output lengths drawn uniformly (seeded) from [a, b]")
    workload.add_argument("--prompt-format", choices=wl.PROMPT_FORMATS, default=None,
                          help="token ids (default for completions) or words (default for chat)")
    workload.add_argument("--tokenizer", default=None, help="local HF tokenizer folder for exact token counts")
    workload.add_argument("--vocab-size", type=int, default=None,
                          help="id prompts draw ids from [100, this - 100) (default: the tokenizer's size, else 1024)")
    workload.add_argument("--seed", type=int, default=0)
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=4, help="requests in flight at most (0: unlimited)")
    load.add_argument("--request-rate", type=float, default=math.inf, help="sessions per second, Poisson (default inf)")
    load.add_argument("--warmup-requests", type=int, default=0, help="unmeasured requests of the same shape first")
    output = parser.add_argument_group("output")
    output.add_argument("--result-file", default=None, help="write the JSON result here")
    output.add_argument("--plot", default=None, help="write a PNG of the TTFT distribution here")
    output.add_argument("--label", default=None, help="name of this run in tables and charts")
    output.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def configs_from_args(args: argparse.Namespace) -> tuple[ClientConfig, LoadConfig, WorkloadConfig, str]:
    """The frozen configs a parsed command line describes, and the prompt format."""
    prompt_format = args.prompt_format or ("text" if args.endpoint == "chat" else "ids")
    if args.endpoint == "chat" and prompt_format == "ids":
        raise ValueError("--endpoint chat sends text: use --prompt-format text (with --tokenizer for exact lengths)")
    extra_body = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    client_config = ClientConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
        timeout_s=args.timeout, return_token_ids=args.return_token_ids, extra_body=extra_body,
    )
    load_config = LoadConfig(
        concurrency=args.concurrency, request_rate=args.request_rate, warmup_requests=args.warmup_requests,
        seed=args.seed,
    )
    workload_config = WorkloadConfig(
        workload=args.workload, num_requests=args.num_requests, num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len, output_len=args.output_len,
        output_len_range=args.output_len_range, num_turns=args.num_turns,
        replica_cache_tokens=args.replica_cache_tokens, seed=args.seed,
    )
    return client_config, load_config, workload_config, prompt_format


def write_json(path: str, content: dict[str, Any]) -> None:
    """Write ``content`` as indented JSON, creating parent folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(content, indent=1) + "\n", encoding="utf-8")


def run_main(argv: Sequence[str] | None) -> int:
    """``prefixserve bench ...``: run one benchmark and report it."""
    parser = add_arguments(argparse.ArgumentParser(
        prog="prefixserve bench",
        description="Benchmark an OpenAI-compatible server (subcommand: compare A.json B.json ...).",
    ))
    args = parser.parse_args(argv)
    try:
        client_config, load_config, workload_config, prompt_format = configs_from_args(args)
        tokenizer = wl.load_tokenizer(args.tokenizer) if args.tokenizer else None
        factory = wl.make_prompt_factory(prompt_format, args.vocab_size, tokenizer)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    try:
        run = asyncio.run(run_benchmark(
            client_config, load_config, workload_config, factory, tokenizer, args.label, not args.no_progress
        ))
    except RuntimeError as exc:
        print(f"prefixserve bench: {exc}", file=sys.stderr)
        return 2
    run.tokenizer_path = args.tokenizer
    result = run.to_json()
    print(format_run_table(result))
    print_errors(run.records)
    if args.result_file:
        write_json(args.result_file, result)
        print(f"result written to {args.result_file}")
    if args.plot:
        plot_ttft(result, args.plot)
        print(f"TTFT plot written to {args.plot}")
    return 0 if run.metrics.num_completed > 0 or run.metrics.num_requests == 0 else 1


def print_errors(records: Sequence[RequestRecord], limit: int = 5) -> None:
    """The first few distinct error messages, to stderr."""
    errors: dict[str, int] = {}
    for record in records:
        if record.error:
            errors[record.error] = errors.get(record.error, 0) + 1
    for message, count in list(errors.items())[:limit]:
        print(f"  {count} x {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``compare ...`` compares result files; anything else runs a benchmark."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
