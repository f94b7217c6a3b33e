"""``torch.compile`` (inductor) of the compact model's forward pass, and a process-wide cache of compiled forwards.

Shapes: a step's forward takes ``ids_pos [2, T]`` (token ids; positions) and ``logits_index [S]``. ONE graph covers
every step, with T and S dynamic (at least 2 each):

- a lone decode (T = 1) is padded by the runner with a copy of its token that writes no K/V and attends to nothing
  (``PagedAttentionMetadata.num_padding``): one more row through the GEMMs costs nothing measurable, since the
  weights are read once either way, and a static T = 1 graph would double the compile time;
- a single sampled row (S = 1) is repeated, for the same reason.

The graph is compiled at start-up by the runner's warm-up steps; afterwards no step recompiles (``num_compiles``;
tests/test_compiled_runner.py runs a mixed workload and checks it).

Inductor options per dtype (``INDUCTOR_OPTIONS``): no freezing by default. The weights stay graph inputs; the linear
layers of a CPU model are the small-row kernel's op, which takes a few rows itself and hands the rest to oneDNN's GEMM
on weights packed once when the model is built (``replica.cpu_kernels.packed_gemm_pays``), else to ATen
(``replica.llama.linear_kernel``). The packed weights are opaque mkldnn tensors passed in as graph inputs like the
others, so the graph stays cacheable. An unfrozen graph is cached on disk by inductor's FX graph cache, so an engine
starts in seconds once its architecture's graph is there. ``freezing`` (weights as graph constants, GEMMs on packed
oneDNN weights) is still available through ``compile_options``: Dynamo reads it while it traces, so the options are
patched around the warm-up calls (``CompiledForward.compiling``) and inside the backend, and no process-wide inductor
setting is changed. Frozen graphs hold packed mkldnn constants, which the FX graph cache cannot pickle.

Each ``CompiledForward`` compiles its own copy of the forward's code object: dynamo keys its cache (and its
recompile limit) on the code object, so runners of different models never share, evict or exceed each other's
entries. A call checks the inputs' guards and the top module's own attributes, not the module tree
(``skip_module_guards``): the model is not changed once it is built. On a CPU it does not check torch's thread count
either: one graph, compiled on ``compile_thread_count`` threads, serves the decode and the prefill steps of an engine
that runs them on different counts (until session 50, two graphs and twice the compile; BENCHMARKS.md 0zp).

A CPU forward's graph is stored in a file by the start that compiles it and loaded by later starts
(``PrecompiledForward``, torch's AOT compilation): a later start of the embedded default model skips Dynamo's tracing,
its forward ready in ~3.7 s instead of ~9 s (BENCHMARKS.md 0zq). ``PREFIXSERVE_PRECOMPILED_FORWARD=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import types
from collections import OrderedDict
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from common.file_lock import exclusive_lock
from replica import cpu_kernels
from replica.config import default_cache_dir

log = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {
    torch.bfloat16: {"freezing": False, "size_asserts": False},
    torch.float32: {"freezing": False, "size_asserts": False},
}
"""Inductor options per weight dtype (others: ``DEFAULT_OPTIONS``). Session 2 froze bfloat16 graphs: packed oneDNN
weights made decode 1.3-1.5x faster than oneDNN's per-call path. Since the small-row kernel takes decode batches and
short prompts (``replica.cpu_kernels``), freezing no longer pays: on the AMX Xeon, ``vllm bench serve``
prefix_repetition ran at 1.62 req/s unfrozen against 1.46-1.50 frozen (BENCHMARKS.md section 0, session 5), and a
frozen graph keeps a second, packed copy of every weight hot beside the one the kernel reads. float32 was never frozen:
MKL's small-M path beat oneDNN's packed weights at batch 1-2. ``size_asserts`` off: the generated code no longer
checks the size and stride of each of its ~160 inputs (the weights, fixed once built; the step's inputs are Dynamo's
to guard) on every call: 0.11 ms of a 2.2 ms bfloat16 decode step on the Zen 5 box (BENCHMARKS.md 0zd)."""
DEFAULT_OPTIONS = {"freezing": False, "size_asserts": False}
MAX_TOKENS = 1 << 20
"""Upper bound of the dynamic token dimension (dynamo needs one; ``max_tokens`` lowers it on a GPU)."""
_code_copies = iter(range(1 << 62))


def max_tokens(module: nn.Module) -> int:
    """The dynamic token dimension's upper bound for ``module``: ``MAX_TOKENS``, lowered on a GPU so that the widest
    ``[tokens, features]`` tensor of a step (the logits, ``[tokens, vocab]``) has fewer than 2**31 elements. Inductor's
    CUDA kernels index in 32 bits and guard on it; a range past it fails to compile (SmolLM2's vocabulary allows
    43,690 tokens a step). A larger step would compile again, correctly, with 64-bit indexing."""
    if not next(module.parameters()).is_cuda:
        return MAX_TOKENS
    widest = max(p.shape[0] for p in module.parameters() if p.dim() == 2)
    return min(MAX_TOKENS, (2**31 - 1) // widest)


def skip_module_guards(entries, keep_global_state: bool = True) -> list[bool]:
    """Dynamo's guards to keep: the inputs', the global state's, and the values of the top module's own attributes
    (``linear_kernel``, ``packed_from_rows``: a benchmark switches them, and a graph is compiled per setting); not the
    ~750 checks on the module tree (its tensors' shapes and dtypes, its submodules' types, hooks and constants), which
    never change once the model is built. They took ~0.2 ms of every call on a Zen 5 EPYC (8% of a bfloat16 decode
    step of the tiny Llama), the kept ones ~0.03 ms (BENCHMARKS.md 0zd). A submodule's attribute changed after the
    first call is not seen (nor, with ``freezing``, a frozen weight replaced): the model is built once and not
    changed. Names are Dynamo's for the compiled method's ``self`` argument (``L['self'].x`` shown as ``self.x``).

    ``keep_global_state=False`` (a CPU forward, ``CompiledForward``) also drops Dynamo's ``GLOBAL_STATE`` guard, whose
    one check that varies between our steps is torch's thread count: kept, a graph compiled for one count compiled
    again for the other count of an engine with ``num_prefill_threads``, doubling the start-up's compile. Grad mode
    and deterministic algorithms keep guards of their own; the rest of that guard's checks (autocast, the default
    dtype; the others are CUDA's) are checked by the forward's caller instead (``CompiledForward.__call__``)."""
    return [(not entry.orig_guard.source.is_unspecialized_nn_module()
             or TOP_ATTRIBUTE.fullmatch(entry.name) is not None)
            and (keep_global_state or entry.guard_type != "GLOBAL_STATE") for entry in entries]


TOP_ATTRIBUTE = re.compile(r"self\.[A-Za-z_]\w*")
"""A guard's name for an attribute of the compiled module itself (``self.linear_kernel``)."""


