"""The C++ decode attention kernel alone (``replica.cpu_kernels.decode_attention``), per step of 8 layers: its
vector code (``vector_code=True``; AVX-512 or AVX2 + FMA vectors, whichever the CPU has widest) against its plain
loops (auto-vectorised to the CPU's width), and optionally against other versions of its source (``--source NAME=PATH``, built under their
own op namespace), alternating in one process on the same inputs. Shapes of the tiny Llama 512 x 8: 8 heads of 64
over 4 KV heads, every layer its own pool (as in the engine, a step's KV comes from memory, not the caches). Cases: 1
row over 2048 keys; 4 rows with 1792 keys each (prefix_repetition's decode batch: no prefix shared); 4 / 16 rows
sharing a 1792-key prefix with 256 keys of their own. Also reported: the KV bytes read per second.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_kernel.py [--dtype bfloat16] [--threads 2] [--rounds 40]
    # against an older version (e.g. session 18's, before keys were scored 16 at a time):
    git show df2ddf2:replica/csrc/decode_attention.cpp > /tmp/decode_s18.cpp
    PYTHONPATH=. .venv/bin/python benchmarks/decode_kernel.py --dtype bfloat16 --source s18=/tmp/decode_s18.cpp

On a CPU with neither, the vector column runs the plain loops too (the vector code is not used there).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.prefill_kernel import build_renamed
from replica import cpu_kernels

KV_HEADS, GROUP, HEAD_DIM, LAYERS, SLOTS = 4, 2, 64, 8, 16384


def plan(rows: int, shared: int, own: int) -> tuple[torch.Tensor, ...]:
    """Segments, rows and components: ``shared`` keys read by all rows (one component), or none (each row its own
    component), then ``own`` keys per row."""
    segments, seg_rows, components = [], [], []
    if shared:
        segments.append((0, shared, 0, rows))
        seg_rows.extend(range(rows))
    for row in range(rows):
        segments.append((shared + 100 + row * (own + 128), own, len(seg_rows), len(seg_rows) + 1))
        seg_rows.append(row)
        if not shared:
            components.append((row, row + 1, row, row + 1))
    if shared:
        components.append((0, len(segments), 0, rows))
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return as_long(segments), as_long(seg_rows), as_long(components)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                        help="another version of decode_attention.cpp to time beside this one (repeatable)")
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit(f"CPU kernels not built: {cpu_kernels._state.get('reason')}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    this = torch.ops.prefixserve_cpu.decode_attention
    calls = {"vector code": lambda *a: this(*a, True), "plain loops": lambda *a: this(*a, False)}
    for spec in args.source:
        name, _, path = spec.partition("=")
        calls[name] = build_renamed("dk", name, Path(path)).decode_attention
    gen = torch.Generator().manual_seed(0)
    pools = [(torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
              torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)) for _ in range(LAYERS)]
    print(f"{args.dtype}, {args.threads} thread(s), best of {args.rounds}: ms per step of {LAYERS} layers (KV GB/s)")
    print("| rows, shared + own keys | " + " | ".join(calls) + " |")
    print("|---|" + "---|" * len(calls))
    for rows, shared, own in ((1, 0, 2048), (4, 0, 1792), (4, 1792, 256), (16, 1792, 256)):
        query = torch.randn(rows, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
        step_plan = plan(rows, shared, own)
        outs = {name: torch.zeros_like(query) for name in calls}
        best = {name: float("inf") for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                started = time.perf_counter()
                for k_cache, v_cache in pools:
                    call(query, k_cache, v_cache, *step_plan, outs[name], 0.125)
                best[name] = min(best[name], time.perf_counter() - started)
        for name in calls:  # every version computes the same attention
            torch.testing.assert_close(outs[name].float(), outs["plain loops"].float(), rtol=0.01, atol=0.01)
        kv_bytes = (shared + rows * own) * KV_HEADS * HEAD_DIM * 2 * query.element_size() * LAYERS
        cells = [f"{best[name] * 1000:.2f} ({kv_bytes / best[name] / 1e9:.1f})" for name in calls]
        print(f"| {rows}, {shared} + {own} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
