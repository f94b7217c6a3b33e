# PYTHONPATH=.:tests .venv/bin/python benchmarks/results/s39/scratch/attend_micro.py: one decode-only layer call, three ways (session 39 probe)
import sys, time, torch

from test_paged_attention import build_step, CASES
from replica import paged_attention as pa, cpu_kernels
from replica.attention_op import forward_context
import replica.attention_op
meta, q, k, v = build_step(CASES["decodes sharing a prefix"][:1], num_kv_heads=4, dtype=torch.bfloat16, padding=1, head_dim=64)
q = torch.randn(2, 8, 64).bfloat16()
plan = pa.segment_plan(meta, None, decode_kernel=True).decode_kernel
def t(name, f, n=20000):
    for _ in range(500): f()
    s = time.perf_counter()
    for _ in range(n): f()
    print(f"{name}: {(time.perf_counter()-s)/n*1e6:.2f} us")
with torch.inference_mode(), forward_context(meta):
    t("decode_layer direct", lambda: cpu_kernels.decode_layer(q, k, v, meta.kv_cache, 0, meta.slot_mapping, 1, plan, 0.125))
    t("attend", lambda: pa.attend(meta, 0, q, k, v, None, None))
    t("op", lambda: torch.ops.prefixserve.paged_attention(q, k, v, 0, 0.125, 0))
