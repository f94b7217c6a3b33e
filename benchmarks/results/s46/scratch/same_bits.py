"""Probe (session 46): the prefill kernel's outputs on 4 shapes x 1 and 2 threads, saved to a file, to compare two builds
bit for bit: check out one build of replica/csrc/prefill_attention.cpp, run this with OUT_A, the other with OUT_B, then
torch.equal each pair (both files are lists of tensors). PYTHONPATH=. .venv/bin/python same_bits.py OUT"""
import sys, torch
from replica import cpu_kernels
cpu_kernels.available()
torch.manual_seed(0)
outs = []
for T, C, H, KV, D in [(64, 2048, 8, 4, 64), (64, 2048, 9, 3, 64), (37, 300, 4, 2, 80), (130, 700, 6, 2, 128)]:
    slots = C + T + 256
    k = torch.randn(slots, KV, D) * 2; v = torch.randn(slots, KV, D)
    q = torch.randn(T, H, D); out = torch.empty_like(q)
    runs = torch.tensor([[200, C - 100], [50, 100], [C + 150, T]], dtype=torch.int64)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        cpu_kernels.prefill_attention(q, k, v, runs, D ** -0.5, out)
        outs.append(out.clone())
torch.save(outs, sys.argv[1])
