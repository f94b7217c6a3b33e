"""CPU kernels written here in C++ (``replica/csrc``), built on first use with the compiler inductor already needs.

``prefill_attention`` is the prefill half: one call per prompt chunk and layer attends the chunk's tokens to their
whole context, cached runs and own tokens, with one running softmax, on AMX tiles where the CPU has them
(bfloat16, ``csrc/amx_attention.cpp``) and on AVX2 + FMA vectors in float32, 512-bit ones with AVX-512
(``csrc/prefill_attention.cpp``; 1.5x the AVX2 build's speed on the Zen 5 EPYC, BENCHMARKS.md 0zd); the sources say
how.

``decode_attention`` is the decode half of the CPU paged attention (``replica.paged_attention._attend_segments``):
one call per layer attends every decode row of the step to its context where it lies in the pool, in one pass per
(kv head, group of rows sharing a prefix), with the running softmax kept in float32 inside the kernel. It replaces
one ATen flash-attention call per run per row plus a log-sum-exp merge in Python; ATen's CPU flash kernel is built
for long query blocks, and with the 1-16 query vectors of a decode row per kv head its bfloat16 path ran at about
half its float32 speed here (benchmarks/decode_attention.py).

``linear`` is the compact model's linear layer (``replica.llama``) for a few rows: a decode batch or a short prompt.
Each block of weight rows is read from memory once and dotted against every input row, with float32 sums rounded
once to the output dtype. float32: up to 16 rows, where ATen's MKL GEMM packs the weight matrix on every call; it
measured 0.4-0.7x ATen's time for 3-16 rows of the 512 x 8 tiny Llama and 0.7-0.9x for 1-2. bfloat16: up to 8 rows,
0.5-0.8x oneDNN's AMX GEMM at 1-4 rows; the unpacked ``F.linear`` the unfrozen graph would call instead wins from ~12
rows (``benchmarks/linear_rows.py``). Larger inputs and other dtypes go to oneDNN's GEMM on a copy of the weight
packed once into its blocked layout (``pack_linear_weight``, ``packed_gemm_pays``) where oneDNN can pack the dtype,
else to ``at::linear`` inside the op. On CPUs with AVX-512 every input of 4 rows or more takes the packed GEMM: on
the Zen 4 box it measured 1.3-2x faster than the tiled kernel and MKL from 4 rows up in both dtypes, and 1-3 rows keep
the kernel, whose AVX-512 path for them reads the weight rows in order (0.5-0.9x oneDNN's time there). On AVX2-only
CPUs the kernel keeps its 1-16 float32 rows (0.73-0.86x oneDNN's time on the Zen 1 EPYC) and the packed GEMM takes 17
rows and more (0.39-0.72x MKL's ``F.linear`` at 17-128 rows there, BENCHMARKS.md section 0z).

The library is compiled once per machine type (the build directory's name carries a digest of the source, the
compiler flags and the CPU's flags, since ``-march=native`` code must not run on another CPU), from copies of the
sources kept in that directory (``stable_sources``) under a lock of its own (``build_lock``), and loaded with
``torch.ops.load_library``. When no compiler is available, or ``PREFIXSERVE_CPU_KERNELS=0``, ``available()`` is
False and the attention keeps its ATen path; the reason is logged once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sysconfig
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from common.file_lock import exclusive_lock
log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("decode_attention.cpp", "small_linear.cpp", "prefill_attention.cpp"))
HEADERS = (Path(__file__).parent / "csrc" / "reduce16.h", Path(__file__).parent / "csrc" / "step_helper.h")
"""Included by ``SOURCES``: part of the build's digest, so that a changed header rebuilds the library."""
AMX_SOURCES = (Path(__file__).parent / "csrc" / "amx_attention.cpp",)
"""Built as a library of its own after ``SOURCES``: a compiler that cannot build its AMX intrinsics costs only the
AMX prefill path, not the decode and linear kernels."""
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
"""``-ffast-math`` lets the exp loops use glibc's vector exp; the kernel keeps every value finite (no infinities)."""
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cpu_flag_set() -> set[str]:
    """This CPU's flags (``_cpu_flags``' line as a set of names; the line's "flags" and ":" are never looked up)."""
    return set(_cpu_flags().split())


