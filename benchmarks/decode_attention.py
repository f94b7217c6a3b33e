"""Decode attention over pages, per layer: each request attended over its own gathered K/V (the path of rows that share
no prefix) vs requests sharing prefix pages attended together over the shared run (replica/paged_attention.py). Both variants are timed alternately in one
process, so machine noise hits them alike; the outputs are compared.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_attention.py
"""

from __future__ import annotations

import statistics
import time

import torch

from replica.paged_attention import _attend_gathered, _attend_shared, gather_plan, group_shared_runs

KV_HEADS, GROUP, HEAD_DIM, PAGE = 4, 2, 64, 128  # the tiny Llama 512 x 8 of the other benchmarks (8 heads / 4 KV heads)


def case(num_rows: int, shared_len: int, own_len: int, rounds: int = 30) -> tuple[float, float, float]:
    k_cache = torch.randn(400 * PAGE, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(400 * PAGE, KV_HEADS, HEAD_DIM)
    queries = torch.randn(num_rows, KV_HEADS, GROUP, HEAD_DIM)
    # shared pages first, then each request's own pages elsewhere in the pool
    runs = [[(0, shared_len), (shared_len + 1000 + row * (own_len + PAGE), own_len)] for row in range(num_rows)]
    groups, singles = group_shared_runs(runs, min_shared=PAGE)
    assert len(groups) == 1 and not singles

    alone_plan = gather_plan(runs, torch.device("cpu"))

    def alone():
        return _attend_gathered(queries, k_cache, v_cache, alone_plan, None)

    def together():
        return _attend_shared(queries, k_cache, v_cache, groups[0], None)

    max_diff = (alone() - together()).abs().max().item()
    times: dict[str, list[float]] = {"alone": [], "together": []}
    for _ in range(rounds):
        for name, fn in (("alone", alone), ("together", together)):
            started = time.perf_counter()
            for _ in range(5):
                fn()
            times[name].append((time.perf_counter() - started) / 5)
    return statistics.median(times["alone"]), statistics.median(times["together"]), max_diff


def main() -> None:
    torch.set_num_threads(1)
    print("| requests | shared prefix | own tokens each | alone (per layer) | together | speed-up | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for num_rows, shared_len, own_len in [(4, 1792, 300), (4, 512, 900), (8, 1792, 300), (2, 1024, 100),
                                          (4, 128, 1500)]:
        alone, together, diff = case(num_rows, shared_len, own_len)
        print(f"| {num_rows} | {shared_len} | {own_len} | {alone * 1e6:.0f} us | {together * 1e6:.0f} us | "
              f"{alone / together:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
