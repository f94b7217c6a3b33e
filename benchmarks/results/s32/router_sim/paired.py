"""Session 32: ours against llm-d's scorers on tight multi-turn, seed by seed (run.sh's results): mean hit / p99 over
the seeds, the mean per-seed p99 difference with a bootstrap 95% interval, and how many seeds each router had the lower
p99. Usage: python benchmarks/results/s32/router_sim/paired.py [DIR] > DIR/paired.txt (DIR: this folder by default;
session 33's is benchmarks/results/s33/router_sim)."""
import json
import os
import random
import statistics
import sys

HERE = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows = []
for name in ("multiturn_tight", "multiturn_tight_dp4_more", "multiturn_tight_dp64_16"):
    rows += json.load(open(os.path.join(HERE, f"{name}.json")))
by_router: dict = {}
for row in rows:
    by_router.setdefault((row["dp"], row["router"]), {})[row["seed"]] = row
for dp in sorted({dp for dp, _ in by_router}):
    ours, theirs = by_router[(dp, "prefixserve")], by_router[(dp, "llmd-scorers")]
    seeds = sorted(set(ours) & set(theirs))
    diffs = [ours[s]["ttft_p99_s"] - theirs[s]["ttft_p99_s"] for s in seeds]
    rng = random.Random(0)
    means = sorted(statistics.mean(rng.choices(diffs, k=len(diffs))) for _ in range(10000))
    p99 = [statistics.mean(side[s]["ttft_p99_s"] for s in seeds) for side in (ours, theirs)]
    hit = [statistics.mean(side[s]["hit_rate"] for s in seeds) for side in (ours, theirs)]
    print(f"DP {dp}, {len(seeds)} seeds: ours {hit[0]:.4f} / {p99[0]:.2f} s, llm-d's scorers {hit[1]:.4f} / "
          f"{p99[1]:.2f} s (p99 {p99[0] / p99[1]:.3f}x); per-seed p99 difference {statistics.mean(diffs):+.2f} s, "
          f"95% [{means[250]:+.2f}, {means[9750]:+.2f}]; ours lower in {sum(d < 0 for d in diffs)} seeds, higher in "
          f"{sum(d > 0 for d in diffs)}")
