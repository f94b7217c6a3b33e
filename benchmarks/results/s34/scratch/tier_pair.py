"""Session 34 scratch: the measured-cost router tier-blind (as deployed with peer copy on) against a tier-priced
variant (``--kw``: extra PolicyConfig fields for the tier-priced side, or an env hook below), paired by seed, on the
s28 tier points (scale 0.5, pools x0.35, a shared host tier of 8192 pages, calibrated costs). Prints mean hit / p99
for both, the mean per-seed p99 difference with a bootstrap 95% interval and how many seeds the variant lost.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s34/scratch/tier_pair.py --workload llmd-prefix --dp 4 \\
        --seeds 0-7 --kw '{}'
"""
import argparse
import json
import random
import statistics
import time
from multiprocessing import Pool

from benchmarks.router_sim import routers
from benchmarks.router_sim.costs import COST_MODELS
from benchmarks.router_sim.sim import simulate

_KW: dict = {}
_BASE_KW: dict = {}


class _Variant(routers.Ours):
    def __init__(self, view, seed=0, **config):
        extra = _KW if config.get("enable_tier_routing") else _BASE_KW
        extra = dict(extra)
        factor = extra.pop("_host_factor", None)
        super().__init__(view, seed, **{**config, **extra})
        if factor is not None:  # experiment: every candidate prices a tier page ``factor`` x its own cost
            original = self.policy.comparable_costs
            self.policy.comparable_costs = lambda loads: [c._replace(host_fetch_ms=c.host_fetch_ms * factor,
                                                                     disk_fetch_ms=c.disk_fetch_ms * factor)
                                                          for c in original(loads)]


def run(args):
    router, workload, dp, seed, kw, base_kw, copy = args
    _KW.clear()
    _KW.update(kw)
    _BASE_KW.clear()
    _BASE_KW.update(base_kw)
    routers.Ours = _Variant
    name = router if copy else router + "-nocopy"
    result = simulate(workload, name, dp, seed=seed, scale=0.5, cost=COST_MODELS["calibrated"],
                      host_tier_pages=8192, pool_fraction=0.35)
    return router, seed, result.hit_rate, result.ttft_p99_s, result.busiest_over_mean


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="llmd-prefix")
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--kw", default="{}")
    parser.add_argument("--base-kw", default="{}")
    parser.add_argument("--nocopy", action="store_true")
    parser.add_argument("--procs", type=int, default=2)
    args = parser.parse_args()
    first, _, last = args.seeds.partition("-")
    seeds = list(range(int(first), int(last or first) + 1))
    kw, base_kw = json.loads(args.kw), json.loads(args.base_kw)
    jobs = [(r, args.workload, args.dp, s, kw, base_kw, not args.nocopy)
            for s in seeds for r in ("prefixserve-measured", "prefixserve-tier")]
    start = time.time()
    with Pool(args.procs) as pool:
        out = pool.map(run, jobs)
    by = {(r, s): (h, p, b) for r, s, h, p, b in out}
    diffs = [by["prefixserve-tier", s][1] - by["prefixserve-measured", s][1] for s in seeds]
    rng = random.Random(0)
    boots = sorted(statistics.mean(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
    for r in ("prefixserve-measured", "prefixserve-tier"):
        rows = [by[r, s] for s in seeds]
        print(f"{r:22s} hit {statistics.mean(x[0] for x in rows):.4f} p99 {statistics.mean(x[1] for x in rows):7.2f} "
              f"busiest/mean {statistics.mean(x[2] for x in rows):.2f}")
    print(f"tier - blind p99: {statistics.mean(diffs):+.2f} s [{boots[50]:+.2f}, {boots[1949]:+.2f}], "
          f"tier higher in {sum(d > 0 for d in diffs)}/{len(diffs)}; kw {kw} base {base_kw}; "
          f"{args.workload} dp {args.dp} {'nocopy' if args.nocopy else 'copy'}; {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
