"""Whether two builds of replica/csrc/prefill_attention.cpp give the same bits (bfloat16 pair-dot path and float32)
over many shapes: heads / kv heads / head dims, chunk lengths (masked blocks, odd counts), contexts in several runs.
PYTHONPATH=. .venv/bin/python benchmarks/results/s49/scratch/same_bits.py OTHER.cpp [threads]"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from prefill_kernel import build_version  # noqa: E402

from replica import cpu_kernels  # noqa: E402

cpu_kernels.load()
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
other = build_version("other", Path(sys.argv[1]), torch.float32)
gen = torch.Generator().manual_seed(1)
checked = 0
for dtype in (torch.bfloat16, torch.float32):
    for heads, kv_heads, dim in ((8, 4, 64), (9, 3, 64), (4, 4, 32), (16, 2, 128), (6, 2, 80)):
        for context, tokens in ((0, 1), (0, 37), (130, 5), (2048, 64), (300, 200), (1000, 17), (63, 66)):
            slots = 8192
            k = (torch.randn(slots, kv_heads, dim, generator=gen) * 2).to(dtype)
            v = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
            q = (torch.randn(tokens, heads, dim, generator=gen) * 2).to(dtype)
            total = context + tokens
            cuts = sorted(torch.randperm(total, generator=gen)[:3].tolist()) if total > 8 else []
            bounds = [0] + [c for c in cuts if 0 < c < total] + [total]
            starts = torch.randperm((slots - 2400) // 512, generator=gen)[:len(bounds) - 1].tolist()
            runs = torch.tensor([[s * 512, b - a] for s, a, b in zip(starts, bounds, bounds[1:]) if b > a])
            outs = []
            for ops in (torch.ops.prefixserve_cpu, other):
                out = torch.empty_like(q)
                ops.prefill_attention_f32(q, k, v, runs, dim ** -0.5, out)
                outs.append(out)
            if not torch.equal(outs[0], outs[1]):
                diff = (outs[0].float() - outs[1].float()).abs().max().item()
                raise SystemExit(f"differ: {dtype} heads {heads}/{kv_heads} dim {dim} context {context} tokens "
                                 f"{tokens}: max abs {diff}")
            checked += 1
print(f"same bits in all {checked} cases")