def _build_name(sources: tuple[Path, ...], prefix: str) -> str:
    """The library's name (and so its build directory's): a digest of what its build commands depend on. That
    includes where torch and Python's headers are: each command names them, so two environments with the same torch
    (a venv of a fresh clone beside another) sharing one directory rebuilt the library at every switch between them
    (ninja rebuilds when a command changes); each now builds its own, once."""
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in (*sources, *HEADERS)), " ".join(CFLAGS).encode(),
                 _cpu_flags().encode(),
                 torch.__version__.encode(), str(Path(torch.__file__).resolve().parent).encode(),
                 sysconfig.get_paths()["include"].encode()):
        digest.update(part + b"\0")
    return f"{prefix}_{digest.hexdigest()[:16]}"


BUILD_LOCK = "prefixserve.lock"
"""The file in a library's build directory that ``build_lock`` locks."""


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on a library's build directory for its build. torch's JIT build marks a build in
    progress with a file (``lock``) that every other process waits on until it is gone; a process killed midway (a
    replica stopped during its first start) leaves it behind, and every later start waited on it forever. Our builds
    first take a ``flock`` on a file of their own, which the kernel releases when its holder dies: whoever holds it,
    no build of ours is in progress, so a ``lock`` file found then is stale and is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(build_dir / BUILD_LOCK):
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build of the CPU kernels that was stopped midway", stale)
            stale.unlink(missing_ok=True)
        yield


def stable_sources(sources: tuple[Path, ...], into: Path) -> list[Path]:
    """Copies of ``sources`` and ``HEADERS`` in ``into`` (in the library's build directory): the paths the build
    compiles. ninja rebuilds a library whose compile commands changed, and a command names its source's path, so the
    same library built from two checkouts (a fresh clone, a worktree) was rebuilt on every switch between them (~30 s
    on 2 cores). The build directory's name carries the sources' digest, so the copies there never change once written
    (and are not rewritten: a newer file would rebuild too)."""
    into.mkdir(parents=True, exist_ok=True)
    for path in (*sources, *HEADERS):
        target = into / path.name
        text = path.read_bytes()
        if not target.exists() or target.read_bytes() != text:
            partial = target.with_name(target.name + ".partial")
            partial.write_bytes(text)
            partial.replace(target)
    return [into / source.name for source in sources]


