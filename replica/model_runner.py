"""Model runner: runs a decoder-only causal LM on one packed batch per step, its attention reading and writing the
page pool (``replica.paged_attention``). Llama-family models run as compact model code (``replica.llama``) compiled
with inductor (``replica.compile``), others as transformers' modeling code (see ``ModelRunner``).

One step's batch packs every scheduled chunk into a single row ``[1, T]``::

    input_ids    | A: t40..t42 | B: t17 | C: t99 |
    position_ids |   40..42    |   17   |   99   |
    slot_mapping | pageA[0]*ps+40.. | ... |          (where each new token's K/V is written)
    logits rows  |        ^A   |   ^B   |   ^C   |   (only rows that sample a token, via logits_to_keep)

The same code runs on CUDA tensors with ``device="cuda"``: the compact model compiled with inductor as on the CPU
(``PREFIXSERVE_CUDA_COMPILE=0``: eager), its decode steps replayed as CUDA graphs captured at start-up
(``replica.cuda_graphs``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Sequence as Seq

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from replica import cpu_kernels
from replica.attention_op import forward_context
from replica.compile import CompiledEntry, cached_compiled_forward, compile_thread_count
from replica.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs
from replica.llama import CompactCausalLM, unsupported_reason
from replica.page_pool import allocate_kv_tensor, bytes_per_page, kv_tensor_shape
from replica.shared_pool import allocate_shared_pool
from replica.paged_attention import (
    DecodeBatch,
    DecodeRow,
    PagedAttentionMetadata,
    PrefillSlice,
    register_paged_attention,
    slot_runs,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkInput:
    """What the runner needs of one scheduled chunk."""

    token_ids: Seq[int]
    """The chunk's tokens."""
    start_pos: int
    """Position of the first token (= tokens already computed)."""
    page_ids: Seq[int]
    """The sequence's page table (covers start_pos + len(token_ids) tokens)."""
    sample: bool
    """Whether the chunk ends at the sequence's last token (a new token is sampled from its last row)."""


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_geometry(config) -> KVGeometry:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    return KVGeometry(text_config.num_hidden_layers, num_kv_heads, head_dim)


FINGERPRINT_RUN = 1024
"""Elements per sampled run of a large parameter (``compute_model_fingerprint``)."""
FINGERPRINT_RUNS = 1024
"""Runs sampled from a parameter of more than ``FINGERPRINT_RUN * FINGERPRINT_RUNS`` elements."""


def compute_model_fingerprint(model: torch.nn.Module, kv_dtype: torch.dtype) -> str:
    """A stable identity of the weights and KV format: the config, every parameter's name, shape, dtype and bytes,
    and the KV dtype. Equal on every replica and machine that loads the same checkpoint; different for a fine-tune or
    a merged adapter even when it leaves the embeddings and the head alone (their KV must never be shared). The first
    and the last parameter (the embeddings and the head or final norm: a fine-tune may train only a few token rows)
    and every parameter of up to ~1M elements are hashed whole; a larger one by 1024 evenly spaced runs of 1024
    elements (~1M), which any dense change of the matrix reaches. About 10 ms per large tensor on a CPU: seconds for
    a model of billions of parameters, once at start-up."""
    digest = hashlib.blake2b(digest_size=16)
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
                     "_attn_implementation_autoset", "attn_implementation"):
        config.pop(volatile, None)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    params = list(model.named_parameters())
    for index, (name, param) in enumerate(params):
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        digest.update(_fingerprint_sample(param.detach(), whole=index in (0, len(params) - 1)))
    digest.update(str(kv_dtype).encode())
    return digest.hexdigest()