def portable_guards(entries) -> list[bool]:
    """The guards a precompiled forward (``PrecompiledForward``) keeps: ``skip_module_guards``' for a CPU forward,
    less those that cannot be stored in a file and checked in another process: guards on the identity of the code the
    forward calls (the modules, functions, builtins and classes it names: the file's key carries that code,
    ``precompiled_path``), object identities and module types, and the top module's tensors (weights fixed once built;
    its packed oneDNN weights cannot be written). The top module's plain attributes (``self.linear_kernel``), the
    inputs' and the grad mode's guards stay, and so would a guard on a global's value: none is read today, and one
    that cannot be stored makes the graph unstorable rather than unchecked."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [keep and entry.guard_type not in unsupported
            and not (entry.is_global and entry.guard_type in CODE_GUARDS)
            and not (entry.name.startswith("self") and entry.guard_type in ("TENSOR_MATCH", "TYPE_MATCH"))
            for keep, entry in zip(skip_module_guards(entries, keep_global_state=False), entries)]


CODE_GUARDS = ("BUILTIN_MATCH", "CLASS_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH", "MODULE_MATCH", "ID_MATCH",
               "DUPLICATE_INPUT", "TYPE_MATCH")
"""Guard kinds on globals that check which code a name is (``torch``, ``F.silu``, ``isinstance``, the global module
hooks' dicts), which a stored forward drops."""


def _fresh_method(module: nn.Module) -> Callable:
    """``module.forward`` bound to a private copy of its code object (a dynamo cache of its own)."""
    function = type(module).forward
    code = function.__code__.replace(co_name=f"{function.__code__.co_name}_compiled_{next(_code_copies)}")
    copy = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
    return types.MethodType(copy, module)


class CompiledForward:
    """``module(ids_pos, logits_index)`` compiled with inductor; see the module docstring for the shapes. On a CPU,
    with ``precompiled`` (a file path: ``precompiled_path``), the graph comes from that file when a start before this
    one stored it there, else it is compiled and stored there (``PrecompiledForward``)."""

    def __init__(self, module: nn.Module, options: dict, precompiled: Path | None = None) -> None:
        self.module = module
        self.options = dict(options)
        self.num_compiles = 0
        self.max_tokens = max_tokens(module)
        self.on_cpu = not next(module.parameters()).is_cuda
        """A CPU forward: one graph for every thread count (``skip_module_guards``'s ``keep_global_state``)."""
        self.default_dtype = torch.get_default_dtype()
        method = _fresh_method(module)
        guards = functools.partial(skip_module_guards, keep_global_state=not self.on_cpu)
        self._compiled = torch.compile(method, backend=self._backend, fullgraph=True, dynamic=False,
                                       options={"guard_filter_fn": guards})
        self.precompiled = (PrecompiledForward(self, method, precompiled)
                            if precompiled is not None and self.on_cpu and not self.options.get("freezing") else None)
        """Where the graph is stored for later starts (None: compiled by Dynamo at every start)."""

    @property
    def num_loaded(self) -> int:
        """Graphs loaded from a file stored by an earlier start (``PrecompiledForward``) instead of compiled."""
        return self.precompiled.num_loaded if self.precompiled is not None else 0

    def _backend(self, graph_module: torch.fx.GraphModule, example_inputs):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        self.num_compiles += 1
        _await_isa_probe()
        with inductor_config.patch(self.options):
            return compile_fx(graph_module, example_inputs)

    @contextmanager
    def compiling(self) -> Iterator[None]:
        """Patch the inductor options for the duration of warm-up calls. Dynamo itself reads ``freezing`` while it
        traces (frozen weights become graph constants guarded by identity, not graph inputs), so the option must be
        set around the call that compiles, not only inside the backend. Steady-state calls don't patch anything (a
        recompile there would still be correct, just without frozen weights)."""
        from torch._inductor import config as inductor_config

        with inductor_config.patch(self.options):
            yield

    def __call__(self, ids_pos: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        if ids_pos.shape[1] < 2:
            raise ValueError("the compiled forward takes two tokens or more (the runner pads a lone decode)")
        if self.on_cpu and (torch.get_default_dtype() is not self.default_dtype or torch.is_autocast_enabled("cpu")):
            raise RuntimeError(f"the compiled forward was built with default dtype {self.default_dtype} and no "
                               "autocast, and runs only so (its graph has no guard on them; skip_module_guards)")
        num_rows = logits_index.shape[0]
        if num_rows == 1:
            logits_index = torch.cat((logits_index, logits_index))  # (repeat(2) measured 70 us a call here)
        graph = self.precompiled.graph_for(ids_pos, logits_index) if self.precompiled is not None else None
        if graph is not None:
            logits = graph(self.module, ids_pos, logits_index)
        else:
            logits = self._compiled(*self.mark_dynamic(ids_pos, logits_index))
        return logits[:1] if num_rows == 1 else logits

    def mark_dynamic(self, ids_pos: torch.Tensor, logits_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs with their token dimensions marked dynamic for Dynamo (2 to ``max_tokens``)."""
        torch._dynamo.mark_dynamic(ids_pos, 1, min=2, max=self.max_tokens)
        torch._dynamo.mark_dynamic(logits_index, 0, min=2, max=self.max_tokens)
        return ids_pos, logits_index


_isa_probe: threading.Thread | None = None
_isa_probe_lock = threading.Lock()


def start_isa_probe() -> None:
    """Start inductor's check of which vector instruction sets its C++ may use, in a thread, so that it runs while the
    model loads. Inductor makes it the first time a process builds or loads a CPU graph: it compiles a probe per
    instruction set (cached) and loads each in a child Python (not cached), ~1.3 s on the 2-core Zen 4 of
    BENCHMARKS.md 0zr, all of it on the critical path of a replica's start. Its result is cached in the process; the
    compiled forward waits for the thread (``_await_isa_probe``) before inductor asks. Every module the probe uses is
    imported here, before the thread starts, so that the two threads never import concurrently (the C++ extension
    loader brings in setuptools, which patches the import system; ``cpu_kernels.load`` imports it anyway)."""
    global _isa_probe
    with _isa_probe_lock:
        if _isa_probe is not None:
            return
        import torch.utils.cpp_extension  # noqa: F401 - imported here, used by the thread
        from torch._inductor import codecache, cpu_vec_isa  # noqa: F401

        _isa_probe = threading.Thread(target=_probe_isa, name="prefixserve-isa-probe", daemon=True)
        _isa_probe.start()


def _probe_isa() -> None:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    try:
        pick_vec_isa()
    except Exception:  # noqa: BLE001 - inductor asks again when it compiles, and reports it then
        log.debug("inductor's vector-ISA check failed in the probe thread", exc_info=True)


def _await_isa_probe() -> None:
    probe = _isa_probe
    if probe is not None:
        probe.join()


PRECOMPILED_ENV = "PREFIXSERVE_PRECOMPILED_FORWARD"
"""Set to 0 to compile a CPU forward at every start (Dynamo's tracing included) instead of loading the graph an earlier
start stored (``PrecompiledForward``)."""
PRECOMPILED_KEEP = 32
"""The start-up cache keeps the files of this many forwards, the most recently used."""
UNSTORABLE_SUFFIX = ".unstorable"
"""Beside a forward's file name: a note that its graph could not be stored (``PrecompiledForward._worth_trying``)."""


class PrecompiledForward:
    """A CPU forward's graph stored in a file by the start that compiled it and loaded by later starts, which then
    skip Dynamo's tracing of the model (~4 s of a ~7 s warm compile on SmolLM2's 30 layers) and inductor's cache
    lookups: torch's AOT compilation (``torch.compile(...).aot_compile``, ``torch.compiler.load_compiled_function``).
    The file's name is a digest of everything the graph depends on (``precompiled_path``); the graph takes the weights
    as inputs (no freezing), so it serves any weights of the same architecture.

    The first call (the runner's first warm-up step) loads the file, or compiles the graph (counted in
    ``num_compiles``) and writes it. Each call checks the stored guards (the inputs' dtypes and ranks, the token
    count's range, grad mode, the top module's attributes: ~5 us); a call they refuse (a benchmark that switched
    ``linear_kernel``) takes Dynamo's path, which compiles a graph for it as before. A file that cannot be loaded (torn,
    another torch) is compiled again and replaced; where the graph cannot be stored, the process keeps it, and
    later starts take Dynamo's path without trying (``_worth_trying``).

    The cost: an AOT compile does not use inductor's FX graph cache (torch bundles the compiled code into the file
    instead), so the first start of a new version, whose graph inductor may have cached before, compiles in ~25 s
    instead of ~9 s (SmolLM2 in process; with every cache empty both take ~37-40 s). Every start after it saves ~5 s
    (BENCHMARKS.md 0zq)."""

    def __init__(self, forward: CompiledForward, method: Callable, path: Path) -> None:
        self.forward = forward
        self.path = path
        self.num_loaded = 0
        self._graph = None
        self._tried = False
        self._aot = torch.compile(method, backend=forward._backend, fullgraph=True, dynamic=False,
                                  options={"guard_filter_fn": portable_guards})

    def graph_for(self, ids_pos: torch.Tensor, logits_index: torch.Tensor):
        """The stored graph if this call passes its guards, else None (Dynamo's path)."""
        if not self._tried:
            self._tried = True
            _await_isa_probe()
            if self._worth_trying():
                with self._exclusive():  # replicas starting together: one compiles, the others load what it stored
                    self._graph = self._load(ids_pos, logits_index) or self._compile(ids_pos, logits_index)
        graph = self._graph
        return graph if graph is not None and graph.guard_check(self.forward.module, ids_pos, logits_index) else None

    def _worth_trying(self) -> bool:
        """Whether to load or compile ahead of time at all. Not where nothing is stored and nothing could be: a start
        before this one found the graph unstorable (its ``.unstorable`` note), or the folder cannot be written. An
        ahead-of-time compile skips inductor's FX graph cache, which Dynamo's path uses, so compiling it at every
        start would cost more than Dynamo's path (``PrecompiledForward``'s docstring)."""
        if self.path.exists():
            return True
        note = self.path.with_suffix(UNSTORABLE_SUFFIX)
        if note.exists():
            log.info("compiling the forward with Dynamo: an earlier start could not store its graph (%s)",
                     note.read_text(errors="replace").strip()[:200])
            return False
        if not writable(self.path.parent):
            log.info("compiling the forward with Dynamo: %s cannot be written, so its graph could not be stored",
                     self.path.parent)
            return False
        return True

    def _exclusive(self) -> AbstractContextManager:
        """A lock on this forward's file (``common.file_lock``); none where its folder cannot be written (nothing
        could be stored there either)."""
        lock = self.path.with_suffix(".lock")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            lock.touch()
        except OSError:
            return nullcontext()
        return exclusive_lock(lock)

    def _load(self, ids_pos: torch.Tensor, logits_index: torch.Tensor):
        if not self.path.exists():
            return None
        if not private(self.path):
            log.warning("not loading the stored forward %s: it or its folder is not this user's alone", self.path)
            return None
        try:
            with self.path.open("rb") as file:
                graph = torch.compiler.load_compiled_function(file, external_data={"model": self.forward.module})
            graph.disable_guard_check()  # checked by graph_for
            if not graph.guard_check(self.forward.module, ids_pos, logits_index):
                reason = graph._artifacts.guard_manager.check_verbose(graph.prepare_f_locals(
                    self.forward.module, ids_pos, logits_index)).verbose_code_parts
                raise RuntimeError(f"its guards refuse the first call: {reason}")
        except Exception as error:  # torn, another torch, a model changed in a way its name missed
            log.warning("the stored forward %s could not be used (%s); compiling it again", self.path,
                        str(error).splitlines()[0] if str(error) else type(error).__name__)
            return None
        os.utime(self.path)  # recently used (``prune_precompiled``)
        self.num_loaded += 1
        log.info("compiled forward loaded from %s", self.path)
        return graph

    def _compile(self, ids_pos: torch.Tensor, logits_index: torch.Tensor):
        try:
            # marked copies: the stored guards refuse a call whose inputs carry Dynamo's marks
            example = self.forward.mark_dynamic(ids_pos.clone(), logits_index.clone())
            graph = self._aot.aot_compile((example, {}))
        except Exception:
            log.warning("the forward could not be compiled ahead of time; compiling it as usual", exc_info=True)
            return None
        graph.disable_guard_check()
        try:
            data = type(graph).serialize(graph, {"model": self.forward.module}).serialized_data
            write_private(self.path, data)
            prune_precompiled(self.path.parent)
        except Exception as error:  # a module Dynamo cannot write, a read-only cache: this process keeps the graph
            log.warning("the compiled forward could not be stored in %s: %s", self.path, error)
            if not isinstance(error, OSError):  # the graph itself: later starts take Dynamo's path straight away
                try:
                    write_private(self.path.with_suffix(UNSTORABLE_SUFFIX),
                                  f"{type(error).__name__}: {error}".encode(errors="replace"))
                except OSError:
                    pass
        return graph


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a reader sees the old file or the whole new one), readable by this user
    only, in a folder of this user's only: the file is unpickled by a later start, so nobody else may write it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def writable(folder: Path) -> bool:
    """Whether this process could create ``folder`` (where absent) and files in it."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return os.access(folder, os.W_OK | os.X_OK)


def private(path: Path) -> bool:
    """Whether ``path`` and its folder belong to this user and nobody else can write them (a stored forward is
    unpickled: code in it runs)."""
    return all(st.st_uid == os.getuid() and not st.st_mode & 0o022 for st in (path.stat(), path.parent.stat()))


def prune_precompiled(folder: Path, keep: int = PRECOMPILED_KEEP) -> None:
    """Remove all but the ``keep`` most recently used stored forwards of ``folder``."""
    def last_used(file: Path) -> float:
        try:
            return file.stat().st_mtime
        except OSError:  # removed meanwhile by another process's prune
            return 0.0

    files = sorted((*folder.glob("forward-*.bin"), *folder.glob(f"forward-*{UNSTORABLE_SUFFIX}")), key=last_used,
                   reverse=True)
    for stale in files[keep:]:
        stale.unlink(missing_ok=True)
        stale.with_suffix(".lock").unlink(missing_ok=True)


@functools.cache
def _code_digest() -> bytes:
    """What a stored graph's code depends on beyond the model: this package's sources (the traced forward, the ops it
    calls), the versions of Python, torch and transformers, and the CPU (inductor's C++ is built for its flags)."""
    import transformers

    digest = hashlib.sha256()
    here = Path(__file__).parent
    for source in sorted((*here.glob("*.py"), *here.glob("csrc/*"))):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    for part in (sys.version, torch.__version__, transformers.__version__, cpu_kernels._cpu_flags()):
        digest.update(part.encode() + b"\0")
    return digest.digest()


def precompiled_path(signature: tuple) -> Path | None:
    """The file a forward with ``signature`` (``_signature``) is stored in, under the cache folder
    (``replica.config.default_cache_dir``); None where ``PREFIXSERVE_PRECOMPILED_FORWARD=0``."""
    if os.environ.get(PRECOMPILED_ENV, "") == "0":
        return None
    digest = hashlib.sha256(_code_digest() + repr(signature).encode()).hexdigest()[:32]
    return default_cache_dir() / "compiled" / f"forward-{digest}.bin"


@dataclass
class CompiledEntry:
    forward: CompiledForward
    signature: tuple
    weights: list[torch.Tensor]
    """The source model's parameters the graphs were frozen with (compared with a new model's by value)."""
    threads: int
    """The torch thread count the graph is compiled on (``compile_thread_count``)."""
    warmed_up: set[int] = field(default_factory=set)
    """The torch thread counts a warm-up step has run on (the first compiled the graph; the others check that a step
    on their count does not compile again)."""
    failed: bool = False
    """Compilation raised: runners of this model run it eagerly."""
    lock: threading.Lock = field(default_factory=threading.Lock)


CACHE_MAX_ENTRIES = 8
CACHE_MAX_BYTES = 2 << 30
"""The cache keeps at most this many entries and, beyond the newest, this many bytes of source weights alive."""
_cache: "OrderedDict[int, CompiledEntry]" = OrderedDict()
_cache_lock = threading.Lock()
_entry_ids = iter(range(1 << 62))


def _signature(model: nn.Module, options: dict, threads: int) -> tuple:
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_attn_implementation", "_attn_implementation_autoset"):
        config.pop(volatile, None)
    params = tuple((name, tuple(p.shape), p.dtype, str(p.device)) for name, p in model.named_parameters())
    return (
        type(model).__name__, json.dumps(config, sort_keys=True, default=str), params, threads,
        tuple(sorted(options.items())), cpu_kernels.packed_gemm_pays(), cpu_kernels.packed_gemm_from_few_rows(),
        cpu_kernels.pair_linear_pays(torch.float32), cpu_kernels.pair_linear_pays(torch.bfloat16),
    )


def _same_weights(weights: list[torch.Tensor], model: nn.Module) -> bool:
    return all(
        (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()) or torch.equal(a, b)
        for a, b in zip(weights, model.parameters())
    )


def compile_thread_count(step_threads: tuple[int, ...]) -> int:
    """The torch thread count to compile a CPU forward on whose steps run on the counts in ``step_threads`` (default:
    the current count). Inductor generates its C++ kernels for the count at compile time: compiled on one thread they
    have no parallel loops at all, and compiled on fewer threads than this machine's CPUs each parallel loop is fixed
    at that count (``num_threads(N)``). So one count is compiled for as it is, and for several (an engine with
    ``num_prefill_threads``) the graph is compiled on every CPU: its loops then follow the stepping thread's count
    (``#pragma omp parallel`` alone), and their per-thread buffers are sized for the most threads any step can use.
    That graph serves every count (no guard on the thread count: ``skip_module_guards``)."""
    counts = set(step_threads) or {torch.get_num_threads()}
    return max(counts) if len(counts) == 1 else max(*counts, os.cpu_count() or 1)


def cached_compiled_forward(
    source: nn.Module, build: Callable[[], nn.Module], threads: int, options: dict | None = None
) -> CompiledEntry:
    """The compiled forward for ``source`` (built by ``build()`` on first use), to be compiled on ``threads`` torch
    threads (``compile_thread_count``). Shared by every runner whose model has the same architecture, config, compile
    thread count (inductor bakes it into its kernels), options and weight values — the same model object, a deep copy,
    or the same checkpoint loaded again — so a process that builds many engines (the test suite) compiles once per
    distinct model. Recently used entries are kept within ``CACHE_MAX_ENTRIES`` /
    ``CACHE_MAX_BYTES`` (each holds its model's weights alive). Weights must not be modified in place after a runner
    is built."""
    if options is None:
        options = INDUCTOR_OPTIONS.get(next(source.parameters()).dtype, DEFAULT_OPTIONS)
    options = dict(options)
    signature = _signature(source, options, threads)
    with _cache_lock:
        for key, entry in reversed(_cache.items()):
            if entry.signature == signature and _same_weights(entry.weights, source):
                _cache.move_to_end(key)
                return entry
        entry = CompiledEntry(CompiledForward(build(), options, precompiled_path(signature)), signature,
                              [p.detach() for p in source.parameters()], threads)
        _cache[next(_entry_ids)] = entry
        while len(_cache) > 1 and (
            len(_cache) > CACHE_MAX_ENTRIES
            or sum(p.numel() * p.element_size() for e in _cache.values() for p in e.weights) > CACHE_MAX_BYTES
        ):
            _cache.popitem(last=False)
    return entry


def clear_cache() -> None:
    """Forget every cached compiled forward (runners holding one keep it)."""
    with _cache_lock:
        _cache.clear()
