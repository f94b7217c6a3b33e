"""AES-256-GCM open of 16 sealed 1 MiB pages: into one buffer, into a pool page's 16 runs (the tier's path), and into a
1 MiB scratch buffer then copied to the runs with torch's copy_ (which runs on torch's intra-op threads: both cores;
seal_variants.py compares the three on one thread).
PYTHONPATH=. .venv/bin/python benchmarks/results/s54/scratch/seal_into_pool.py"""
import os
import time

import torch

from replica.tiers.seal import TierKey, new_nonce

key = TierKey.generate()
plain = bytearray(os.urandom(1 << 20))
ad = b"x" * 32
sealed = [bytearray((1 << 20) + 16) for _ in range(16)]
nonces = [new_nonce() for _ in range(16)]
for i in range(16):
    key.seal_into(nonces[i], plain, ad, sealed[i])
flat = torch.empty(16, 1 << 20, dtype=torch.uint8)
pool = torch.zeros(16, 64, 16, 1 << 16, dtype=torch.uint8)  # [run, page, ...]: a page's 16 runs lie apart
scratch = torch.empty(1 << 20, dtype=torch.uint8)
for rep in range(6):
    t = time.perf_counter()
    for i in range(16):
        key.open_into(nonces[i], sealed[i], ad, memoryview(flat[i].numpy()))
    one = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(16):
        key.open_into(nonces[i], sealed[i], ad, [memoryview(pool[p, i, 0].numpy()) for p in range(16)])
    runs = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(16):
        key.open_into(nonces[i], sealed[i], ad, memoryview(scratch.numpy()))
        pool[:, i, 0].copy_(scratch.view(16, 1 << 16))
    staged = time.perf_counter() - t
    print(f"16 MiB: one buffer {one * 1e3:.2f} ms, the pool's runs {runs * 1e3:.2f} ms, "
          f"scratch then the runs {staged * 1e3:.2f} ms")
