"""The engine of one replica: requests in, one ``step()`` at a time, outputs out (synchronous; see async_engine).

A request enters in two calls on the engine thread, so each thing is checked once and fetching waits on nobody:

    plan(request)  -> AdmissionPlan: validated, page keys checked (count, page 0 re-hashed with this replica's
                      fingerprint and salt), the reusable pages the local cache lacks (``missing``)
    (the caller fetches ``missing`` from a peer / the shared tiers, off the engine thread: verified PageRecords)
    add(plan, fetched) -> queued; the scheduler uses the fetched pages that still continue the local hit on admission

A step: the scheduler picks chunks -> the model runner computes their KV into pages and returns logits for chunks that
end at a sequence's last token -> a token is sampled for each -> finished requests are released -> newly full pages
are committed to the prefix cache.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from common.errors import InvalidRequestError
from common.page_keys import PageKey, compute_page_keys
from common.types import (CachedTokens, EngineRequest, EngineStats, PinPrefix, PrefixReport, ProactiveCopyStats,
                          RequestLatencyStats,
                          RequestOutput)
from replica import cpu_kernels
from replica.compile import compile_thread_count, start_isa_probe
from replica.config import (PREFILL_THREADS_MIN_KEYS, PREFILL_THREADS_MIN_TOKENS, STEP_HELPER_ENV,
                            STEP_HELPER_MIN_TOKENS, EngineConfig)
from replica.detokenizer import IncrementalDetokenizer
from replica.export_buffers import ExportBuffers
from replica.kv_manager import KVCacheManager
from replica.landing import landing_page_ids
from replica.llama import names_compact_architecture
from replica.model_runner import ChunkInput, ModelRunner, eager_forced
from replica.page_record import PageRecord
from replica.sampling import sample_tokens
from replica.scheduler import PageImport, ScheduledChunk, Scheduler, num_reusable_pages
from replica.sequence import Sequence
from replica.shared_pool import SharedPoolBundle
from replica.tiers.base import RetentionUpdate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionPlan:
    """A validated request with its checked page keys, and what it could reuse from outside this replica::

        page index   | 0 | 1 | 2 | 3 | 4 (last, partial) |
        local cache  | x | x |                              missing = range(2, 4): pages 2..3 may come from a
                                                            peer or a tier; page 4 is always computed
    ``missing`` is empty with caching off. A hint: the cache may change before admission (the scheduler decides)."""

    request: EngineRequest
    page_keys: list[PageKey]
    missing: range

    def missing_token_ids(self, page_size: int) -> list[list[int]]:
        tokens = self.request.prompt_token_ids
        return [tokens[i * page_size : (i + 1) * page_size] for i in self.missing]


@dataclass
class _Tracked:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    num_reported_tokens: int = 0
    queued_at: float = 0.0
    """Monotonic times of the request's phases (``RequestLatencyStats``); 0.0: not yet."""
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0


