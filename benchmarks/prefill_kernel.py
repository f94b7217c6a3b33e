"""A C++ prefill attention kernel alone, one layer's call, against ATen's flash kernel on the same inputs, and
optionally against other versions of the kernel's source, all in one process with the calls alternating (this box is
noisy: compare within a run). ``--dtype bfloat16`` (default): the AMX kernel (``replica/csrc/amx_attention.cpp``), or
on a CPU without AMX the kernel of ``replica/csrc/prefill_attention.cpp``: with AVX512-BF16 its vdpbf16ps path, beside
its widened-to-float32 path (column "widened", ``bf16_dot=False``); ``--dtype float32``: the AVX2 kernel
(``replica/csrc/prefill_attention.cpp``).

One call attends T query tokens (heads x head dim, grouped-query: kv heads) to a cached context of C keys plus their
own T tokens (causal), the keys in one run of pool slots. Reported: the best of ``--reps`` wall times per call, in
microseconds, and GFLOP/s of the two products (4 x heads x T x keys seen x head dim).

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_kernel.py [--threads 1] [--context 2048] [--tokens 1,16,64,256]
    # an older kernel beside this one (e.g. the previous commit's), built under its own op namespace:
    git show HEAD~2:replica/csrc/amx_attention.cpp > /tmp/old_amx.cpp
    PYTHONPATH=. .venv/bin/python benchmarks/prefill_kernel.py --source old=/tmp/old_amx.cpp
    PYTHONPATH=. .venv/bin/python benchmarks/prefill_kernel.py --dtype float32 --threads 2 --tokens 16,64,256
    # bfloat16 without AMX (an AVX512-BF16 EPYC): pair dot products against the widened float32 arithmetic
    PYTHONPATH=. .venv/bin/python benchmarks/prefill_kernel.py --dtype bfloat16 --threads 2 --context 1536 --tokens 64,256
    # as inside an engine step (scattered pages, caches flushed before each call), against the previous version:
    git show HEAD~1:replica/csrc/prefill_attention.cpp > /tmp/old_f32.cpp
    PYTHONPATH=. .venv/bin/python benchmarks/prefill_kernel.py --dtype float32 --cold --source before=/tmp/old_f32.cpp
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from replica import cpu_kernels


def build_renamed(prefix: str, name: str, source: Path):
    """``source`` (a version of one of replica/csrc's kernels) built and loaded with its ops under
    ``<prefix>_<name>_<digest>`` instead of ``prefixserve_cpu``; its headers come from replica/csrc."""
    text = source.read_text()
    namespace = f"{prefix}_{name}_{hashlib.sha256(text.encode()).hexdigest()[:10]}"
    path = Path(tempfile.gettempdir()) / f"prefixserve_{namespace}.cpp"
    path.write_text(text.replace("prefixserve_cpu", namespace))
    from torch.utils.cpp_extension import load as build

    build(name=namespace, sources=[str(path)], extra_cflags=cpu_kernels.CFLAGS, extra_ldflags=["-fopenmp"],
          extra_include_paths=[str(cpu_kernels.SOURCES[0].parent)], is_python_module=False)
    return getattr(torch.ops, namespace)


def build_version(name: str, source: Path, dtype: torch.dtype) -> object:
    """``source`` (a version of amx_attention.cpp or prefill_attention.cpp) built and loaded with its ops under
    ``ab_<name>_<digest>``."""
    ops = build_renamed("ab", name, source)
    if not (ops.has_amx() if dtype == torch.bfloat16 and cpu_kernels.has_amx() else ops.has_vector_prefill()):
        raise SystemExit(f"{source}: built without the instructions it needs (or the CPU has none)")
    return ops


def kernel_call(ops, dtype: torch.dtype):
    """The op of ``ops`` for ``dtype`` (the AMX kernel's, or the vector kernel's: float32, and bfloat16 off AMX)."""
    return ops.prefill_attention if dtype == torch.bfloat16 and cpu_kernels.has_amx() else ops.prefill_attention_f32


def flash(query, keys, values, context, scale, out):
    """ATen's flash kernel as the run-by-run path used it: the cached keys, then the own tokens (causal), merged by
    log-sum-exp. ``keys`` / ``values``: [1, heads, context + tokens, dim], the kv heads already repeated for the query
    heads (outside the timing, so the column is ATen's kernel and the merge alone)."""
    q = query.transpose(0, 1)[None]
    own = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys[:, :, context:], values[:, :, context:], 0.0, True, scale=scale)[:2]
    if not context:
        out.copy_(own[0][0].transpose(0, 1))
        return
    cached = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys[:, :, :context], values[:, :, :context], 0.0, False, scale=scale)[:2]
    (o1, l1), (o2, l2) = cached, own
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top)[..., None], torch.exp(l2 - top)[..., None]
    out.copy_(((o1.float() * w1 + o2.float() * w2) / (w1 + w2))[0].transpose(0, 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048, help="cached keys before the chunk")
    parser.add_argument("--tokens", default="1,16,64,256,1024", help="chunk lengths, comma-separated")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                        help="another version of the kernel's source to time beside this one (repeatable)")
    parser.add_argument("--no-flash", action="store_true", help="skip ATen's flash kernel")
    parser.add_argument("--cold", action="store_true",
                        help="as in an engine step: the context in 128-token pages scattered over a pool of 16384 "
                             "slots, and 128 MiB written before every call (the layer's weights and other layers' "
                             "KV pass through the caches between two calls of one layer); medians, not bests")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ready = cpu_kernels.load() and (cpu_kernels.has_amx() or cpu_kernels.has_vector_prefill())
    widened = dtype == torch.bfloat16 and not cpu_kernels.has_amx() and cpu_kernels.has_bf16_dot()
    if not ready:
        raise SystemExit(f"the {args.dtype} prefill kernel is not available here: {cpu_kernels._state}")
    kernels = {"this": torch.ops.prefixserve_cpu}
    for spec in args.source:
        name, _, path = spec.partition("=")
        kernels[name] = build_version(name, Path(path), dtype)
    gen = torch.Generator().manual_seed(0)
    longest = args.context + max(int(t) for t in args.tokens.split(","))
    slots = max(longest, 16384) if args.cold else longest
    k_cache = torch.randn(slots, args.kv_heads, args.head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, args.kv_heads, args.head_dim, generator=gen).to(dtype)
    page_order = torch.randperm(slots // 128, generator=gen).tolist() if args.cold else None
    flush = torch.empty(32 << 20) if args.cold else None
    scale = args.head_dim ** -0.5
    names = list(kernels) + (["widened"] if widened else []) + ([] if args.no_flash else ["aten flash"])
    print(f"{args.dtype}, threads {args.threads}, {args.heads} heads / {args.kv_heads} kv heads x {args.head_dim}, context "
          f"{args.context}; " + (f"caches flushed, scattered pages: median of {args.reps} calls" if args.cold else
                                 f"best of {args.reps} calls") + ", us (GFLOP/s)")
    print("| tokens | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for tokens in (int(t) for t in args.tokens.split(",")):
        query = torch.randn(tokens, args.heads, args.head_dim, generator=gen).to(dtype)
        if args.cold:  # whole pages, the chunk's own tokens in the last one or more
            runs = torch.tensor([[page * 128, min(128, args.context + tokens - 128 * i)]
                                 for i, page in enumerate(page_order[:-(-(args.context + tokens) // 128)])])
        else:
            runs = torch.tensor([[0, args.context + tokens]])
        outs = {name: torch.empty_like(query) for name in names}
        calls = {name: (lambda op=kernel_call(ops, dtype), out=outs[name]: op(query, k_cache, v_cache, runs, scale,
                                                                              out))
                 for name, ops in kernels.items()}
        if widened:
            calls["widened"] = lambda: torch.ops.prefixserve_cpu.prefill_attention_f32(
                query, k_cache, v_cache, runs, scale, outs["widened"], bf16_dot=False)
        if not args.no_flash:
            group = args.heads // args.kv_heads
            order = torch.cat([torch.arange(first, first + length) for first, length in runs.tolist()])
            keys, values = (cache[order].transpose(0, 1).repeat_interleave(group, 0)[None]
                            for cache in (k_cache, v_cache))
            calls["aten flash"] = lambda: flash(query, keys, values, args.context, scale, outs["aten flash"])
        times = {name: [] for name in names}
        for rep in range(args.reps + 3):
            for name in names:
                if flush is not None:
                    flush.fill_(rep)
                start = time.perf_counter()
                calls[name]()
                elapsed = time.perf_counter() - start
                if rep >= 3:
                    times[name].append(elapsed)
        best = {name: (statistics.median(values) if args.cold else min(values)) for name, values in times.items()}
        for name in names:  # every version computes the same attention
            torch.testing.assert_close(outs[name].float(), outs["this"].float(), rtol=0.02, atol=0.02)
        seen = tokens * args.context + tokens * (tokens + 1) / 2
        flops = 4 * args.heads * seen * args.head_dim
        cells = [f"{best[name] * 1e6:.0f} ({flops / best[name] / 1e9:.0f})" for name in names]
        print(f"| {tokens} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
