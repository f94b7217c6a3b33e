# PYTHONPATH=. .venv/bin/python benchmarks/results/s38/scratch/redis_fresh_keys.py  (session 38 probe)
import statistics, time, torch, sys
from benchmarks.kv_sources import private_redis
from common.page_format import PageFormat
from common.page_keys import compute_page_keys
from replica.tiers.base import StoredPage
from replica.tiers.redis_tier import RedisTier
from replica.tiers.seal import TierKey
dtype = torch.bfloat16
fmt = PageFormat(num_layers=8, page_size=128, num_kv_heads=4, head_dim=64, dtype="bfloat16", model_fingerprint="x")
server = private_redis("1gb"); time.sleep(0.5)
tier = RedisTier(f"redis://127.0.0.1:{server.port}/0", fmt, tier_key=TierKey.generate(), key_prefix="p:", socket_timeout_s=10.0)
pool = torch.zeros(8, 2, 64, 128, 4, 64, dtype=dtype); views = [pool[:, :, 3 * n + 1] for n in range(16)]
def make(r):
    ids = [(n * 7 + r * 13) % 8000 for n in range(16 * 128)]
    keys = compute_page_keys(ids, page_size=128, model_fingerprint="x")
    return [StoredPage.from_format(fmt, k, ids[n*128:(n+1)*128], torch.randn(fmt.kv_shape).to(dtype)) for n, k in enumerate(keys)]
first, again, idle = [], [], []
for r in range(12):
    pages = make(r); keys = [p.key for p in pages]; toks = [p.token_ids for p in pages]
    tier.store(pages); assert tier.flush(timeout=30)
    for sink in (first, again):
        t = time.perf_counter(); assert len(tier.load(keys, toks, views)) == 16; sink.append(time.perf_counter() - t)
    time.sleep(0.05)
    t = time.perf_counter(); assert len(tier.load(keys, toks, views)) == 16; idle.append(time.perf_counter() - t)
for name, v in (("first load after store", first), ("second load", again), ("after 50 ms idle", idle)):
    print(name, f"median {statistics.median(v)*1000:.1f} ms", " ".join(f"{x*1000:.1f}" for x in v))
tier.close(); server.close()
