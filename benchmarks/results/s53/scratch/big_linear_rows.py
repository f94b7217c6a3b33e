"""Decode-step linear layers of a Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 / 2 heads, intermediate 4864,
vocab 32000) in process: each path's time for the whole step's weights and the read bandwidth it implies, against a
plain read of the same bytes (torch.sum) on 1 and 2 threads.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s53/scratch/big_linear_rows.py [--dtype bfloat16] [--rows 1,4]
"""
import argparse
import time

import torch

from replica import cpu_kernels
from replica.llama import PAIRS_BELOW_ROWS

SHAPES = [(896, 1152), (896, 896), (896, 9728), (4864, 896)]


def best_of(fn, rounds=7, inner=3):
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best * 1000


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--layers", type=int, default=24)
    a = p.parse_args()
    assert cpu_kernels.load()
    dtype = getattr(torch, a.dtype)
    weights = [torch.randn(n, k).to(dtype) for _ in range(a.layers) for k, n in SHAPES]
    weights.append(torch.randn(32000, 896).to(dtype))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.cat([w.reshape(-1) for w in weights])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        ms = best_of(lambda: flat.sum())
        print(f"plain read (torch.sum), {threads} thread(s): {ms:.2f} ms, {nbytes / ms / 1e6:.1f} GB/s")
    torch.set_num_threads(1)
    pairs = [cpu_kernels.pack_pairs(w) for w in weights] if cpu_kernels.has_pair_linear(dtype) else None
    packed = [cpu_kernels.pack_linear_weight(w) for w in weights]
    print(f"weights {nbytes / 2**20:.0f} MiB {a.dtype}; pair kernel built: {pairs is not None}")
    for rows in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(dtype) for k in (896, 4864)}
        paths = {
            "small-row kernel": lambda: [cpu_kernels.linear(xs[w.shape[1]], w) for w in weights],
            "oneDNN packed": lambda: [cpu_kernels.linear(xs[w.shape[1]], w, packed=pk, packed_from_rows=1,
                                                         use_kernel=False) for w, pk in zip(weights, packed)],
        }
        if pairs is not None:
            paths["pair kernel"] = lambda: [cpu_kernels.linear(xs[w.shape[1]], w, pairs=pp,
                                                               pairs_below_rows=PAIRS_BELOW_ROWS)
                                            for w, pp in zip(weights, pairs)]
        for armed in (False, True):
            cpu_kernels.arm_step_helper(armed)
            for name, fn in paths.items():
                # armed at each step's start, as the engine does (an armed helper sleeps after 5 ms without work)
                ms = best_of(lambda: (cpu_kernels.arm_step_helper(armed), fn()))
                print(f"rows {rows} helper {'on ' if armed else 'off'} {name:18s} {ms:7.2f} ms "
                      f"{nbytes / ms / 1e6:5.1f} GB/s")
        cpu_kernels.arm_step_helper(False)


if __name__ == "__main__":
    main()
