"""The page stream's receive side alone: a holder process serves 16 pages of the tiny Llama's shape (8 layers, 128
tokens, 4 KV heads, head dim 64) from a SharedPool over loopback TCP; the receiver fetches them into fresh slots, or
into a pool's pages (landing views, 2 x layers runs each), timed over 40 fetches.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s43/scratch/stream_recv.py [bfloat16|float32]
"""
import multiprocessing as mp
import statistics
import sys
import time

import torch

from replica.page_stream import StreamClient
from replica.shared_pool import SharedPool

LAYERS, PAGE, HEADS, DIM, PAGES = 8, 128, 4, 64, 16


def holder(q, dtype_name):
    dtype = getattr(torch, dtype_name)
    pool = SharedPool((LAYERS, 2, 40, PAGE, HEADS, DIM), dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape).to(dtype))
    keys = [bytes([n + 1]) * 32 for n in range(PAGES)]
    ids = list(range(3, 3 + PAGES))

    def answer(asked):
        held = [key for key, _ in zip(keys, asked)]
        page_ids = ids[:len(held)]
        return pool.bundle(held, [list(range(PAGE))] * len(held), page_ids, pool.generations[page_ids].tolist())

    pool.serve_stream(answer, "127.0.0.1")
    q.put(pool.stream_location)
    time.sleep(3600)


def main():
    dtype_name = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    dtype = getattr(torch, dtype_name)
    q = mp.Queue()
    p = mp.Process(target=holder, args=(q, dtype_name), daemon=True)
    p.start()
    location = q.get()
    keys = [bytes([n + 1]) * 32 for n in range(PAGES)]
    client = StreamClient(timeout_s=10)
    pool = torch.zeros((LAYERS, 2, 64, PAGE, HEADS, DIM), dtype=dtype)
    for rnd in range(2):
        for mode in ("slots", "landing (every other page)", "landing (consecutive pages)"):
            times = []
            for _ in range(40):
                out = None
                if mode.startswith("landing"):
                    step = 2 if "other" in mode else 1
                    out = [pool[:, :, 5 + step * n] for n in range(PAGES)]
                start = time.perf_counter()
                found, _tokens, pages, _ = client.fetch(location, keys, out)
                times.append(time.perf_counter() - start)
                assert len(found) == PAGES
                del pages
            med = statistics.median(times[5:])
            nbytes = PAGES * LAYERS * 2 * PAGE * HEADS * DIM * dtype.itemsize
            print(f"{dtype_name} {mode}: median {med * 1000:.2f} ms ({nbytes / med / 1e9:.2f} GB/s), "
                  f"min {min(times) * 1000:.2f} ms")
    client.close()
    p.kill()


if __name__ == "__main__":
    main()
