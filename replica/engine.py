"""The engine of one replica: requests in, one ``step()`` at a time, outputs out (synchronous; see async_engine).

A step: the scheduler picks chunks -> the model runner computes their KV into pages and returns logits for chunks that
end at a sequence's last token -> a token is sampled for each -> finished requests are released -> newly full pages
are committed to the prefix cache.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from replica.config import EngineConfig
from replica.detokenizer import IncrementalDetokenizer
from replica.kv_manager import KVCacheManager
from replica.model_runner import ChunkInput, ModelRunner
from replica.outputs import CachedTokens, EngineRequest, EngineStats, RequestOutput
from replica.page_keys import PageKey, compute_page_keys
from replica.sampling import sample_tokens
from replica.scheduler import Scheduler, num_reusable_pages
from replica.sequence import Sequence

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The request can never be served as given (the HTTP layer answers 400 with this message)."""


@dataclass
class _Tracked:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    num_reported_tokens: int = 0


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
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device(device)
        self.enable_prefix_caching = config.enable_prefix_caching and not multimodal
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
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=config.page_size, device=self.device)
        self.model_fingerprint = self.runner.fingerprint
        self.vocab_size = model.config.get_text_config().vocab_size
        self.max_model_len = self._resolve_max_model_len(model.config, num_pages)
        self.kv = KVCacheManager(num_pages, config.page_size, enable_prefix_caching=self.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            model_fingerprint=self.model_fingerprint,
            import_page=self.runner.write_page,
        )
        self.page_sink = None
        """Called with ``[(key, token_ids, kv view)]`` for pages newly computed and cached (the shared tiers)."""
        self._tracked: dict[str, _Tracked] = {}
        self._arrivals = itertools.count()
        self.num_requests_finished = 0

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
    def validate(self, request: EngineRequest) -> None:
        """Raise ``InvalidRequestError`` if the request can never be served."""
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens; this model serves at most {self.max_model_len} tokens "
                f"(prompt + output), so shorten the prompt"
            )
        bad = [t for t in request.prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        if request.request_id in self._tracked:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")

    def add_request(self, request: EngineRequest, preloaded: dict | None = None) -> None:
        """Queue a request. ``preloaded`` maps page index -> FetchedPage (KV fetched from a peer or a shared tier);
        pages that still extend the local hit when the request is admitted are used, the rest ignored."""
        self.validate(request)
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(request.sampling.seed)
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            arrival_index=next(self._arrivals),
            cache_salt=request.cache_salt,
            generator=generator,
            preloaded=dict(preloaded or {}),
        )
        self._tracked[request.request_id] = _Tracked(seq, IncrementalDetokenizer(self.tokenizer, request.sampling.stop))
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(tracked.seq, "abort")
        return self._output(tracked, [], "", finished=True)

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
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
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
        logits = self.runner.run(inputs)
        sampling_seqs = [chunk.seq for chunk, inp in zip(plan.chunks, inputs) if inp.sample]
        new_tokens = sample_tokens(
            logits, [seq.sampling for seq in sampling_seqs], [seq.generator for seq in sampling_seqs]
        )
        newly_cached = []
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
            newly_cached.extend(self.scheduler.commit_computed_pages(chunk.seq))
        if newly_cached and self.page_sink is not None:
            self.page_sink([(key, tokens, self.runner.read_page(page_id)) for page_id, key, tokens in newly_cached])
        outputs = []
        for seq, token in zip(sampling_seqs, new_tokens):
            seq.output_token_ids.append(token)
            outputs.append(self._advance(seq))
        return [output for output in outputs if output is not None]

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
            del self._tracked[seq.request_id]
            self.num_requests_finished += 1
        return self._output(tracked, new_ids, detok.new_text, finished=reason is not None)

    def _output(self, tracked: _Tracked, new_ids: list[int], new_text: str, *, finished: bool) -> RequestOutput:
        seq = tracked.seq
        sources = seq.cached_by_source
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            cached_tokens=CachedTokens(**{k: sources.get(k, 0) for k in ("local", "peer", "host", "disk")}),
            replica_id=self.config.replica_id,
        )

    def missing_pages(self, token_ids: list[int], page_keys: list[PageKey]) -> range:
        """Indices of the prompt's reusable pages that the local cache lacks, from the first miss on (empty with
        caching off). A hint only: the cache may change before the request is admitted."""
        num_reusable = num_reusable_pages(len(token_ids), self.config.page_size)
        if not self.enable_prefix_caching:
            return range(0)
        return range(len(self.kv.match_prefix(page_keys[:num_reusable])), num_reusable)

    def export_pages(
        self, keys: list[PageKey], *, to_cpu: bool = True
    ) -> list[tuple[PageKey, tuple[int, ...], torch.Tensor]]:
        """Copies of the leading run of ``keys`` held in this replica's cache: ``(key, token_ids, kv)``, on the CPU
        or (``to_cpu=False``) on this replica's device, for a device-to-device copy into a peer on the same GPU
        host. The pages are pinned (referenced) while they are copied. Runs on the engine thread between steps."""
        page_ids = self.kv.match_prefix(keys)
        self.kv.acquire(page_ids)
        try:
            pages = []
            for key, page_id in zip(keys, page_ids):
                kv = self.runner.read_page(page_id)
                pages.append((key, self.kv.cache.page_to_token_ids[page_id],
                              kv.to("cpu", copy=True) if to_cpu else kv.clone()))
            return pages
        finally:
            self.kv.release(page_ids)

    # ---- management ----------------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return EngineStats(
            replica_id=self.config.replica_id,
            num_prompt_tokens_queried=self.scheduler.num_prompt_tokens_queried,
            num_prompt_tokens_hit=self.scheduler.num_prompt_tokens_hit,
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
        )

    def check_integrity(self) -> None:
        tables = [seq.page_ids for seq in self.scheduler.running]
        self.kv.check_integrity(tables)
        for seq in self.scheduler.waiting:
            if seq.page_ids:
                raise AssertionError(f"waiting request {seq.request_id} holds pages")
        for seq in self.scheduler.running:
            needed = -(-seq.num_computed_tokens // self.config.page_size)
            if len(seq.page_ids) < needed:
                raise AssertionError(f"request {seq.request_id} has fewer pages than computed tokens need")


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    """``auto`` is bfloat16 on GPU and float32 on CPU."""
    if config.dtype == "auto":
        return torch.bfloat16 if config.devices == "gpu" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]


def build_engine(config: EngineConfig) -> LLMEngine:
    """Resolve and load the model named by ``config.model`` and build the engine around it."""
    from replica.model_loader import eos_token_ids, is_multimodal_config, load_model, resolve_model_dir

    if config.devices == "gpu" and not torch.cuda.is_available():
        raise ValueError("--devices gpu was asked for but no CUDA device is visible; use --devices cpu")
    torch.set_num_threads(config.num_threads)
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    loaded = load_model(model_dir, resolve_dtype(config), config.devices)
    device = "cuda" if config.devices == "gpu" else "cpu"
    return LLMEngine(
        config,
        loaded.model,
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        device=device,
        multimodal=is_multimodal_config(loaded.config),
    )
