"""The prefill attention kernel alone: 64 new tokens after 2048 cached, 8 q heads / 4 kv heads, head 64, one layer."""
import sys, time, torch
from replica import cpu_kernels
cpu_kernels.available()
torch.manual_seed(0)
dtype = getattr(torch, sys.argv[1]); threads = int(sys.argv[2])
torch.set_num_threads(threads)
T, C, H, KV, D = 64, 2048, 8, 4, 64
slots = 4096
k = torch.randn(slots, KV, D).to(dtype); v = torch.randn(slots, KV, D).to(dtype)
q = torch.randn(T, H, D).to(dtype); out = torch.empty_like(q)
runs = torch.tensor([[128, C + T]], dtype=torch.int64)
f = lambda: cpu_kernels.prefill_attention(q, k, v, runs, 0.125, out)
for _ in range(20): f()
n = 200; s = time.perf_counter()
for _ in range(n): f()
dt = (time.perf_counter() - s) / n
flop = 4 * T * H * D * (C + T / 2)
print(f"{sys.argv[1]} threads {threads}: {dt*1e3:.3f} ms/layer, {flop/dt/1e9:.0f} GFLOP/s")
