"""A Redis tier load read in 1, 2, 3, 4 ... parts on as many connections at once (``RedisTier(load_connections=N)``).

One private ``redis-server`` (as ``kv_sources.py`` starts it: TCP on a free port and a unix socket); a 2048-token
prefix's pages of the tiny Llama (16 pages, 1 MiB each in bfloat16, 2 MiB in float32) stored once; then each
setting's ``load`` (MGETs, verify, decrypt into page tensors) timed in turn, round after round, so that every setting
sees the same box. Also the server's CPU time per load (/proc), the bound of one reply stream.

    PYTHONPATH=. .venv/bin/python benchmarks/redis_load_parts.py [--parts 1,2,3,4] [--rounds 30] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.kv_sources import private_redis
from benchmarks.tier_transfer_floor import cpu_seconds
from common.page_format import PageFormat
from common.page_keys import compute_page_keys
from replica.tiers.base import StoredPage
from replica.tiers.redis_tier import RedisTier
from replica.tiers.seal import TierKey


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="1,2,3,4")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-pages", type=int, default=16)
    args = parser.parse_args(argv)
    settings = [int(part) for part in args.parts.split(",")]
    page_format = PageFormat(num_layers=8, page_size=128, num_kv_heads=4, head_dim=64, dtype=args.dtype,
                             model_fingerprint="redis-load-parts")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    token_ids = [n % 8000 for n in range(args.num_pages * 128)]
    page_keys = compute_page_keys(token_ids, page_size=128, model_fingerprint=page_format.model_fingerprint)
    pages = [StoredPage.from_format(page_format, key, token_ids[n * 128:(n + 1) * 128],
                                    torch.randn(page_format.kv_shape, generator=generator).to(dtype))
             for n, key in enumerate(page_keys)]
    keys = [page.key for page in pages]
    tokens = [page.token_ids for page in pages]
    num_bytes = sum(page.kv.numel() * page.kv.element_size() for page in pages)
    server = private_redis("1gb")
    tier_key = TierKey.generate()
    tiers = {}
    try:
        time.sleep(0.5)
        urls = {"TCP": f"redis://127.0.0.1:{server.port}/0", "unix socket": f"unix://{server.socket}?db=0"}
        for where, url in urls.items():
            for parts in settings:
                tiers[where, parts] = RedisTier(url, page_format, tier_key=tier_key, key_prefix="parts:",
                                                load_connections=parts, socket_timeout_s=10.0)
        writer = tiers["TCP", settings[0]]
        writer.store(pages)
        assert writer.flush(timeout=30)
        for tier in tiers.values():  # warm-up: connections open, buffers allocated
            assert len(tier.load(keys, tokens)) == len(keys)
        wall = {name: [] for name in tiers}
        cpu = {name: [] for name in tiers}
        for _ in range(args.rounds):
            for name, tier in tiers.items():
                cpu_before = cpu_seconds(server.process.pid)
                start = time.perf_counter()
                loaded = tier.load(keys, tokens)
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(cpu_seconds(server.process.pid) - cpu_before)
                assert len(loaded) == len(keys)
                del loaded
        med = statistics.median
        print(f"\n{len(keys)} pages = {num_bytes / 2**20:.0f} MiB ({args.dtype}), medians of {args.rounds} rounds; "
              f"cpu count {os.cpu_count()}\n")
        print("| connection | parts (connections, threads) | load median | min | GB/s (median) | "
              "redis-server CPU per load (mean) |")
        print("|---|---|---|---|---|---|")
        for (where, parts), values in wall.items():
            print(f"| {where} | {parts} | {med(values) * 1000:.1f} ms | {min(values) * 1000:.1f} ms | "
                  f"{num_bytes / med(values) / 1e9:.2f} | "
                  f"{statistics.mean(cpu[where, parts]) * 1000:.1f} ms |")
    finally:
        for tier in tiers.values():
            tier.close()
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
