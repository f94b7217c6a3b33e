"""Probe (session 47): the prefill kernel built for AVX2 only (-march=haswell, its ops renamed) against float64 attention on
five shapes, float32 and bfloat16, 1 and 2 threads: the AVX2 path of Ahead and the kernels, checked on an AVX-512 box.
PYTHONPATH=. .venv/bin/python benchmarks/results/s47/scratch/avx2_build_check.py"""
import sys, tempfile, torch
from pathlib import Path
from torch.utils.cpp_extension import load
from replica import cpu_kernels
cpu_kernels.load()
src = Path("replica/csrc/prefill_attention.cpp").read_text()
for m in ("TORCH_LIBRARY_FRAGMENT(", "TORCH_LIBRARY_IMPL("):
    src = src.replace(m + "prefixserve_cpu,", m + "prefixserve_h,")
d = Path(tempfile.mkdtemp()); (d / "h.cpp").write_text(src)
flags = ["-march=haswell" if f == "-march=native" else f for f in cpu_kernels.CFLAGS]
load(name="prefixserve_h_check", sources=[str(d / "h.cpp")], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)
torch.manual_seed(0)
worst = 0.0
for T, C, H, KV, D in [(64, 2048, 8, 4, 64), (37, 300, 4, 2, 80), (130, 700, 6, 2, 128), (5, 70, 9, 3, 34), (1, 1, 2, 1, 16)]:
    slots = C + T + 256
    for dtype in (torch.float32, torch.bfloat16):
        k = (torch.randn(slots, KV, D) * 2).to(dtype); v = torch.randn(slots, KV, D).to(dtype); q = torch.randn(T, H, D).to(dtype)
        runs = torch.tensor([[200, C - min(C, 100)], [50, min(C, 100)], [C + 150, T]], dtype=torch.int64) if C >= 100 else torch.tensor([[50, C], [C + 150, T]], dtype=torch.int64)
        order = torch.cat([torch.arange(s, s + n) for s, n in runs.tolist()])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty_like(q)
            torch.ops.prefixserve_h.prefill_attention_f32(q, k, v, runs, D ** -0.5, out, True)
            kk = k[order].double().repeat_interleave(H // KV, 1).transpose(0, 1); vv = v[order].double().repeat_interleave(H // KV, 1).transpose(0, 1)
            L = len(order); ctx = L - T
            s = q.double().transpose(0, 1) @ kk.transpose(1, 2) * D ** -0.5
            vis = torch.arange(L)[None, :] <= ctx + torch.arange(T)[:, None]
            ref = (torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ vv).transpose(0, 1)
            err = (out.double() - ref).abs().max().item()
            worst = max(worst, err / (1 if dtype == torch.float32 else 1))
            print(T, C, H, KV, D, dtype, threads, f"{err:.2e}")
print("worst", worst)
