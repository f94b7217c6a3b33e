"""Session 33 scratch: ours (with policy fields from ``--kw``) against llm-d's scorers on the simulator's tight
multi-turn (128 pages a replica), paired by seed: mean hit / p99, the mean per-seed p99 difference with a bootstrap
95% interval, and in how many seeds ours had the higher p99. llm-d's results are cached in ``--cache``. ``PERSEED=1``
also lists the seeds from ours best to ours worst. The quick loop behind BENCHMARKS.md 0y:

    PYTHONPATH=. .venv/bin/python benchmarks/results/s33/scratch/pair.py --dp 4 --seeds 0-63 \\
        --kw '{"session_idle_factor": 0}'
"""
import argparse
import json
import os
import random
import statistics
import time
from multiprocessing import Pool

from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS


def run(args):
    router, dp, seed, kw, workload_name, pages = args
    cost = CostModel()
    workload = WORKLOADS[workload_name](dp, cost, seed=seed)
    if pages:
        workload.num_pages_per_replica = pages
    result = Simulation(workload, router, dp, cost, seed=seed, policy_kwargs={**cost.policy_kwargs(), **kw}).run()
    return router, seed, result.hit_rate, result.ttft_p99_s, result.busiest_over_mean


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--seeds", default="0-63")
    parser.add_argument("--kw", default="{}")
    parser.add_argument("--workload", default="multi-turn")
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--cache", default="/tmp/llmd_cache.json")
    args = parser.parse_args()
    low, high = map(int, args.seeds.split("-"))
    seeds = list(range(low, high + 1))
    try:
        cache = json.load(open(args.cache))
    except (OSError, ValueError):
        cache = {}
    cache_key = lambda seed: f"{args.workload}/{args.dp}/{args.pages}/{seed}"  # noqa: E731
    jobs = [("prefixserve", args.dp, seed, json.loads(args.kw), args.workload, args.pages) for seed in seeds]
    jobs += [("llmd-scorers", args.dp, seed, {}, args.workload, args.pages) for seed in seeds
             if cache_key(seed) not in cache]
    started = time.time()
    with Pool(2) as pool:
        results = pool.map(run, jobs)
    ours = {}
    for router, seed, hit, p99, busiest in results:
        if router == "prefixserve":
            ours[seed] = (hit, p99, busiest)
        else:
            cache[cache_key(seed)] = (hit, p99, busiest)
    json.dump(cache, open(args.cache, "w"))
    theirs = {seed: cache[cache_key(seed)] for seed in seeds}
    diffs = [ours[seed][1] - theirs[seed][1] for seed in seeds]
    rng = random.Random(0)
    means = sorted(statistics.mean(rng.choices(diffs, k=len(diffs))) for _ in range(4000))
    p99_ours = statistics.mean(ours[seed][1] for seed in seeds)
    p99_theirs = statistics.mean(theirs[seed][1] for seed in seeds)
    print(f"{args.kw} dp{args.dp} {args.workload} seeds {args.seeds}: ours hit "
          f"{statistics.mean(ours[seed][0] for seed in seeds):.4f} p99 {p99_ours:.2f} busiest "
          f"{max(ours[seed][2] for seed in seeds):.2f} | llmd {statistics.mean(theirs[seed][0] for seed in seeds):.4f} "
          f"{p99_theirs:.2f} | ratio {p99_ours / p99_theirs:.3f} diff {statistics.mean(diffs):+.2f} "
          f"[{means[100]:+.2f},{means[3900]:+.2f}] worse in {sum(d > 0 for d in diffs)} [{time.time() - started:.0f}s]",
          flush=True)
    if os.environ.get("PERSEED"):
        for seed in sorted(seeds, key=lambda seed: ours[seed][1] - theirs[seed][1]):
            print(seed, f"ours {ours[seed][0]:.4f}/{ours[seed][1]:.2f} llmd {theirs[seed][0]:.4f}/"
                        f"{theirs[seed][1]:.2f} d {ours[seed][1] - theirs[seed][1]:+.2f}")


if __name__ == "__main__":
    main()