def _build(sources: tuple[Path, ...], prefix: str) -> str | None:
    """Build (first time on this machine type) and load one library of kernels; the reason when it failed."""
    try:
        from torch.utils import cpp_extension

        name = _build_name(sources, prefix)
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with build_lock(build_dir):
            copies = stable_sources(sources, build_dir / "src")
            cpp_extension.load(name=name, sources=[str(copy) for copy in copies], extra_cflags=CFLAGS,
                               extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        return None
    except Exception as error:  # no compiler, no ninja, a build error: keep the ATen path
        lines = str(error).splitlines()
        brief = " | ".join(lines[:1] + [line for line in lines if "error" in line][:3])
        return f"{type(error).__name__}: {brief}"


def load() -> bool:
    """Build (first time on this machine type) and load the kernels; True when ``torch.ops.prefixserve_cpu`` works."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("PREFIXSERVE_CPU_KERNELS", "1") == "0":
            _state["ok"], _state["reason"] = False, "PREFIXSERVE_CPU_KERNELS=0"
            return False
        reason = _build(SOURCES, "prefixserve_cpu")
        if reason is None:
            torch.library.register_fake("prefixserve_cpu::linear")(_linear_shape)
            _state["ok"] = True
        else:
            _state["ok"], _state["reason"] = False, reason
            log.warning("CPU kernels not built, decode attention uses ATen's flash kernel: %s", reason)
        return bool(_state["ok"])


def available() -> bool:
    return bool(_state.get("ok")) if "ok" in _state else load()


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segments: torch.Tensor,
                     seg_rows: torch.Tensor, components: torch.Tensor, out: torch.Tensor, scale: float,
                     vector_code: bool = True) -> None:
    """Write into ``out[p]`` the attention of every decode row p named in ``components`` (see the C++ source).
    ``vector_code=False`` runs the plain loops written for any head size (tests compare the two)."""
    torch.ops.prefixserve_cpu.decode_attention(query, k_cache, v_cache, segments, seg_rows, components, out, scale,
                                               vector_code)


def attend_layer(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                 slot_mapping: torch.Tensor, num_real: int, plan, scale: float) -> torch.Tensor:
    """One layer of a step whose every part runs on these kernels, in one call: store the first ``num_real`` rows of
    ``key`` / ``value`` [T, KVH, D] into layer ``layer`` of the contiguous pool ``kv_cache`` [L, 2, ..., KVH, D] at
    ``slot_mapping``, then attend ``plan``'s prompt chunks (``prefill_attention``'s float32 / pair-dot kernel) and
    decode rows (``decode_attention``) into a new [T, H, D] tensor (other rows zero). ``plan``: a
    ``paged_attention.KernelStepPlan``."""
    decode = plan.decode
    none = plan.run_offsets[:0]
    return torch.ops.prefixserve_cpu.attend_layer(
        query, key, value, kv_cache, layer, slot_mapping, num_real, plan.prefill_rows, plan.prefill_runs,
        plan.run_offsets, decode.segments if decode else none, decode.rows if decode else none,
        decode.components if decode else none, scale)


AMX_HEAD_SIZES = (32, 64, 128)
"""Head sizes the AMX prefill kernel takes."""
AMX_CPU_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})
"""What ``-march=native`` needs to build the AMX kernel: without them the library would build without it."""


def has_amx() -> bool:
    """Whether ``prefill_attention`` can run: the kernels are built with AMX tiles (``-march=native`` on a CPU with
    amx_tile, amx_bf16 and avx512_bf16) and Linux granted this process the tile state. On a CPU without those flags
    nothing is built: the library would hold no kernel, and its build cost a first bfloat16 prefill ~20 s."""
    if "amx" not in _state and available():
        with _lock:
            if "amx" not in _state:
                _state["amx"] = AMX_CPU_FLAGS <= _cpu_flag_set() and _load_amx()
    return bool(_state.get("amx"))


def _load_amx() -> bool:
    """Build and load the AMX library (call with ``_lock`` held); whether its kernel can run in this process."""
    reason = _build(AMX_SOURCES, "prefixserve_amx")
    if reason is not None:
        log.warning("AMX prefill kernel not built, prefill attention uses ATen's flash kernel: %s", reason)
        return False
    return bool(torch.ops.prefixserve_cpu.has_amx())


def has_bf16_dot() -> bool:
    """Whether bfloat16 prefill chunks off AMX run on AVX512-BF16 pair dot products (``-march=native`` on such a CPU)."""
    return available() and bool(torch.ops.prefixserve_cpu.has_bf16_dot())


def has_vector_prefill() -> bool:
    """Whether ``prefill_attention`` takes float32: the kernels are built with AVX2 and FMA (``-march=native``)."""
    return available() and bool(torch.ops.prefixserve_cpu.has_vector_prefill())


def prefill_on_amx(query: torch.Tensor) -> bool:
    """Whether ``prefill_attention`` runs this query's chunks on AMX tiles: bfloat16, a head size the AMX kernel
    takes, and ``has_amx`` (asked last: it may build the AMX library)."""
    return query.dtype == torch.bfloat16 and query.shape[-1] in AMX_HEAD_SIZES and has_amx()


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: torch.Tensor,
                      scale: float, out: torch.Tensor) -> None:
    """Write into ``out`` [tokens, heads, head_dim] the attention of a prompt chunk's ``query`` (same shape) to its
    context: the keys are the pool slots of ``runs`` [R, 2] int64 (first slot, length) in order, the last ``tokens``
    of them the chunk's own tokens (causal). Contiguous; ``k_cache`` / ``v_cache`` are a layer's pool
    [slots, kv_heads, head_dim]. bfloat16 of head size 32, 64 or 128 runs on AMX tiles where the CPU has them
    (``has_amx``); float32 on AVX2 or AVX-512 vectors (``has_vector_prefill``); bfloat16 elsewhere by AVX512-BF16
    pair dot products where the CPU has them (``has_bf16_dot``), else widened to float32 as it is read."""
    if prefill_on_amx(query):
        torch.ops.prefixserve_cpu.prefill_attention(query, k_cache, v_cache, runs, scale, out)
    else:
        torch.ops.prefixserve_cpu.prefill_attention_f32(query, k_cache, v_cache, runs, scale, out)


def _linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool = True,
                  packed: torch.Tensor | None = None, packed_from_rows: int = 0, pairs: torch.Tensor | None = None,
                  pairs_below_rows: int = 0) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, use_kernel: bool = True,
           packed: torch.Tensor | None = None, packed_from_rows: int = 0, pairs: torch.Tensor | None = None,
           pairs_below_rows: int = 0) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x``. With ``pairs`` (``pack_pairs(weight)``), inputs of fewer than
    ``pairs_below_rows`` rows (17 in the model; float32: from 2 rows) run the pair-layout kernel, and so do inputs of
    up to ``max_shared_pair_rows()`` rows while the step helper shares the step (armed, one torch thread; a larger
    ``pairs_below_rows`` takes them without it: a hook for tests and benchmarks). Else, with
    ``packed`` (``pack_linear_weight(weight)``), inputs of at least ``packed_from_rows`` rows run oneDNN's GEMM on it.
    Otherwise float32 inputs of at most 16 rows (bfloat16: 8) are computed by the small-row kernel in
    ``csrc/small_linear.cpp`` (``use_kernel=False``: ``at::linear``, for tests), and everything else by ATen."""
    return torch.ops.prefixserve_cpu.linear(x, weight, bias, use_kernel, packed, packed_from_rows, pairs,
                                            pairs_below_rows)


