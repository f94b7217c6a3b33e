"""Where a warm request (2048 cached + 64 new) spends the time its floor (64 alone) does not: torch.profiler over
N warm and N floor requests in turn, self CPU time per op name, per request.
PYTHONPATH=. .venv/bin/python benchmarks/results/s49/scratch/warm_vs_floor_profile.py --dtype D [--model-dir DIR]"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from warm_engine import tokens, ttft, warm_engine

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--model-dir", default=None)
parser.add_argument("--rounds", type=int, default=6)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
engine, prefix = warm_engine(args.model_dir, args.dtype, args.threads, rounds=2)
totals = {}
wall = collections.defaultdict(list)
for kind in ("warm", "floor"):
    agg = collections.Counter()
    counts = collections.Counter()
    for r in range(args.rounds):
        prompt = prefix + tokens(64, seed=2000 + r) if kind == "warm" else tokens(64, seed=3000 + r)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall[kind].append(ttft(engine, prompt, f"{kind}-{r}"))
        for e in prof.key_averages():
            agg[e.key] += e.self_cpu_time_total / args.rounds
            counts[e.key] += e.count / args.rounds
    totals[kind] = (agg, counts)
import statistics
for kind in ("warm", "floor"):
    print(kind, "median wall (profiled) ms", round(statistics.median(wall[kind]) * 1e3, 2),
          "sum self us", round(sum(totals[kind][0].values())))
keys = set(totals["warm"][0]) | set(totals["floor"][0])
rows = sorted(keys, key=lambda k: -(totals["warm"][0][k] - totals["floor"][0][k]))
print(f"{'op':60s} {'warm us':>10s} {'floor us':>10s} {'diff':>9s} {'n warm':>7s} {'n floor':>7s}")
for k in rows[:25] + rows[-8:]:
    w, f = totals["warm"][0][k], totals["floor"][0][k]
    print(f"{k[:60]:60s} {w:10.0f} {f:10.0f} {w - f:9.0f} {totals['warm'][1][k]:7.0f} {totals['floor'][1][k]:7.0f}")
