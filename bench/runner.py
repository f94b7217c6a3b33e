"""The session driver: sends a workload's sessions to a server and collects one :class:`RequestRecord` per request.

:func:`run_benchmark` runs the warm-up phase, then the measured one. In a phase, :class:`PhaseRunner` starts each
session at its seeded Poisson arrival time (:func:`arrival_delays`), keeps at most ``concurrency`` requests in flight,
and sends a session's turns in order, each resending the conversation so far (:class:`Conversation`) with the model's
earlier answers (:func:`answer_piece`). Every request streams with temperature 0 and ``ignore_eos``, so the server
generates exactly ``max_tokens`` tokens (:func:`build_payload`). A failed request is recorded, never raised.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import math
import random
import sys
import time
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Sequence
from urllib.parse import urlparse

from bench import workloads as wl
from bench.client import StreamResult, discover_model, make_http_client, stream_request
from bench.config import ClientConfig, LoadConfig
from bench.metrics import RequestRecord, compute_metrics, usage_counts
from bench.result import BenchRun
from bench.workloads import Prompt, PromptFactory, Session, WorkloadConfig


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
    not_sent = StreamResult(error="skipped: an earlier turn of this conversation failed")
    return make_record(session, turn_number, warmup, None, start_s, not_sent)


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
            if turn.min_gap_s and records:
                await asyncio.sleep(max(0.0, records[-1].start_s + turn.min_gap_s - self.elapsed()))
            conversation.add_user(turn.user)
            payload = build_payload(self.client_config, self.model, conversation, turn.output_len)
            client_prompt_len = count_client_prompt_len(conversation, self.factory, self.tokenizer)
            async with self.slot():
                start_s = self.elapsed()
                result = await stream_request(
                    self.client, self.client_config.request_url, payload, self.client_config.headers
                )
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
        delays = [d if s.start_s is None else s.start_s for s, d in zip(sessions, delays)]  # a trace's own times
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
