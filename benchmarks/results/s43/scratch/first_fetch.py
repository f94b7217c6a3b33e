"""The first answer on a new page-stream connection against later ones, by the receiver's socket buffer: a holder
process serves 16 bf16 pages of the tiny Llama's shape; the receiver drops its idle connection, then fetches twice
into a pool's pages (30 rounds, medians). ``buffer_bytes`` 0 is the kernel's autotuning (the code before 0zi).

    PYTHONPATH=. .venv/bin/python benchmarks/results/s43/scratch/first_fetch.py
"""
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from stream_recv import DIM, HEADS, LAYERS, PAGE, PAGES, holder  # noqa: E402

from replica.page_stream import StreamClient  # noqa: E402

if __name__ == "__main__":
    q = mp.Queue()
    p = mp.Process(target=holder, args=(q, "bfloat16"), daemon=True)
    p.start()
    location = q.get()
    keys = [bytes([n + 1]) * 32 for n in range(PAGES)]
    pool = torch.zeros((LAYERS, 2, 64, PAGE, HEADS, DIM), dtype=torch.bfloat16)
    out = [pool[:, :, 5 + 2 * n] for n in range(PAGES)]
    client = StreamClient(timeout_s=10)
    client.fetch(location, keys, out)
    for rnd in range(2):
        for size in (0, 4 << 20, 2 << 20, 1 << 20):
            client.buffer_bytes = size
            fresh, warm = [], []
            for _ in range(30):
                client.forget(location)
                t0 = time.perf_counter()
                client.fetch(location, keys, out)
                t1 = time.perf_counter()
                client.fetch(location, keys, out)
                t2 = time.perf_counter()
                fresh.append(t1 - t0)
                warm.append(t2 - t1)
            print(f"receive buffer {size >> 20 if size else 'kernel'} MiB: first fetch on a new connection "
                  f"{statistics.median(fresh) * 1000:.2f} ms, next {statistics.median(warm) * 1000:.2f} ms")
    client.close()
    p.kill()