def generator_seed(seed: int) -> int:
    """The 32 bits torch's CPU generator keeps of a request's ``seed``: the seed itself below 2**32 (as before), else
    a hash of all its bits (the generator would keep only the low 32: seeds 1 and 2**32 + 1 sampled alike)."""
    if 0 <= seed < 1 << 32:
        return seed
    digest = hashlib.blake2b(str(seed).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        device: torch.device | str = "cpu",
        multimodal: bool = False,
        clock=time.monotonic,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device(device)
        enable_prefix_caching = config.enable_prefix_caching and not multimodal
        if multimodal and config.enable_prefix_caching:
            logger.warning("multimodal model: prefix caching is switched off (image tokens are not keyed)")
        dtype = next(model.parameters()).dtype
        num_pages = config.num_pages or ModelRunner.pages_for_budget(
            model.config, page_size=config.page_size, dtype=dtype, budget_bytes=config.kv_cache_memory_bytes
        )
        if num_pages < 2:
            raise ValueError(
                f"the KV budget of {config.kv_cache_memory_bytes} bytes holds {num_pages} page(s); "
                "raise --kv-cache-memory (at least two pages are needed)"
            )
        share_pool = config.enable_peer_copy and config.share_kv_pool and enable_prefix_caching  # peers copy from it
        step_threads = (config.num_threads, config.prefill_threads) if self.device.type == "cpu" else ()
        self.max_model_len = self._resolve_max_model_len(model.config, num_pages)
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=config.page_size, device=self.device,
                                  enforce_eager=config.enforce_eager, shared_pool=share_pool,
                                  step_threads=step_threads, max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len)
        self.model_fingerprint = self.runner.fingerprint
        self.vocab_size = model.config.get_text_config().vocab_size
        self.kv = KVCacheManager(num_pages, config.page_size, enable_prefix_caching=enable_prefix_caching,
                                 max_retained_pages=int(num_pages * config.kv_cache_retention_budget),
                                 protected_fraction=config.kv_cache_protected_fraction, clock=clock)
        if self.runner.shared_pool is not None:
            self.kv.exports.generations = self.runner.shared_pool.generations
        self.export_buffers = ExportBuffers()
        """CPU memory for host bundles' copies, reused (``_copy_pages``)."""
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            model_fingerprint=self.model_fingerprint,
        )
        self.page_sink = None
        """Called with the ``PageRecord``s (kv: views of pool pages) newly computed and cached (the shared tiers)."""
        self.retention_sink = None
        """Called with ``RetentionUpdate``s: retention changes of cached or pinned pages that the shared tiers may
        already hold (after each step, a pin and an unpin; see ``KVCacheManager.drain_tier_retention``)."""
        self.step_observer = None
        """Called as ``(seconds, chunks)`` after each step's forward and sampling, before the chunks advance (the
        replica's cost meter, replica/cost_meter.py)."""
        self._step_threads = (config.num_threads, config.prefill_threads)
        """CPU torch threads of (short steps, steps of at least ``PREFILL_THREADS_MIN_TOKENS`` tokens)."""
        self._threads_now = 0
        # (the helper itself declines to arm where the process has one CPU)
        own_second_core = self._step_threads[0] == 1 and self._step_threads[1] >= 2
        helper = own_second_core and os.environ.get(STEP_HELPER_ENV, "") != "0"
        pair_rows = self.runner.pair_rows if helper else (0, 0)
        self._helper_rows = (max(STEP_HELPER_MIN_TOKENS, pair_rows[0]), pair_rows[1])
        """Steps on one thread of ``[min, max)`` tokens arm the step helper (``_set_step_threads``; it shares their
        pair-kernel linear layers and decode attention)."""
        self._tracked: dict[str, _Tracked] = {}
        self._arrivals = itertools.count()
        self.latency = RequestLatencyStats()
        self.num_requests_finished = 0
        self.proactive = ProactiveCopyStats()
        """Hot-prefix replication counters (``import_prefix`` and the async engine's ``prefetch_prefix``)."""

    @property
    def enable_prefix_caching(self) -> bool:
        """Off when the config says so or the model is multimodal (the cache is then a ``NullPrefixCache``)."""
        return self.kv.enable_prefix_caching

    def _resolve_max_model_len(self, model_config, num_pages: int) -> int:
        text_config = model_config.get_text_config()
        model_max = getattr(text_config, "max_position_embeddings", None) or 2048
        wanted = self.config.max_model_len or model_max
        if wanted > model_max:
            raise ValueError(f"--max-model-len {wanted} exceeds the model's {model_max} positions; lower it")
        capacity = num_pages * self.config.page_size
        if wanted > capacity:
            logger.warning("max model length lowered from %d to %d tokens: the KV pool holds no more", wanted, capacity)
            wanted = capacity
        return wanted

    # ---- requests ------------------------------------------------------------------------------------------------
    def plan(self, request: EngineRequest, page_keys: list[PageKey] | None = None) -> AdmissionPlan:
        """Validate the request (``InvalidRequestError`` if it can never be served), compute its page keys (or take
        ``page_keys``, which this engine's ``page_keys`` computed for it off the engine thread), and find the reusable
        pages the local cache lacks. Changes nothing."""
        tokens = request.prompt_token_ids
        num_prompt = len(tokens)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens; this model serves at most {self.max_model_len} tokens "
                f"(prompt + output), so shorten the prompt"
            )
        bad = [t for t in tokens if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        if request.request_id in self._tracked:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        retention = request.retention
        if retention is not None and self.enable_prefix_caching:
            num_retained = retention.num_pages(num_prompt, self.config.page_size)
            if num_retained > self.kv.pool.max_retained_pages:
                raise InvalidRequestError(
                    f"the retained prefix covers {num_retained} pages; this replica retains at most "
                    f"{self.kv.pool.max_retained_pages} (--kv-cache-retention-budget); retain a shorter prefix")
        if not self.enable_prefix_caching:
            return AdmissionPlan(request, [], range(0))
        keys = self._checked_page_keys(request, page_keys)
        num_reusable = num_reusable_pages(num_prompt, self.config.page_size)
        return AdmissionPlan(request, keys, range(len(self.kv.match_prefix(keys[:num_reusable])), num_reusable))

    def add(self, plan: AdmissionPlan, fetched: list[PageRecord] | tuple[PageRecord, ...] = ()) -> None:
        """Queue a planned request. ``fetched``: verified pages for ``plan.missing`` from its first index on."""
        request = plan.request
        if request.request_id in self._tracked:  # a request with this id was queued while this one was fetching
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(generator_seed(request.sampling.seed))
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            arrival_index=next(self._arrivals),
            cache_salt=request.cache_salt,
            generator=generator,
            page_keys=list(plan.page_keys),
            fetched=tuple(fetched),
            first_fetched_index=plan.missing.start,
            retention=request.retention if self.enable_prefix_caching else None,
            num_retained_pages=(request.retention.num_pages(len(request.prompt_token_ids), self.config.page_size)
                                if request.retention is not None and self.enable_prefix_caching else 0),
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.sampling.stop)
        self.kv.acquire(landing_page_ids(seq.fetched), reuse=False)  # the queued request's own references
        self._tracked[request.request_id] = _Tracked(seq, detokenizer, queued_at=time.monotonic())
        self.scheduler.add(seq)

    def reserve_landing(self, num_pages: int, keep: list[PageKey] | tuple = ()) -> list[int]:
        """Pool pages for a shared-tier fetch of ``num_pages`` pages to decrypt into (replica/landing.py), each with
        one reference the caller gives back with ``kv.release``; none (``[]``) unless the pool's KV lies in host
        memory and all of them fit in half of the free pages (the rest stays for the running requests).
        ``keep``: the request's leading page keys (its local hit is not evicted to make room)."""
        if self.device.type != "cpu" or num_pages <= 0:
            return []
        kept = self.kv.match_prefix(list(keep))
        self.kv.acquire(kept, reuse=False)
        try:
            return self.kv.allocate(num_pages) if num_pages <= self.kv.num_free_pages // 2 else []
        finally:
            self.kv.release(kept)

    def landing_views(self, page_ids: list[int]) -> list[torch.Tensor]:
        """The KV of pool pages (``reserve_landing``'s) as tensors a tier load writes into."""
        return [self.runner.read_page(page_id) for page_id in page_ids]

    def add_request(self, request: EngineRequest) -> None:
        """``add(plan(request))``: queue a request that fetches nothing from outside (tests, benchmarks)."""
        self.add(self.plan(request))

    def _checked_page_keys(self, request: EngineRequest, computed: list[PageKey] | None = None) -> list[PageKey]:
        """The prompt's page keys, computed by this engine (here, ~0.06 ms per 1000 tokens, or ``computed`` by the
        async engine before): a key decides which cached KV a request reads and under which key the pages it computes
        are cached, so one from outside the engine is never trusted. The ingress's keys (it computes them to route)
        are only compared, and a mismatch logged."""
        keys = computed if computed is not None else self.page_keys(request.prompt_token_ids, request.cache_salt)
        if request.page_keys is not None and list(request.page_keys) != keys:
            logger.warning("request %s came with page keys this replica does not make (another model, page size or "
                           "key format at the ingress?); using its own", request.request_id)
        return keys

    def abort(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(tracked.seq, "abort")
        return self._output(tracked, [], "", finished=True)

    def pending_fetched_pages(self) -> dict[PageKey, PageRecord]:
        """Verified pages fetched for queued requests and not yet imported, by key (another request for the same
        pages can use them instead of fetching again)."""
        pages = {}
        for seq in self.scheduler.waiting:
            for page in seq.fetched:
                pages.setdefault(page.key, page)
        return pages

    def keys_being_computed(self) -> set[PageKey]:
        """Keys of full pages running requests are computing now (the scheduler holds back a request that needs one
        until it is committed)."""
        return self.scheduler.in_flight_keys()

    def request_ids(self) -> list[str]:
        return list(self._tracked)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def page_keys(self, token_ids: list[int], salt: str | None = None) -> list[PageKey]:
        return compute_page_keys(
            token_ids, page_size=self.config.page_size, model_fingerprint=self.model_fingerprint, salt=salt
        )

    # ---- one step ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        finally:
            self._forward_tier_retention()

    def _forward_tier_retention(self) -> None:
        """Hand the retention changes of this step (or pin / unpin) to ``retention_sink``, ends on the wall clock."""
        changes = self.kv.drain_tier_retention()
        if not changes or self.retention_sink is None:
            return
        offset = time.time() - self.kv.clock()
        self.retention_sink([RetentionUpdate(key, priority, end + offset if priority else 0.0)
                             for key, priority, end in changes])

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self.kv.exports.set_computing(self.scheduler.in_flight_keys())  # a peer's export may wait for these
        if not plan.chunks:
            return []
        helper = self._set_step_threads(plan.num_tokens, plan.chunks)
        try:  # (armed early: the helper wakes while the imports and inputs are made)
            self._import_pages(plan.imports)
            self._note_scheduled(plan.admitted)
            inputs = []
            for chunk in plan.chunks:
                seq = chunk.seq
                start = seq.num_computed_tokens
                inputs.append(
                    ChunkInput(
                        token_ids=seq.token_ids[start : start + chunk.num_new_tokens],
                        start_pos=start,
                        page_ids=seq.page_ids,
                        sample=start + chunk.num_new_tokens == seq.num_tokens,
                    )
                )
            started = time.perf_counter()
            logits = self.runner.run(inputs)
        finally:
            if helper:
                cpu_kernels.arm_step_helper(False)
        sampling_seqs = [chunk.seq for chunk, inp in zip(plan.chunks, inputs) if inp.sample]
        new_tokens = sample_tokens(
            logits, [seq.sampling for seq in sampling_seqs], [seq.generator for seq in sampling_seqs]
        )
        if self.step_observer is not None:
            self.step_observer(time.perf_counter() - started, plan.chunks)
        newly_cached = []
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
            newly_cached.extend(self.scheduler.commit_computed_pages(chunk.seq))
        if newly_cached and self.page_sink is not None:
            records = []
            for page in newly_cached:
                priority, until = self._tier_retention(page.page_id)
                records.append(PageRecord(page.key, page.token_ids, self.runner.read_page(page.page_id),
                                          retention_priority=priority, retain_until=until, salted=page.salted))
            self.page_sink(records)
        outputs = []
        produced_at = time.monotonic()
        for seq, token in zip(sampling_seqs, new_tokens):
            seq.output_token_ids.append(token)
            self._note_token(self._tracked[seq.request_id], produced_at)
            outputs.append(self._advance(seq))
        return [output for output in outputs if output is not None]

    def _set_step_threads(self, num_tokens: int, chunks: list[ScheduledChunk]) -> bool:
        """CPU: run this step on the prefill thread count when it is long enough (``num_tokens`` new tokens) or its
        ``chunks`` attend enough keys (context plus new tokens, summed), else on the decode one. Called on the thread
        that steps (torch's thread count is per calling thread); a change costs ~0.3 ms. Returns whether it armed the
        step helper for this step (``_helper_rows``; the caller disarms it after the forward)."""
        if self.device.type != "cpu" or self._step_threads[0] == self._step_threads[1]:
            return False
        long_step = num_tokens >= PREFILL_THREADS_MIN_TOKENS or sum(
            chunk.seq.num_computed_tokens + chunk.num_new_tokens for chunk in chunks) >= PREFILL_THREADS_MIN_KEYS
        wanted = self._step_threads[long_step]
        if wanted != self._threads_now:
            torch.set_num_threads(wanted)
            self._threads_now = wanted
        helper = not long_step and self._helper_rows[0] <= num_tokens < self._helper_rows[1]
        if helper:
            cpu_kernels.arm_step_helper(True)
        return helper

    # ---- request timings (RequestLatencyStats: vLLM's engine-side queue / prefill / decode / inter-token times) ----
    def _note_scheduled(self, admitted: list[Sequence]) -> None:
        now = time.monotonic()
        for seq in admitted:
            tracked = self._tracked.get(seq.request_id)
            if tracked is not None and not tracked.scheduled_at:  # a preempted request's re-admission keeps the first
                tracked.scheduled_at = now

    def _note_token(self, tracked: _Tracked, produced_at: float) -> None:
        if tracked.first_token_at:
            self.latency.inter_token.observe(produced_at - tracked.last_token_at)
        else:
            tracked.first_token_at = produced_at
        tracked.last_token_at = produced_at

    def _note_finished(self, tracked: _Tracked) -> None:
        latency = self.latency
        scheduled_at = tracked.scheduled_at or tracked.first_token_at
        latency.queue.observe(scheduled_at - tracked.queued_at)
        latency.prefill.observe(tracked.first_token_at - scheduled_at)
        decode_s = tracked.last_token_at - tracked.first_token_at
        latency.decode.observe(decode_s)
        num_later_tokens = len(tracked.seq.output_token_ids) - 1
        if num_later_tokens > 0:
            latency.time_per_output_token.observe(decode_s / num_later_tokens)

    def _tier_retention(self, page_id: int, *, peek: bool = False) -> tuple[int, float]:
        """(priority, wall-clock end) of a page's retention, for the shared tiers ((0, 0.0): none). ``peek``: as last
        recorded, without expiring (safe off the engine thread)."""
        pool = self.kv.pool
        retention = pool.peek_retention(page_id) if peek else pool.retention_of(page_id)
        if retention is None:
            return 0, 0.0
        return retention.priority, retention.expires_at - self.kv.clock() + time.time()

    def _import_pages(self, imports: list[PageImport]) -> None:
        """Write fetched pages into the pool pages the scheduler gave them, then register them in the prefix cache
        (a page another request committed meanwhile is shared instead)."""
        for item in imports:
            page_id = item.seq.page_ids[item.page_index]
            if page_id != item.page.landing_page:  # a landing page is in the page table already: no copy
                self.runner.write_page(page_id, item.page.kv)
            index, keys = item.page_index, item.seq.page_keys
            result = self.kv.commit_page(page_id, item.page.key, item.page.token_ids,
                                         parent_key=keys[index - 1] if index and len(keys) >= index else None,
                                         salted=item.seq.cache_salt is not None)
            item.seq.page_ids[item.page_index] = result.page_id
            self.kv.mark_reused(result.page_id)
            self.scheduler.retain_pages(item.seq, [result.page_id], item.page_index)

    def _advance(self, seq: Sequence) -> RequestOutput | None:
        tracked = self._tracked[seq.request_id]
        token = seq.output_token_ids[-1]
        params = seq.sampling
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        text_ids = seq.output_token_ids[:-1] if reason == "stop" else seq.output_token_ids
        detok = tracked.detokenizer.update(text_ids, finished=reason is not None)
        if detok.stopped:
            reason = "stop"
        new_ids = seq.output_token_ids[tracked.num_reported_tokens :]
        tracked.num_reported_tokens = len(seq.output_token_ids)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._note_finished(tracked)
            del self._tracked[seq.request_id]
            self.num_requests_finished += 1
        return self._output(tracked, new_ids, detok.new_text, finished=reason is not None)

    def _output(self, tracked: _Tracked, new_ids: list[int], new_text: str, *, finished: bool) -> RequestOutput:
        seq = tracked.seq
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            cached_tokens=CachedTokens.of(seq.cached_by_source),
            replica_id=self.config.replica_id,
            cache_write_tokens=seq.num_cache_write_tokens,
        )

    def export_pages(self, keys: list[PageKey], *, to_cpu: bool = True, contiguous: bool = False) -> list[PageRecord]:
        """Copies of the leading run of ``keys`` held in this replica's cache, on the CPU
        or (``to_cpu=False``) on this replica's device, for a device-to-device copy into a peer on the same GPU
        host. The pages are pinned (referenced) while they are copied. Runs on the engine thread between steps.
        ``contiguous``: the copies are the consecutive slots of one tensor (a peer bundle is then that tensor, with
        no second copy; see ``peer_copy.bundle_pages``)."""
        page_ids = self.kv.match_prefix(keys)
        self.kv.acquire(page_ids, reuse=False)
        try:
            token_ids = [self.kv.cache.page_to_token_ids[page_id] for page_id in page_ids]
            return self._copy_pages(keys, page_ids, token_ids, to_cpu=to_cpu, contiguous=contiguous)
        finally:
            self.kv.release(page_ids)

    def export_pages_concurrently(self, keys: list[PageKey], *, to_cpu: bool = True, contiguous: bool = False,
                                  wait_for_computing_s: float = 0.0) -> list[PageRecord]:
        """``export_pages`` for any thread, without waiting for the engine step (a peer's copy from a busy replica).

        The leading run of ``keys`` that is cached now is pinned in the export index (``replica/export_index.py``):
        the engine cannot hand those pages out for other tokens until they are unpinned, and a cached page's KV never
        changes, so the copy reads exactly the KV committed under each key. The engine's reference counts and free
        queue are not touched (an export changes no eviction order). ``wait_for_computing_s``: if the first page not
        cached is being computed now, wait up to that long for it (and the pages after it) to be committed."""
        if wait_for_computing_s > 0:
            self.kv.exports.wait_for_computing(keys, wait_for_computing_s)
        pinned = self.kv.exports.pin_prefix(keys)
        try:
            pages = self._copy_pages([page.key for page in pinned], [page.page_id for page in pinned],
                                     [page.token_ids for page in pinned], to_cpu=to_cpu, contiguous=contiguous,
                                     peek=True)
            if pages and pages[0].kv.device.type == "cuda":  # the copies are queued: done before the pages are free
                torch.cuda.current_stream(pages[0].kv.device).synchronize()
            return pages
        finally:
            self.kv.exports.unpin([page.page_id for page in pinned])

    def share_pages(self, keys: list[PageKey], *, wait_for_computing_s: float = 0.0) -> SharedPoolBundle | None:
        """For a peer on this node: where the leading run of ``keys`` cached now lies in the pool's shared memory,
        with the pages' generations (the peer copies them itself and checks the generations; replica/shared_pool.py).
        Any thread; nothing is pinned or copied. None when the pool is private memory."""
        shared = self.runner.shared_pool
        if shared is None:
            return None
        if wait_for_computing_s > 0:
            self.kv.exports.wait_for_computing(keys, wait_for_computing_s)
        pages, generations = self.kv.exports.published_prefix(keys)
        return shared.bundle([page.key for page in pages], [page.token_ids for page in pages],
                             [page.page_id for page in pages], generations)

    def _copy_pages(self, keys, page_ids, token_ids, *, to_cpu: bool, contiguous: bool,
                    peek: bool = False) -> list[PageRecord]:
        """PageRecords holding copies of the pinned pages ``page_ids`` (``peek``: read retention without expiring,
        off the engine thread)."""
        pages = []
        stacked = None
        if contiguous and page_ids:
            first = self.runner.read_page(page_ids[0])
            if to_cpu:  # memory already mapped, reused once the last export's copy is gone (export_buffers.py)
                stacked = self.export_buffers.take((len(page_ids), *first.shape), first.dtype)
            else:
                stacked = torch.empty((len(page_ids), *first.shape), dtype=first.dtype, device=first.device)
        for index, (key, page_id, tokens) in enumerate(zip(keys, page_ids, token_ids)):
            kv = self.runner.read_page(page_id)
            if stacked is not None:
                copy = stacked[index].copy_(kv)
            else:
                copy = kv.to("cpu", copy=True) if to_cpu else kv.clone()
            priority, until = self._tier_retention(page_id, peek=peek)
            pages.append(PageRecord(key, tokens, copy, retention_priority=priority, retain_until=until))
        return pages

    def import_prefix(self, page_keys: list[PageKey], first_index: int, pages: list[PageRecord] | tuple = (), *,
                      salted: bool = False) -> tuple[int, int]:
        """Hot-prefix replication: cache verified ``pages`` (``pages[i]`` is the page of ``page_keys[first_index + i]``)
        ahead of the requests that will need them, with no compute. Runs on the engine thread between steps::

            page index  | 0 | 1 | 2 | 3 | 4 |
            cached now  | x | x | x |            num_local = 3 (a request cached page 2 while the copy ran)
            pages           | p1| p2| p3| p4|    first_index = 1  -> p3, p4 are written; p1, p2 are not needed

        The cached run is pinned while pages are allocated (allocation may evict the least recently used free pages,
        never those). Only free pages are used, and the imported pages are released at once (cached, free: the next
        request hits them, allocation can still evict them), so running requests never lose a page to a copy. Pages
        that no longer continue the cached run (a page before them was evicted meanwhile) are not imported.
        Returns (pages newly cached, pages of the prefix that were already cached)."""
        local_ids = self.kv.match_prefix(page_keys)
        num_local = len(local_ids)
        skip = num_local - first_index
        if skip < 0 or skip >= len(pages):
            return 0, num_local
        self.kv.acquire(local_ids, reuse=False)
        held, new_keys, unused = [], [], []
        try:
            todo = list(pages[skip : skip + self.kv.num_free_pages])
            unused = self.kv.allocate(len(todo)) if todo else []
            for offset, page in enumerate(todo):
                index = num_local + offset
                if page.key != page_keys[index]:  # the fetcher verified the order; never cache a page under a wrong key
                    break
                page_id = unused.pop(0)
                try:
                    self.runner.write_page(page_id, page.kv)
                    result = self.kv.commit_page(page_id, page.key, page.token_ids,
                                                 parent_key=page_keys[index - 1] if index else None, salted=salted,
                                                 requested=False)
                except BaseException:
                    self.kv.release([page_id])  # uncached: back to the head of the free queue
                    raise
                held.append(result.page_id)
                if result.newly_cached:
                    new_keys.append(page.key)
        finally:  # a failed write or commit (a device error) leaks no page: what was not imported goes back
            self.kv.release(unused)
            self.kv.release(held)
            self.kv.release(local_ids)
            self.kv.mark_proactive(new_keys)
            self.proactive.num_pages_copied += len(new_keys)
        return len(new_keys), num_local

    # ---- management ----------------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def pin_prefix(self, pin: PinPrefix) -> tuple[int, int]:
        """Admin: retain a prefix here (see ``KVCacheManager.pin_prefix``); (pages cached here, pages retained)."""
        if not self.enable_prefix_caching:
            return 0, 0
        result = self.kv.pin_prefix(pin)
        self._forward_tier_retention()
        return result

    def take_back_pin(self, prefix_id: str, pin_id: str = "") -> bool:
        """Admin: undo a pin whose warm-up failed (see ``KVCacheManager.take_back_pin``)."""
        found = self.kv.take_back_pin(prefix_id, pin_id)
        self._forward_tier_retention()
        return found

    def unpin_prefix(self, prefix_id: str) -> bool:
        found = self.kv.unpin_prefix(prefix_id)
        self._forward_tier_retention()
        return found

    def prefix_reports(self) -> list[PrefixReport]:
        return self.kv.prefix_reports(self.config.replica_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            replica_id=self.config.replica_id,
            num_prompt_tokens_queried=self.scheduler.num_prompt_tokens_queried,
            num_prompt_tokens_hit=self.scheduler.num_prompt_tokens_hit,
            num_prompt_tokens_hit_local=self.scheduler.num_prompt_tokens_hit_local,
            num_pages_total=self.kv.num_pages,
            num_pages_free=self.kv.num_free_pages,
            num_pages_cached=self.kv.num_cached_pages,
            num_pages_in_use=self.kv.num_pages_in_use,
            num_evictions=self.kv.num_evictions,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_requests_finished=self.num_requests_finished,
            page_size=self.config.page_size,
            kv_cache=self.kv.kv_cache_metrics(),
            proactive=self.proactive_stats(),
            latency=self.latency.copy(),
        )

    def proactive_stats(self) -> ProactiveCopyStats:
        stats = self.proactive
        return ProactiveCopyStats(stats.num_prefetches, stats.num_failed, stats.num_pages_copied,
                                  stats.num_pages_present, self.kv.num_proactive_hit_pages,
                                  self.kv.num_proactive_hit_requests)

    def check_integrity(self, other_holders: list[list[int]] | tuple = ()) -> None:
        """Pool, cache and page tables consistent: every reference is a running request's page, a queued request's
        landing page, or one of ``other_holders`` (the pages held by fetches, see ``AsyncEngine.check_integrity``)."""
        tables = [seq.page_ids for seq in self.scheduler.running]
        tables += [landing_page_ids(seq.fetched) for seq in self.scheduler.waiting]
        self.kv.check_integrity(tables + [list(ids) for ids in other_holders])
        for seq in self.scheduler.waiting:
            if seq.page_ids:
                raise AssertionError(f"waiting request {seq.request_id} holds pages")
        for seq in self.scheduler.running:
            needed = -(-seq.num_computed_tokens // self.config.page_size)
            if len(seq.page_ids) < needed:
                raise AssertionError(f"request {seq.request_id} has fewer pages than computed tokens need")


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16), so bf16 matmuls beat float32; on
    AVX2-only CPUs they are emulated and ~10x slower than float32."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(config: EngineConfig) -> tuple[torch.dtype, str]:
    """The weights' and KV dtype, and why: ``auto`` is bfloat16 on GPU and on CPUs with native bf16, else float32."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype), f"--dtype {config.dtype}"
    if config.devices == "gpu":
        return torch.bfloat16, "auto: GPU"
    if cpu_has_native_bf16():
        return torch.bfloat16, "auto: this CPU has native bf16 matmuls (AMX / AVX512-BF16)"
    return torch.float32, "auto: this CPU has no native bf16 matmuls"


def dtype_line(replica_id: str, dtype: torch.dtype, reason: str) -> str:
    """The start-up log's line saying which dtype a replica runs in, and why (``resolve_dtype``'s answer)."""
    return f"replica {replica_id} runs in {str(dtype).removeprefix('torch.')} ({reason})"


def startup_line(replica_id: str, seconds: float, backend: str, forward_seconds: float) -> str:
    """The start-up log's line saying how long a replica took to start and how much of it went to its forward pass
    (``ModelRunner.startup_seconds``: the compiled forward is traced, compiled and warmed up then; inductor's cache on
    disk makes a later start of the same model faster)."""
    return f"replica {replica_id} started in {seconds:.1f} s, its {backend} forward ready in {forward_seconds:.1f} s"


def compile_threads(config: EngineConfig) -> int:
    """Threads the model is loaded and compiled on: ``replica.compile.compile_thread_count`` of the counts its steps
    run on (CPU: ``num_threads`` and ``num_prefill_threads``)."""
    if config.devices != "cpu":
        return config.num_threads
    return compile_thread_count((config.num_threads, config.prefill_threads))


def build_engine(config: EngineConfig) -> LLMEngine:
    """Resolve and load the model named by ``config.model`` and build the engine around it."""
    from replica.model_loader import (eos_token_ids, is_multimodal_config, load_model, read_config_json,
                                      resolve_model_dir)

    if config.devices == "gpu" and not torch.cuda.is_available():
        raise ValueError("--devices gpu was asked for but no CUDA device is visible; use --devices cpu")
    torch.set_num_threads(compile_threads(config))
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    dtype, reason = resolve_dtype(config)
    logger.info("%s", dtype_line(config.replica_id, dtype, reason))
    device = "cuda" if config.devices == "gpu" else "cpu"
    if (device == "cpu" and not eager_forced(config.enforce_eager)
            and names_compact_architecture(read_config_json(model_dir))):  # (others: transformers' path, uncompiled)
        start_isa_probe()  # while the model loads
    loaded = load_model(model_dir, dtype, config.devices)
    engine = LLMEngine(
        config,
        loaded.model,
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        device=device,
        multimodal=is_multimodal_config(loaded.config),
    )
    # threads started from here on (the engine thread, peer exports, tier loads) take this count on their first torch
    # op; the engine thread then sets each step's own
    torch.set_num_threads(config.num_threads)
    return engine
