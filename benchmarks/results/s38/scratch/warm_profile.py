"""Warm TTFT (2048 cached + 64 new) and its floor (64 alone), many times in a row, then one of each under torch's
profiler: where a warm request's time goes. PYTHONPATH=. .venv/bin/python benchmarks/results/s38/scratch/warm_profile.py
--dtype float32 [--rounds 15] [--model-dir DIR] (session 46 added --model-dir; the tiny Llama without it)"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from engine_ttft import engine_config, tokens, ttft  # noqa: E402

from replica.engine import build_engine  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="float32")
parser.add_argument("--rounds", type=int, default=15)
parser.add_argument("--prefill-threads", type=int, default=2)
parser.add_argument("--model-dir", default=None)
args = parser.parse_args()
torch.set_num_threads(1)
engine = build_engine(engine_config(args.model_dir, args.dtype, args.prefill_threads))
prefix = tokens(2048, seed=10)
ttft(engine, tokens(300, seed=999), "warmup")
ttft(engine, prefix + tokens(64, seed=1), "cold")
warm, floor = [], []
for r in range(args.rounds):
    warm.append(ttft(engine, prefix + tokens(64, seed=2000 + r), f"warm-{r}"))
    floor.append(ttft(engine, tokens(64, seed=3000 + r), f"floor-{r}"))
ms = lambda values: " ".join(f"{v * 1000:.1f}" for v in values)
print(f"{args.dtype} warm ms: {ms(warm)}\nfloor ms: {ms(floor)}")
print(f"median warm {statistics.median(warm) * 1000:.1f} floor {statistics.median(floor) * 1000:.1f} "
      f"ratio {statistics.median(warm) / statistics.median(floor):.2f}x; min ratio {min(warm) / min(floor):.2f}x")
for name, prompt in (("warm", prefix + tokens(64, seed=9999)), ("floor", tokens(64, seed=9998))):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ttft(engine, prompt, f"profiled-{name}")
    print(f"--- {name}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