def _fingerprint_sample(param: torch.Tensor, *, whole: bool = False) -> bytes:
    """The bytes ``compute_model_fingerprint`` hashes of one parameter (integer offsets: the same on every machine)."""
    flat = param.reshape(-1)
    count = flat.numel()
    if not whole and count > FINGERPRINT_RUN * FINGERPRINT_RUNS:
        last = count - FINGERPRINT_RUN
        starts = torch.tensor([index * last // (FINGERPRINT_RUNS - 1) for index in range(FINGERPRINT_RUNS)],
                              device=flat.device)
        flat = flat[(starts[:, None] + torch.arange(FINGERPRINT_RUN, device=flat.device)).reshape(-1)]
    return flat.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _linear_path(compact: CompactCausalLM | None) -> str:
    """How the runner's linear layers run, for the start-up log."""
    if compact is None or not compact.linear_kernel:
        return "ATen"
    if compact.pairs_below_rows:
        rest = "oneDNN's GEMM on weights packed at start-up" if compact.packed_from_rows else "ATen"
        dtype = str(compact.embed_weight.dtype).removeprefix("torch.")
        shared = cpu_kernels.max_shared_pair_rows()
        return (f"the {dtype} pair kernel below {compact.pairs_below_rows} rows (up to {shared} while the step helper "
                f"shares a step), then {rest}")
    if compact.packed_from_rows:
        return (f"the small-row C++ kernel below {compact.packed_from_rows} rows, then oneDNN's GEMM on weights packed "
                "at start-up")
    return "the small-row C++ kernel for a few rows, then ATen"


def _graphs_note(graphs: DecodeGraphs | None) -> str:
    if graphs is None:
        return ""
    if not graphs.captured:
        return "; decode steps on static buffers (not captured)"
    return (f"; decode steps of 1-{graphs.max_batch} rows as CUDA graphs (captured in {graphs.capture_seconds:.1f} s, "
            f"attention by {'Triton' if graphs.use_triton else 'ATen'})")


BACKENDS = ("compiled", "eager", "transformers")
ENFORCE_EAGER_ENV = "PREFIXSERVE_ENFORCE_EAGER"
"""Set to 1 to run every runner of the process without compilation (e.g. a quick test run)."""
COMPILED_DTYPES = (torch.bfloat16, torch.float32)
"""Dtypes whose forward is compiled by default (see benchmarks/forward_step.py and gpu_decode.py for the
measurements)."""
CUDA_COMPILE_ENV = "PREFIXSERVE_CUDA_COMPILE"
"""Set to 0 to run the compact model eagerly on a GPU (its decode steps still replay CUDA graphs)."""
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""The SDPA kernels an eager step may use on a GPU. cuDNN's is left out: it builds an execution plan for every new
shape, and a decode step's context grows by one every step, so each step paid for a new plan (BENCHMARKS.md section
3b). ``PREFIXSERVE_CUDNN_ATTENTION=1`` lets SDPA choose it again."""
CUDNN_ATTENTION_ENV = "PREFIXSERVE_CUDNN_ATTENTION"


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment switch: unset or empty gives ``default``, ``0`` off, anything else on."""
    value = os.environ.get(name, "")
    return default if value == "" else value != "0"


def eager_forced(enforce_eager: bool) -> bool:
    """Whether compilation is off: asked for (``--enforce-eager``) or by ``PREFIXSERVE_ENFORCE_EAGER=1``."""
    return enforce_eager or env_flag(ENFORCE_EAGER_ENV, False)


