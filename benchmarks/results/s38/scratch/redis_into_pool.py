"""A Redis tier load (2 connections) into fresh page tensors against the same load into pages of a KV pool (the
landing pages' views), alternating, on one private redis-server. PYTHONPATH=. .venv/bin/python
benchmarks/results/s38/scratch/redis_into_pool.py --dtype bfloat16"""
import argparse
import statistics
import time

import torch

from benchmarks.kv_sources import private_redis
from common.page_format import PageFormat
from common.page_keys import compute_page_keys
from replica.tiers.base import StoredPage
from replica.tiers.redis_tier import RedisTier
from replica.tiers.seal import TierKey

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--rounds", type=int, default=30)
parser.add_argument("--parts", type=int, default=2)
args = parser.parse_args()
fmt = PageFormat(num_layers=8, page_size=128, num_kv_heads=4, head_dim=64, dtype=args.dtype, model_fingerprint="x")
dtype = getattr(torch, args.dtype)
token_ids = [n % 8000 for n in range(16 * 128)]
keys = compute_page_keys(token_ids, page_size=128, model_fingerprint="x")
pages = [StoredPage.from_format(fmt, key, token_ids[n * 128:(n + 1) * 128], torch.randn(fmt.kv_shape).to(dtype))
         for n, key in enumerate(keys)]
tokens = [page.token_ids for page in pages]
pool = torch.zeros(8, 2, 64, 128, 4, 64, dtype=dtype)  # [layers, 2, pages, page_size, kv_heads, dim]
views = [pool[:, :, 3 * n + 1] for n in range(16)]
untouched = torch.empty(8, 2, 16 * (args.rounds + 2), 128, 4, 64, dtype=dtype)  # never written before its load
fresh_views = lambda r: [untouched[:, :, 16 * r + n] for n in range(16)]
server = private_redis("1gb")
try:
    time.sleep(0.5)
    tier = RedisTier(f"redis://127.0.0.1:{server.port}/0", fmt, tier_key=TierKey.generate(), key_prefix="p:",
                     load_connections=args.parts, socket_timeout_s=10.0)
    tier.store(pages)
    assert tier.flush(timeout=30)
    times = {"fresh tensors": [], "pool pages": [], "pool pages never written": []}
    for r in range(args.rounds):
        for name, out in (("fresh tensors", None), ("pool pages", views), ("pool pages never written", fresh_views(r))):
            start = time.perf_counter()
            loaded = tier.load(keys, tokens, out) if out is not None else tier.load(keys, tokens)
            times[name].append(time.perf_counter() - start)
            assert len(loaded) == 16
            del loaded
    assert all(torch.equal(views[n], pages[n].kv) for n in range(16))
    size = sum(p.kv.numel() * p.kv.element_size() for p in pages)
    for name, values in times.items():
        m = statistics.median(values)
        print(f"{args.dtype} {args.parts} connections, into {name}: median {m * 1000:.1f} ms "
              f"min {min(values) * 1000:.1f} ms, {size / m / 1e9:.2f} GB/s")
    tier.close()
finally:
    server.close()
