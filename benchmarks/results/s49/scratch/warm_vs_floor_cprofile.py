"""Python-level time of warm requests (2048 cached + 64 new) against floor ones (64 alone), by function (cProfile),
per request: what a warm request does in Python that its floor does not.
PYTHONPATH=. .venv/bin/python benchmarks/results/s49/scratch/warm_vs_floor_cprofile.py [--model-dir D]"""
import argparse
import cProfile
import pstats

from warm_engine import tokens, ttft, warm_engine

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--model-dir", default=None)
parser.add_argument("--rounds", type=int, default=10)
args = parser.parse_args()
engine, prefix = warm_engine(args.model_dir, args.dtype)
stats = {}
for kind in ("warm", "floor"):
    prof = cProfile.Profile()
    for r in range(args.rounds):
        prompt = (prefix if kind == "warm" else []) + tokens(64, seed=2000 + r)
        prof.enable()
        ttft(engine, prompt, f"{kind}-{r}")
        prof.disable()
    stats[kind] = {f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}": (v[2] / args.rounds, v[3] / args.rounds, v[1] / args.rounds)
                   for k, v in pstats.Stats(prof).stats.items()}
keys = set(stats["warm"]) | set(stats["floor"])
zero = (0.0, 0.0, 0)
print("per request, ms: tottime warm / floor / diff, cumtime warm / floor, calls warm / floor")
for k in sorted(keys, key=lambda k: -(stats["warm"].get(k, zero)[0] - stats["floor"].get(k, zero)[0]))[:25]:
    w, f = stats["warm"].get(k, zero), stats["floor"].get(k, zero)
    print(f"{k[:70]:70s} {w[0] * 1e3:8.2f} {f[0] * 1e3:8.2f} {(w[0] - f[0]) * 1e3:8.2f}   "
          f"{w[1] * 1e3:8.2f} {f[1] * 1e3:8.2f}"
          f"   {w[2]:6.0f} {f[2]:6.0f}")