class ModelRunner:
    """Runs one packed step of a causal LM over the page pool.

    Three ways to run the forward pass (``self.backend``):

    - ``"compiled"``: the compact Llama-family model (``replica.llama``) compiled with inductor (``replica.compile``),
      attention as the opaque op ``prefixserve::paged_attention``. Compiled at construction (``startup_seconds``),
      shared in the process by every runner of a model with the same weights. Dtypes in ``COMPILED_DTYPES``, on the
      CPU and on CUDA (unless ``PREFIXSERVE_CUDA_COMPILE=0``); one graph serves every step (no recompilation after
      start-up).
    - ``"eager"``: the same compact model without compilation (``enforce_eager=True``, other dtypes).
    - ``"transformers"``: transformers' own modeling code with ``paged_attention`` registered as its attention
      function, for architectures the compact model does not cover (``fallback_reason`` says why).

    On CUDA, decode steps of up to ``MAX_GRAPH_BATCH`` (and ``max_num_seqs``) rows replay CUDA graphs of the compiled
    or eager compact model, captured at construction (``decode_graphs``), unless ``enforce_eager``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_pages: int,
        page_size: int,
        device: torch.device,
        enforce_eager: bool = False,
        backend: str | None = None,
        compile_options: dict | None = None,
        shared_pool: bool = False,
        step_threads: tuple[int, ...] = (),
        max_num_seqs: int = MAX_GRAPH_BATCH,
        max_model_len: int | None = None,
        graph_decode: bool | None = None,
    ) -> None:
        """``enforce_eager`` (or the environment variable ``PREFIXSERVE_ENFORCE_EAGER=1``) turns compilation off.
        ``backend`` forces one of ``BACKENDS`` (benchmarks, tests; it overrides ``enforce_eager``); by default the
        compact model is compiled on CPU for the dtypes in ``COMPILED_DTYPES`` and run eagerly otherwise, and models
        it does not cover run on transformers. ``compile_options`` replaces the dtype's
        ``replica.compile.INDUCTOR_OPTIONS``. ``shared_pool``: on the CPU, place the page pool in shared memory so
        that peers on this node copy pages straight out of it (falls back to private memory where impossible).
        ``step_threads``: the torch thread counts steps will run on (CPU: an engine with ``num_prefill_threads``
        switches between two); the compiled forward is warmed up on each, default the current count.
        ``max_num_seqs`` / ``max_model_len``: the engine's limits, which size the CUDA graphs' batches and page table.
        ``graph_decode``: None captures decode graphs where they apply (CUDA, the compact model, compiled or not, not
        ``enforce_eager``); False never; True also runs their static-buffer path uncaptured off CUDA (tests)."""
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        enforce_eager = eager_forced(enforce_eager)
        start = time.perf_counter()
        self.model = model
        self.device = torch.device(device)
        self.page_size = page_size
        self.sdpa_backends = (list(CUDA_SDPA_BACKENDS) if self.device.type == "cuda"
                              and not env_flag(CUDNN_ATTENTION_ENV, False) else None)
        """The SDPA kernels each step may use (``CUDA_SDPA_BACKENDS``); None: SDPA's own choice."""
        self.dtype = next(model.parameters()).dtype
        self.geometry = kv_geometry(model.config)
        layout = dict(num_layers=self.geometry.num_layers, num_pages=num_pages, page_size=page_size,
                      num_kv_heads=self.geometry.num_kv_heads, head_dim=self.geometry.head_dim)
        self.shared_pool = (allocate_shared_pool(kv_tensor_shape(**layout), self.dtype)
                            if shared_pool and self.device.type == "cpu" else None)
        """The pool's shared memory, for peers on this node (replica/shared_pool.py); None: private memory."""
        self.kv_cache = (self.shared_pool.kv if self.shared_pool is not None
                         else allocate_kv_tensor(**layout, dtype=self.dtype, device=self.device))
        self.fingerprint = compute_model_fingerprint(model, self.dtype)
        self.decode_kernel = self.device.type == "cpu" and cpu_kernels.load()  # built once per machine type
        self.fallback_reason = unsupported_reason(model) if backend != "transformers" else "asked for"
        if backend in ("compiled", "eager") and self.fallback_reason is not None:
            raise ValueError(f"backend {backend!r} cannot run this model: {self.fallback_reason}")
        if backend is None:
            if self.fallback_reason is not None:
                backend = "transformers"
            elif (not enforce_eager and self.dtype in COMPILED_DTYPES
                  and (self.device.type == "cpu" or env_flag(CUDA_COMPILE_ENV, True))):
                backend = "compiled"
            else:
                backend = "eager"
        self.backend = backend
        self._compiled: CompiledEntry | None = None
        self._compact: CompactCausalLM | None = None
        self.decode_graphs: DecodeGraphs | None = None
        """Decode steps as CUDA graphs (``replica.cuda_graphs``); None where they don't apply."""
        host_kv_bytes = self.kv_cache.nbytes if self.device.type == "cpu" else 0  # what weight copies must leave
        if backend == "transformers":
            model.set_attn_implementation(register_paged_attention())
        elif backend == "compiled":
            self._compiled = cached_compiled_forward(
                model, lambda: CompactCausalLM(model, host_kv_bytes), compile_thread_count(step_threads),
                compile_options)
            self._warm_up(step_threads)
        else:
            self._compact = CompactCausalLM(model, host_kv_bytes)
        if graph_decode is None:
            graph_decode = self.device.type == "cuda" and not enforce_eager
        if graph_decode and self.backend != "transformers":
            max_tokens = max_model_len or num_pages * page_size
            compiled = self._compiled is not None  # its graph takes two rows or more (replica.compile)
            self.decode_graphs = DecodeGraphs(
                self._compiled.forward if compiled else self._compact, forward_context, self.kv_cache,
                page_size=page_size, max_batch=max(1, min(max_num_seqs, MAX_GRAPH_BATCH)),
                max_pages_per_seq=min(num_pages, -(-max_tokens // page_size)), min_rows=2 if compiled else 1)
        self.startup_seconds = time.perf_counter() - start
        compact = self._compiled.forward.module if self._compiled is not None else self._compact
        logger.info("model runner: %s forward ready in %.1f s, decode attention by %s, linear layers by %s%s",
                    self.backend, self.startup_seconds, "the C++ kernel" if self.decode_kernel else
                    ("ATen's flash kernel" if self.device.type == "cpu" else "SDPA"),
                    _linear_path(compact), _graphs_note(self.decode_graphs))

    @property
    def pair_rows(self) -> tuple[int, int]:
        """(from, below): steps of this many tokens reach the pair kernel in their linear layers while the step
        helper shares them (``CompactCausalLM.pairs_below_rows``, and up to ``cpu_kernels.max_shared_pair_rows()``
        rows with the helper; float32 from 2 rows, but the compiled forward pads a lone token to 2); (0, 0): no pair
        kernel, or not the compact model."""
        compact = self._compiled.forward.module if self._compiled is not None else self._compact
        if compact is None or not compact.pairs_below_rows:
            return 0, 0
        lone_token_alone = self._compiled is None and self.dtype == torch.float32  # (one float32 row streams)
        return (2 if lone_token_alone else 1), max(compact.pairs_below_rows, cpu_kernels.max_shared_pair_rows() + 1)

    @property
    def num_compiles(self) -> int:
        """Graphs compiled so far by this runner's compiled forward (shared with runners of the same model)."""
        return self._compiled.forward.num_compiles if self._compiled is not None else 0

    @property
    def num_loaded(self) -> int:
        """Graphs this runner's compiled forward loaded from the start-up cache instead of compiling them
        (``replica.compile.PrecompiledForward``)."""
        return self._compiled.forward.num_loaded if self._compiled is not None else 0

    def _warm_up(self, step_threads: tuple[int, ...] = ()) -> None:
        """Compile the graph every later step uses (module docstring of replica.compile) with throwaway steps on
        pages 0 and 1 (then cleared): the first on the entry's compile thread count
        (``replica.compile.compile_thread_count``), then one per thread count in ``step_threads`` (default: the
        current one) that no runner of this model has warmed up on yet. On a CPU the one graph serves every count:
        until session 50 Dynamo's guard on torch's thread count compiled a second graph for an engine whose decode and
        prefill steps use different counts (BENCHMARKS.md 0zp)."""
        entry = self._compiled
        counts = sorted(set(step_threads) or {torch.get_num_threads()})
        with entry.lock:
            if entry.failed:
                self._fall_back_to_eager()
                return
            missing = [count for count in counts if count not in entry.warmed_up]
            if not missing:
                return
            before = torch.get_num_threads()
            try:
                other_page = 1 if self.kv_cache.shape[2] > 1 else 0
                with entry.forward.compiling():
                    first = [entry.threads] if entry.forward.num_compiles + entry.forward.num_loaded == 0 else []
                    for count in first + [count for count in missing if count not in first]:
                        torch.set_num_threads(count)
                        self.run([ChunkInput([0], 0, [0], sample=True),
                                  ChunkInput([0], 0, [other_page], sample=True)])
                        entry.warmed_up.add(count)
            except Exception:  # no C++ compiler, an unsupported op...: serve eagerly rather than not at all
                logger.exception("compiling the forward pass failed; running the compact model eagerly")
                entry.failed = True
                self._fall_back_to_eager()
            finally:
                torch.set_num_threads(before)
                self.kv_cache.zero_()

    def _fall_back_to_eager(self) -> None:
        self.backend = "eager"
        self._compact = self._compiled.forward.module
        self._compiled = None

    @staticmethod
    def pages_for_budget(config, *, page_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
        geometry = kv_geometry(config)
        per_page = bytes_per_page(
            num_layers=geometry.num_layers,
            page_size=page_size,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            dtype=dtype,
        )
        return budget_bytes // per_page

    # ---- single pages (shared tiers, peer copy) -----------------------------------------------------------------
    def read_page(self, page_id: int) -> torch.Tensor:
        """A view of one page's KV: ``[layers, 2, page_size, kv_heads, head_dim]`` (copy it before the page is reused)."""
        return self.kv_cache[:, :, page_id]

    def write_page(self, page_id: int, kv: torch.Tensor) -> None:
        """Overwrite one page's KV (from a peer or a shared tier)."""
        self.kv_cache[:, :, page_id].copy_(kv.to(device=self.device, dtype=self.dtype), non_blocking=False)

    # ---- one step ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, chunks: Seq[ChunkInput]) -> torch.Tensor:
        """Compute the chunks' KV into their pages; returns float32 logits [num sampling chunks, vocab] in order."""
        graphs = self.decode_graphs
        if graphs is not None and all(len(chunk.token_ids) == 1 and chunk.sample for chunk in chunks):
            rows = [(chunk.token_ids[0], chunk.start_pos + 1, chunk.page_ids) for chunk in chunks]
            if graphs.covers(rows):
                return graphs.run(rows)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        prefills: list[PrefillSlice] = []
        decode_rows: list[tuple[int, int, Seq[int]]] = []
        ps = self.page_size
        offset = 0
        for chunk in chunks:
            num_new = len(chunk.token_ids)
            ctx_len = chunk.start_pos + num_new
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, ctx_len))
            for first_slot, length in slot_runs(chunk.page_ids, ctx_len, ps, None, start=chunk.start_pos):
                slots.extend(range(first_slot, first_slot + length))
            if num_new == 1:
                decode_rows.append((offset, ctx_len, chunk.page_ids))
            else:
                prefills.append(self._prefill_slice(offset, num_new, ctx_len, chunk.page_ids))
            offset += num_new
            if chunk.sample:
                sample_rows.append(offset - 1)
        num_padding = 0
        if self.backend == "compiled" and offset == 1:  # one graph for every step: T >= 2 (replica.compile)
            input_ids.append(input_ids[0])
            positions.append(positions[0])
            num_padding = 1
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            prefills=prefills,
            decode=self._decode_batch(decode_rows),
            num_padding=num_padding,
        )
        logits_index = torch.tensor(sample_rows or [offset - 1], dtype=torch.long, device=self.device)
        backends = self.sdpa_backends
        with sdpa_kernel(backends) if backends is not None else contextlib.nullcontext():
            logits = self._forward(metadata, input_ids, positions, logits_index)
        if not sample_rows:
            return logits.new_empty(0, logits.shape[-1])
        return logits

    def _forward(self, metadata: PagedAttentionMetadata, input_ids: list[int], positions: list[int],
                 logits_index: torch.Tensor) -> torch.Tensor:
        if self.backend == "transformers":
            out = self.model(
                input_ids=torch.tensor([input_ids], dtype=torch.long, device=self.device),
                position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
                use_cache=False,
                logits_to_keep=logits_index,
                paged_metadata=metadata,
            )
            return out.logits[0].float()
        ids_pos = torch.tensor([input_ids, positions], dtype=torch.long, device=self.device)
        forward = self._compiled.forward if self.backend == "compiled" else self._compact
        with forward_context(metadata):
            return forward(ids_pos, logits_index)

    def _prefill_slice(self, offset: int, num_new: int, ctx_len: int, page_ids: Seq[int]) -> PrefillSlice:
        if self.device.type == "cpu":  # attended in place (paged_attention._attend_segments): by the AMX kernel over
            # the whole context's runs, or run by run over the context before the chunk
            return PrefillSlice(offset, num_new, ctx_len, None,
                                context_runs=slot_runs(page_ids, ctx_len - num_new, self.page_size, None),
                                kv_runs=slot_runs(page_ids, ctx_len, self.page_size, None))
        if ctx_len == num_new:
            return PrefillSlice(offset, num_new, ctx_len, None)
        runs = slot_runs(page_ids, ctx_len, self.page_size, None)
        if len(runs) == 1:  # consecutive pages: read the context as a view of the pool
            return PrefillSlice(offset, num_new, ctx_len, None, kv_start=runs[0][0])
        return PrefillSlice(offset, num_new, ctx_len, self._context_slots(page_ids, ctx_len))

    def _context_slots(self, page_ids: Seq[int], ctx_len: int) -> torch.Tensor:
        ps = self.page_size
        num_pages = -(-ctx_len // ps)
        pages = torch.tensor(page_ids[:num_pages], dtype=torch.long, device=self.device)
        slots = (pages[:, None] * ps + torch.arange(ps, device=self.device)[None, :]).reshape(-1)
        return slots[:ctx_len]

    def _decode_batch(self, rows: list[tuple[int, int, Seq[int]]]) -> DecodeBatch | None:
        if not rows:
            return None
        return DecodeBatch(
            rows=[DecodeRow(offset, ctx_len, list(page_ids)) for offset, ctx_len, page_ids in rows],
            page_size=self.page_size,
            q_indices=torch.tensor([offset for offset, _, _ in rows], dtype=torch.long, device=self.device),
        )
