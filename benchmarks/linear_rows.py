"""The linear layers of one decode step for a few rows, in process: the small-row C++ kernel
(``replica/csrc/small_linear.cpp``, ``replica.cpu_kernels.linear``) against oneDNN's packed GEMM (what inductor's
frozen bfloat16 graphs call) and ATen's ``F.linear`` (MKL for float32), on the tiny Llama 512 x 8's shapes: 8 layers
of qkv 512->1024, o 512->512, gate_up 512->2048 and down 1024->512, then the 512->8192 head, every weight its own
tensor so that a step streams all of them from memory as the model does (46 MiB bfloat16, 92 MiB float32). One
thread (``--threads``: a prefill step's count); the best of 5 rounds of 5 steps each, the paths interleaved within a
round.

    PYTHONPATH=. .venv/bin/python benchmarks/linear_rows.py [--dtype bfloat16] [--rows 1,2,4,8,16] [--threads 1]

Rows above the kernel's limit (16 float32, 8 bfloat16) time the library paths only in practice (the kernel column
is then at::linear too). float32 adds MKL's prepacked GEMM (``torch.ops.mkl._mkl_linear``), the path inductor's
weight freezing takes.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from replica import cpu_kernels
from replica.llama import PAIRS_BELOW_ROWS

SHAPES = [(512, 1024), (512, 512), (512, 2048), (1024, 512)]  # (in, out) per layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,24")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit(f"CPU kernels not built: {cpu_kernels._state.get('reason')}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(n, k).to(dtype) for _ in range(args.layers) for k, n in SHAPES]
    weights.append(torch.randn(8192, 512).to(dtype))
    mkl = dtype == torch.float32  # MKL's packed GEMM (inductor's frozen float32 graphs) exists for float32 only
    pairs = cpu_kernels.has_pair_linear(dtype)  # the pair-layout kernel (AVX-512; bfloat16: AVX512-BF16)
    pair_weights = [cpu_kernels.pack_pairs(w) for w in weights] if pairs else []
    print(f"| rows ({args.dtype}) | small-row kernel ms | oneDNN packed ms | F.linear ms | kernel / best other |"
          + (" MKL packed ms |" if mkl else "") + (" pair kernel ms | pair / best other |" if pairs else ""))
    print("|---|---|---|---|---|" + ("---|" if mkl else "") + ("---|---|" if pairs else ""))
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).to(dtype) for k in (512, 1024)}
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        mkl_packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights] if mkl else []
        with_pairs = pairs and rows < PAIRS_BELOW_ROWS
        for index, w in enumerate(weights[:5]):  # the kernels' numbers are the GEMM's up to rounding
            x = inputs[w.shape[1]]
            expected = F.linear(x, w).float()
            torch.testing.assert_close(cpu_kernels.linear(x, w).float(), expected, rtol=2e-2, atol=2e-2)
            if with_pairs:
                torch.testing.assert_close(cpu_kernels.linear(x, w, pairs=pair_weights[index],
                                                              pairs_below_rows=PAIRS_BELOW_ROWS).float(),
                                           expected, rtol=2e-2, atol=2e-2)
        paths = {
            "kernel": lambda: [cpu_kernels.linear(inputs[w.shape[1]], w) for w in weights],
            "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
                               for w, p in zip(weights, packed)],
            "aten": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
        }
        if mkl:
            paths["mkl"] = lambda: [torch.ops.mkl._mkl_linear(inputs[w.shape[1]], m, w, None, rows)
                                    for w, m in zip(weights, mkl_packed)]
        if with_pairs:
            paths["pairs"] = lambda: [cpu_kernels.linear(inputs[w.shape[1]], w, pairs=p,
                                                         pairs_below_rows=PAIRS_BELOW_ROWS)
                                      for w, p in zip(weights, pair_weights)]
        best = {name: float("inf") for name in paths}
        for fn in paths.values():
            fn()
        for _ in range(5):
            for name, fn in paths.items():
                started = time.perf_counter()
                for _ in range(5):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - started) / 5 * 1000)
        other = min(best["onednn"], best["aten"])
        pair_cells = ""
        if "pairs" in best:
            pair_cells = f" {best['pairs']:.2f} | {best['pairs'] / min(other, best['kernel']):.2f}x |"
        elif pairs:
            pair_cells = " - | - |"
        print(f"| {rows} | {best['kernel']:.2f} | {best['onednn']:.2f} | {best['aten']:.2f} | "
              f"{best['kernel'] / other:.2f}x |" + (f" {best['mkl']:.2f} |" if mkl else "") + pair_cells)


if __name__ == "__main__":
    main()
