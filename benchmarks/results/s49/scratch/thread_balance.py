"""Inside an engine's warm requests (2048 cached + 64 new), per prefill attention call: wall time, when the second
thread starts its share, each thread's busy time, the gap between the threads' finishes. An instrumented copy of
replica/csrc/prefill_attention.cpp (INSTR.cpp: records these in the op itself; variants/instr.patch applied to
1cd3c7c's file) is swapped in for the engine's kernel.
PYTHONPATH=. .venv/bin/python benchmarks/results/s49/scratch/thread_balance.py INSTR.cpp [--model-dir D] [--dtype D]"""
import argparse
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from warm_engine import tokens, ttft, warm_engine

from replica import cpu_kernels

parser = argparse.ArgumentParser()
parser.add_argument("source")
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--model-dir", default=None)
parser.add_argument("--rounds", type=int, default=10)
args = parser.parse_args()
cpu_kernels.load()
source = Path(args.source).read_text()
for macro in ("TORCH_LIBRARY_FRAGMENT(", "TORCH_LIBRARY_IMPL("):
    source = source.replace(macro + "prefixserve_cpu,", macro + "prefixserve_instr,")
build = Path(tempfile.mkdtemp()) / "prefixserve_instr.cpp"
build.write_text(source)
load(name=f"prefixserve_instr_{abs(hash(source)) % 10**8}", sources=[str(build)], extra_cflags=cpu_kernels.CFLAGS,
     extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
op = torch.ops.prefixserve_instr.prefill_attention_f32


def swapped(query, k_cache, v_cache, runs, scale, out, bf16_dot=True):
    op(query, k_cache, v_cache, runs, scale, out, bf16_dot)


override = torch.library.Library("prefixserve_cpu", "IMPL")
override.impl("prefill_attention_f32", swapped, "CPU")
engine, prefix = warm_engine(args.model_dir, args.dtype)
for kind in ("warm", "floor", "warm"):
    torch.ops.prefixserve_instr.stats()
    for r in range(args.rounds):
        ttft(engine, (prefix if kind == "warm" else []) + tokens(64, seed=2000 + r), f"{kind}-{r}")
    s = torch.ops.prefixserve_instr.stats()
    n = s[0]
    print(f"{kind}: {int(n)} calls; per call us: wall {s[1] / n * 1e6:.0f}, second thread starts at "
          f"{s[2] / n * 1e6:.0f}, busy t0 {s[4] / n * 1e6:.0f} t1 {s[5] / n * 1e6:.0f}, "
          f"finish gap {s[3] / n * 1e6:.0f}, "
          f"after last finish {s[6] / n * 1e6:.0f}")
