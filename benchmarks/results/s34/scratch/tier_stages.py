"""Session 34 scratch: mean / p99 TTFT per arrival stage of llm-d's shared prefix, and how requests got their prompt
(local / peer / tier / computed tokens), for the tier-blind and tier-priced routers on one seed.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s34/scratch/tier_stages.py 16 3
"""
import statistics
import sys

from benchmarks.router_sim import routers
from benchmarks.router_sim.costs import COST_MODELS
from benchmarks.router_sim.sim import Simulation, percentile
from benchmarks.router_sim.workloads import WORKLOADS


def main():
    dp, seed = int(sys.argv[1]), int(sys.argv[2])
    names = sys.argv[3:] or ["prefixserve-measured", "prefixserve-tier"]
    cost = COST_MODELS["calibrated"]
    _route = routers.Ours.route
    for router in names:
        requests = []

        def keep(self, request, now):
            requests.append(request)
            return _route(self, request, now)

        routers.Ours.route = keep
        workload = WORKLOADS["llmd-prefix"](dp, cost, seed=seed, scale=0.5)
        workload.num_pages_per_replica = max(1, round(workload.num_pages_per_replica * 0.35))
        result = Simulation(workload, router, dp, cost, seed=seed, host_tier_pages=8192).run()
        print(f"{router}: p99 {result.ttft_p99_s:.1f} mean {result.ttft_mean_s:.1f}")
        for stage in range(5):
            rows = [r for r in requests if r.request_id.startswith(f"s{stage}")]
            ttft = [r.first_token_s - r.arrival_s for r in rows]
            sums = [sum(getattr(r, f) for r in rows) // 1000 for f in ("cached_local", "cached_peer", "cached_tier")]
            computed = sum(r.prompt_len for r in rows) // 1000 - sum(sums)
            print(f"  stage {stage}: {len(rows)} requests, TTFT mean {statistics.mean(ttft):6.1f} p99 "
                  f"{percentile(ttft, 0.99):6.1f}; k tokens local {sums[0]} peer {sums[1]} tier {sums[2]} "
                  f"computed {computed}")


if __name__ == "__main__":
    main()
