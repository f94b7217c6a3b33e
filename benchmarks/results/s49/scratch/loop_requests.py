"""Warm (2048 cached + 64 new) or floor (64 alone) requests in a loop, for a sampling profiler (perf record -e
cpu-clock) to compare where each spends its time. Waits for /tmp/go before the loop so start-up is not profiled
with --delay... (simpler: perf record -p PID after 'ready').
PYTHONPATH=. .venv/bin/python benchmarks/results/s49/scratch/loop_requests.py warm|floor SECONDS [--model-dir D]"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from engine_ttft import engine_config, tokens, ttft  # noqa: E402

from replica.engine import build_engine  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("kind")
parser.add_argument("seconds", type=float)
parser.add_argument("--model-dir", default=None)
parser.add_argument("--dtype", default="bfloat16")
args = parser.parse_args()
torch.set_num_threads(1)
engine = build_engine(engine_config(args.model_dir, args.dtype, 2))
prefix = tokens(2048, seed=10)
ttft(engine, tokens(300, seed=999), "warmup")
ttft(engine, prefix + tokens(64, seed=1), "cold")
for r in range(3):
    ttft(engine, prefix + tokens(64, seed=50 + r), f"w{r}")
    ttft(engine, tokens(64, seed=60 + r), f"f{r}")
print("ready", os.getpid(), flush=True)
time.sleep(2)
end = time.time() + args.seconds
n = 0
spent = 0.0
while time.time() < end:
    prompt = prefix + tokens(64, seed=2000 + n) if args.kind == "warm" else tokens(64, seed=3000 + n)
    spent += ttft(engine, prompt, f"{args.kind}-{n}")
    n += 1
print(args.kind, "requests", n, "mean ms", round(spent / n * 1e3, 2), flush=True)
