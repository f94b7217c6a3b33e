import cProfile, pstats, sys, time, tempfile, os, subprocess, shutil, socket
import torch
sys.path.insert(0, os.getcwd())
from common.page_format import PageFormat
from common.page_keys import compute_page_keys
from replica.tiers.base import StoredPage
from replica.tiers.disk_tier import DiskTier
from replica.tiers.redis_tier import RedisTier
try:
    from replica.tiers.seal import TierKey
    key = None
except ImportError:
    TierKey = None
torch.set_num_threads(1)
fmt = PageFormat(model_fingerprint="m", dtype="bfloat16", page_size=128, num_layers=8, num_kv_heads=4, head_dim=64)
toks = list(range(16 * 128))
keys = compute_page_keys(toks, page_size=128, model_fingerprint="m")
slices = [toks[i*128:(i+1)*128] for i in range(16)]
pages = [StoredPage.from_format(fmt, k, s, torch.randn(fmt.kv_shape).to(torch.bfloat16)) for k, s in zip(keys, slices)]
pool = torch.zeros(8, 2, 32, 128, 4, 64, dtype=torch.bfloat16)
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
rp = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
time.sleep(0.5)
d = tempfile.mkdtemp()
key = TierKey.generate() if TierKey else None
import inspect
kw = {"tier_key": key} if "tier_key" in inspect.signature(DiskTier).parameters else {}
tiers = {"disk": DiskTier(d, fmt, 1 << 30, **kw), "host": RedisTier(f"redis://127.0.0.1:{port}/0", fmt, **kw)}
for t in tiers.values():
    t.store(pages); t.flush(30)
def run(t):
    n = t.lookup(keys)
    out = t.load(keys[:n], slices[:n])
    for i, kv in enumerate(out):
        pool[:, :, i].copy_(kv)
    assert len(out) == 16
for name, t in tiers.items():
    for _ in range(3): run(t)
    times = []; cpu = []
    for _ in range(21):
        s = time.perf_counter(); c = time.process_time(); run(t); times.append(time.perf_counter() - s); cpu.append(time.process_time() - c)
    times.sort(); cpu.sort()
    nb = 16 * fmt.page_num_bytes
    print(f"{name}: wall median {times[10]*1000:.1f} ms min {times[0]*1000:.1f} ms ({nb/times[10]/1e9:.2f} GB/s median, {nb/times[0]/1e9:.2f} best) | CPU median {cpu[10]*1000:.1f} ms ({nb/cpu[10]/1e9:.2f} GB/s per CPU-second)")
    if "--prof" in sys.argv:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(5): run(t)
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
for t in tiers.values(): t.close()
rp.terminate(); shutil.rmtree(d)
