"""The C++ decode attention kernel alone (``replica.cpu_kernels.decode_attention``), per step of 8 layers: its
16-float vector code (``vector_code=True``; used only on CPUs with AVX-512) against its plain loops (auto-vectorised
to the CPU's width), alternating in one process on the same inputs. Shapes of the tiny Llama 512 x 8: 8 heads of 64
over 4 KV heads. Cases: 1 row over 2048 keys, and 4 / 16 rows sharing a 1792-key prefix with 256 keys of their own.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_kernel.py [--rounds 40]

On a CPU without AVX-512 both columns run the plain loops (the vector code is not used there); check out a revision
before session 9 to time the vector code on such a CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from replica import cpu_kernels

KV_HEADS, GROUP, HEAD_DIM, LAYERS = 4, 2, 64, 8


def plan(rows: int, shared: int, own: int) -> tuple[torch.Tensor, ...]:
    segments = [(0, shared, 0, rows)] if shared else []
    seg_rows = list(range(rows)) if shared else []
    for row in range(rows):
        segments.append((shared + 100 + row * (own + 128), own, len(seg_rows), len(seg_rows) + 1))
        seg_rows.append(row)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return as_long(segments), as_long(seg_rows), as_long([(0, len(segments), 0, len(seg_rows))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit(f"CPU kernels not built: {cpu_kernels._state.get('reason')}")
    torch.set_num_threads(1)
    k_cache, v_cache = torch.randn(20000, KV_HEADS, HEAD_DIM), torch.randn(20000, KV_HEADS, HEAD_DIM)
    print("| rows, shared + own keys | vector code ms | plain loops ms |")
    print("|---|---|---|")
    for rows, shared, own in ((1, 0, 2048), (4, 1792, 256), (16, 1792, 256)):
        query = torch.randn(rows, KV_HEADS * GROUP, HEAD_DIM)
        step_plan = plan(rows, shared, own)
        outs = {True: torch.zeros_like(query), False: torch.zeros_like(query)}
        best = {True: float("inf"), False: float("inf")}
        for _ in range(args.rounds):
            for vector_code in (True, False):
                started = time.perf_counter()
                for _ in range(LAYERS):
                    cpu_kernels.decode_attention(query, k_cache, v_cache, *step_plan, outs[vector_code], 0.125,
                                                 vector_code=vector_code)
                best[vector_code] = min(best[vector_code], (time.perf_counter() - started) * 1000)
        torch.testing.assert_close(outs[True], outs[False], rtol=1e-4, atol=1e-5)
        print(f"| {rows}, {shared} + {own} | {best[True]:.2f} | {best[False]:.2f} |")


if __name__ == "__main__":
    main()
