"""Cost of loading 16 pages (16 MiB, bfloat16, 8 layers x 4 KV heads x 64) from the Redis and disk tiers and writing them
into a page pool: wall time, the loading thread's CPU time (``time.thread_time``) and, for Redis, the server's CPU time
(from /proc), so that two page codecs can be compared on a busy machine (wall time there mostly measures the
neighbours; CPU time per byte is what the codec costs).

Runs against whatever checkout is first on the path; compare two by running it from each, alternating:

    (cd /path/to/old && python /path/to/benchmarks/tier_load_cpu.py)     # tiers built without tier_key
    (cd /path/to/new && python /path/to/benchmarks/tier_load_cpu.py)

Needs redis-server (started here on a free port). ``--prof`` adds a cProfile of five loads per tier.
"""

from __future__ import annotations

import cProfile
import inspect
import os
import pstats
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())  # the checkout to measure

import torch  # noqa: E402

from common.page_format import PageFormat  # noqa: E402
from common.page_keys import compute_page_keys  # noqa: E402
from replica.tiers.base import StoredPage  # noqa: E402
from replica.tiers.disk_tier import DiskTier  # noqa: E402
from replica.tiers.redis_tier import RedisTier  # noqa: E402

try:
    from replica.tiers.seal import TierKey  # noqa: E402
except ImportError:  # a checkout before sealed tiers
    TierKey = None

NUM_PAGES = 16
ROUNDS = 21


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    torch.set_num_threads(1)
    fmt = PageFormat(model_fingerprint="m", dtype="bfloat16", page_size=128, num_layers=8, num_kv_heads=4,
                     head_dim=64)
    tokens = list(range(NUM_PAGES * 128))
    keys = compute_page_keys(tokens, page_size=128, model_fingerprint="m")
    slices = [tokens[i * 128 : (i + 1) * 128] for i in range(NUM_PAGES)]
    pages = [StoredPage.from_format(fmt, key, s, torch.randn(fmt.kv_shape).to(torch.bfloat16))
             for key, s in zip(keys, slices)]
    pool = torch.zeros(8, 2, 2 * NUM_PAGES, 128, 4, 64, dtype=torch.bfloat16)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server_proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--save", "", "--appendonly",
                                    "no", "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru"],
                                   stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    folder = tempfile.mkdtemp(prefix="prefixserve-tier-load-")
    extra = {"tier_key": TierKey.generate()} if TierKey and "tier_key" in inspect.signature(DiskTier).parameters else {}
    tiers = {"disk": DiskTier(folder, fmt, 1 << 30, **extra),
             "host": RedisTier(f"redis://127.0.0.1:{port}/0", fmt, **extra)}
    try:
        for tier in tiers.values():
            tier.store(pages)
            tier.flush(30)

        def load(tier) -> None:
            num_present = tier.lookup(keys)
            loaded = tier.load(keys[:num_present], slices[:num_present])
            for index, kv in enumerate(loaded):
                pool[:, :, index].copy_(kv)
            assert len(loaded) == NUM_PAGES

        num_bytes = NUM_PAGES * fmt.page_num_bytes
        for name, tier in tiers.items():
            for _ in range(3):
                load(tier)
            wall, cpu, server = [], [], []
            for _ in range(ROUNDS):
                server_started = process_cpu_seconds(server_proc.pid)
                started, cpu_started = time.perf_counter(), time.thread_time()
                load(tier)
                wall.append(time.perf_counter() - started)
                cpu.append(time.thread_time() - cpu_started)
                server.append(process_cpu_seconds(server_proc.pid) - server_started)
            wall.sort()
            cpu.sort()
            server.sort()
            mid = ROUNDS // 2
            server_note = (f" | redis-server CPU mean {sum(server) / ROUNDS * 1e3:.1f} ms (clock ticks, summed "
                           "over the rounds)" if name == "host" else "")
            print(f"{name}: wall median {wall[mid] * 1e3:.1f} ms min {wall[0] * 1e3:.1f} ms "
                  f"({num_bytes / wall[mid] / 1e9:.2f} GB/s median, {num_bytes / wall[0] / 1e9:.2f} best) | "
                  f"thread CPU median {cpu[mid] * 1e3:.1f} ms min {cpu[0] * 1e3:.1f} ms "
                  f"({num_bytes / cpu[mid] / 1e9:.2f} GB/s per CPU-second){server_note}")
            if "--prof" in sys.argv:
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(5):
                    load(tier)
                profile.disable()
                pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    finally:
        for tier in tiers.values():
            tier.close()
        server_proc.terminate()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
