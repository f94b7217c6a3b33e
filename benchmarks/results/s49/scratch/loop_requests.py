"""Warm (2048 cached + 64 new) or floor (64 alone) requests in a loop, for a sampling profiler to compare where each
spends its time: prints "ready PID" once warmed up, then loops for SECONDS from 2 s later; attach after "ready" with
`perf record -e cpu-clock -F 2000 -g -p PID -o OUT -- sleep 15` (this guest has no hardware counters).
PYTHONPATH=. .venv/bin/python benchmarks/results/s49/scratch/loop_requests.py warm|floor SECONDS [--model-dir D]"""
import argparse
import os
import time

from warm_engine import tokens, ttft, warm_engine

parser = argparse.ArgumentParser()
parser.add_argument("kind")
parser.add_argument("seconds", type=float)
parser.add_argument("--model-dir", default=None)
parser.add_argument("--dtype", default="bfloat16")
args = parser.parse_args()
engine, prefix = warm_engine(args.model_dir, args.dtype, rounds=3)
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