def has_pair_linear(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``pack_pairs`` and the pair-layout kernel exist for ``dtype``: the kernels are built with AVX-512
    (float32) or AVX512-BF16 (bfloat16)."""
    return (dtype in (torch.float32, torch.bfloat16) and available()
            and bool(torch.ops.prefixserve_cpu.has_pair_linear(dtype == torch.float32)))


def arm_step_helper(on: bool) -> None:
    """Arm (``on``) or disarm the step helper (``csrc/step_helper.h``): a second thread that takes chunks of output
    columns of every pair-kernel call, and items (row group, kv head) of every decode attention call, made on one
    torch thread while it is armed, and sleeps otherwise. The engine arms it for the short steps of a replica that
    owns a second core (``replica.config.STEP_HELPER_MIN_TOKENS``)."""
    torch.ops.prefixserve_cpu.arm_step_helper(on)


def step_helper_chunks() -> int:
    """Chunks the step helper has computed in this process (tests)."""
    return int(torch.ops.prefixserve_cpu.step_helper_chunks())


def step_helper_armed() -> bool:
    """Whether the step helper is armed now (tests; arming does nothing where the process has one CPU)."""
    return bool(torch.ops.prefixserve_cpu.step_helper_armed())


def max_shared_pair_rows() -> int:
    """Rows up to which the pair kernel also takes inputs above ``pairs_below_rows`` while the step helper shares the
    step (``csrc/small_linear.cpp``'s ``kMaxSharedPairRows``: 17-64-row steps on two cores, where one thread's oneDNN
    GEMM took about twice the time); 0 where the pair kernel is not built."""
    op = getattr(torch.ops.prefixserve_cpu, "max_shared_pair_rows", None) if load() else None
    return int(op()) if op is not None else 0


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered once into the pair layout of ``csrc/small_linear.cpp``: blocks of 32 output
    columns, each holding E consecutive inputs side by side, [ceil(out / 32), in / E, 32, E] (bfloat16: E = 2, a
    pair; float32: E = 1)."""
    return torch.ops.prefixserve_cpu.pack_pairs(weight.detach())


PACK_ROWS_HINT = 64
"""The row count oneDNN packs a weight for. Measured on the Zen 4 box (``benchmarks/linear_rows.py``), a weight packed
for 4 to 256 rows ran every row count from 1 to 1024 equally fast; one packed for 1 row was up to 2x slower from 2
rows up."""


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered once into oneDNN's blocked layout (an opaque mkldnn tensor) for ``linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def pair_linear_pays(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether linear layers of ``dtype`` should also keep their weights in pair layout (``pack_pairs``) for inputs
    of a few rows: wherever the kernels are built for it (``has_pair_linear``). bfloat16 (AVX512-BF16): the pair
    kernel measured 0.65-0.85x the best other path's time at 1-16 rows (``benchmarks/linear_rows.py``, BENCHMARKS.md
    section 0n); float32 (AVX-512): 0.78-0.95x at 2-16 rows on the Zen 5 box (section 0ze). It costs a copy of the
    weights. ``PREFIXSERVE_PAIR_LINEAR=0`` turns it off."""
    return os.environ.get("PREFIXSERVE_PAIR_LINEAR", "") != "0" and has_pair_linear(dtype)


def packed_gemm_pays(dtype: torch.dtype = torch.float32) -> bool:
    """Whether linear layers of ``dtype`` should hold their weights packed for oneDNN's GEMM (taking the inputs of as
    many rows as ``packed_gemm_from_few_rows`` says): float32 on CPUs with AVX2, bfloat16 on CPUs with AVX-512 (other
    CPUs were not measured and keep the kernel and ATen). On AVX-512 it measured 1.3-2x faster than the small-row
    kernel and MKL from 4 rows up, in both dtypes (BENCHMARKS.md section 0j); on the AVX2-only Zen 1 EPYC 0.39-0.72x
    MKL's time at 17-128 float32 rows, where the kernel stops (section 0z). It costs a second copy of the linear
    weights, made only where it fits (``weight_copies_fit``). ``PREFIXSERVE_PACKED_LINEAR=0`` turns it off; ``1``
    packs bfloat16 without AVX-512 too and takes 4 rows and more everywhere (``packed_gemm_from_few_rows``). bfloat16
    weights are never packed where oneDNN cannot reorder them (``can_pack``)."""
    if not torch.backends.mkldnn.is_available() or not can_pack(dtype):
        return False
    forced = os.environ.get("PREFIXSERVE_PACKED_LINEAR", "")
    if forced in ("0", "1"):
        return forced == "1"
    flags = _cpu_flag_set()
    return "avx512f" in flags or (dtype == torch.float32 and "avx2" in flags)


WEIGHT_COPY_SHARE = 0.5
"""The model's extra copies of its linear weights (the packed oneDNN layout, the pair layout; the decoder layers'
matrices and the LM head) are made only if together they take at most this share of the memory the process can still
take when the model is built (``available_memory_bytes``), less what the build takes anyway (the KV pool, whose pages
are touched later, and the fused QKV and gate/up matrices). A copy that does not fit would get the replica killed at
start-up or under load; without the copies the model runs on the small-row kernel and ATen (slower prompts, the same
tokens). Replicas starting together on one node each see the same free memory: give each less with
``PREFIXSERVE_WEIGHT_COPY_SHARE`` (a fraction; 0 never copies, a large value always does)."""
WEIGHT_COPY_SHARE_ENV = "PREFIXSERVE_WEIGHT_COPY_SHARE"


def available_memory_bytes(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Memory this process can still take, in bytes: the kernel's ``MemAvailable``, lowered to the least headroom of
    its cgroups (v2 and v1, the process' level and its ancestors: a container's memory limit) where one is lower.
    None if unknown."""
    available = None
    try:
        for line in Path(proc, "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    headroom = _cgroup_headroom(proc, cgroup_root)
    if headroom is not None:
        available = headroom if available is None else min(available, headroom)
    return available


def _cgroup_headroom(proc: str, cgroup_root: str) -> int | None:
    """The least (limit - working set) over the process' cgroup and its ancestors, in the unified hierarchy (v2) and
    the memory controller's own (v1); None where no level sets a limit or nothing is readable."""
    try:
        lines = Path(proc, "self", "cgroup").read_text().splitlines()
    except (OSError, ValueError):  # ValueError: a cgroup name that is not UTF-8
        return None
    headrooms = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base, names = Path(cgroup_root), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, names = (Path(cgroup_root, "memory"),
                           ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        else:
            continue
        parts = [part for part in path.strip().split("/") if part and part != ".."]
        for depth in range(len(parts), -1, -1):  # a container may see only its own level (the mount's root)
            headroom = _limit_headroom(base.joinpath(*parts[:depth]), *names)
            if headroom is not None:
                headrooms.append(headroom)
    return min(headrooms, default=None)


def _limit_headroom(folder: Path, limit_name: str, usage_name: str, inactive_file: str) -> int | None:
    """One level's limit less its working set: usage less the inactive file cache (``memory.stat``), which the kernel
    reclaims before it kills (the model files just read sit there); None without a limit."""
    try:
        limit_text = (folder / limit_name).read_text().strip()
        usage = int((folder / usage_name).read_text().strip())
    except (OSError, ValueError):
        return None
    if not limit_text.isdigit() or int(limit_text) >= 1 << 60:  # v2 writes "max", v1 a huge number: no limit
        return None
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == inactive_file:
                usage -= min(usage, int(value))
                break
    except (OSError, ValueError):
        pass
    return max(0, int(limit_text) - usage)


def weight_copies_fit(num_bytes: int, what: str, reserved_bytes: int = 0) -> bool:
    """Whether ``num_bytes`` of extra weight copies fit: at most ``WEIGHT_COPY_SHARE`` (or the environment's
    ``PREFIXSERVE_WEIGHT_COPY_SHARE``) of ``available_memory_bytes`` less ``reserved_bytes``. Logs a warning naming
    ``what`` when they do not."""
    available = available_memory_bytes()
    try:
        share = float(os.environ.get(WEIGHT_COPY_SHARE_ENV, "") or WEIGHT_COPY_SHARE)
    except ValueError:
        share = WEIGHT_COPY_SHARE
    if available is None or num_bytes <= share * max(0, available - reserved_bytes):
        return True
    log.warning("not keeping %s: they need %.2f GiB, and %.2f GiB of memory is available besides the %.2f GiB the "
                "model and KV pool take anyway (at most %g of it goes to them; %s sets that); prompts run slower, "
                "tokens are the same", what, num_bytes / 2**30, max(0, available - reserved_bytes) / 2**30,
                reserved_bytes / 2**30, share, WEIGHT_COPY_SHARE_ENV)
    return False


def packed_gemm_from_few_rows() -> bool:
    """Whether the packed GEMM also takes inputs the small-row kernel could (from 4 rows, ``replica.llama``'s
    ``PACKED_FROM_ROWS``): on CPUs with AVX-512, or with ``PREFIXSERVE_PACKED_LINEAR=1``. Otherwise it takes only
    inputs past the kernel's limit (``PACKED_FROM_ROWS_AVX2``): on the Zen 1 EPYC the kernel measured 0.73-0.86x
    oneDNN's time at 1-16 float32 rows (``benchmarks/linear_rows.py --threads 2``, BENCHMARKS.md section 0z)."""
    return os.environ.get("PREFIXSERVE_PACKED_LINEAR", "") == "1" or "avx512f" in _cpu_flag_set()


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder a ``dtype`` weight into its blocked layout on this CPU: float32 anywhere, bfloat16
    only with AVX-512 BW / VL / DQ or AVX-NE-CONVERT (elsewhere ``_reorder_linear_weight`` raises)."""
    if dtype != torch.bfloat16:
        return True
    flags = _cpu_flag_set()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
