"""The prefill attention kernel alone as an engine step meets it: 64 new tokens after 2048 cached (8 q / 4 kv heads,
head 64), one call per layer over LAYERS layers' own pools in turn, so that each call's keys and values come from
memory, not from the caches the call before left them in (30 layers x 4 MiB in bfloat16: more than the L3).
PYTHONPATH=. .venv/bin/python benchmarks/results/s47/scratch/attention_kernel_layers.py DTYPE THREADS [LAYERS]"""
import sys, time, torch
from replica import cpu_kernels
cpu_kernels.available()
torch.manual_seed(0)
dtype = getattr(torch, sys.argv[1]); threads = int(sys.argv[2]); layers = int(sys.argv[3]) if len(sys.argv) > 3 else 30
torch.set_num_threads(threads)
T, C, H, KV, D = 64, 2048, int(sys.argv[4]) if len(sys.argv) > 4 else 8, int(sys.argv[5]) if len(sys.argv) > 5 else 4, 64
slots = 4096
ks = [torch.randn(slots, KV, D).to(dtype) for _ in range(layers)]
vs = [torch.randn(slots, KV, D).to(dtype) for _ in range(layers)]
q = torch.randn(T, H, D).to(dtype); out = torch.empty_like(q)
runs = torch.tensor([[128, C + T]], dtype=torch.int64)
def sweep():
    for k, v in zip(ks, vs):
        cpu_kernels.prefill_attention(q, k, v, runs, 0.125, out)
for _ in range(3): sweep()
n = 20; s = time.perf_counter()
for _ in range(n): sweep()
dt = (time.perf_counter() - s) / n / layers
flop = 4 * T * H * D * (C + T / 2)
print(f"{sys.argv[1]} threads {threads} layers {layers}: {dt*1e6:.0f} us/layer, {flop/dt/1e9:.0f} GFLOP/s")
