"""Session 34 scratch: one seed of the s28 tier point under the tier-blind and tier-priced routers; per replica:
requests, prompt pages local / copied / from the tier / computed, pages evicted; and the TTFT tail's requests.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s34/scratch/tier_diag.py llmd-prefix 16 3
"""
import statistics
import sys

from benchmarks.router_sim.costs import COST_MODELS
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS


def main():
    workload_name, dp, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cost = COST_MODELS["calibrated"]
    for router in ("prefixserve-measured", "prefixserve-tier"):
        workload = WORKLOADS[workload_name](dp, cost, seed=seed, scale=0.5)
        workload.num_pages_per_replica = max(1, round(workload.num_pages_per_replica * 0.35))
        sim = Simulation(workload, router, dp, cost, seed=seed, host_tier_pages=8192)
        result = sim.run()
        print(f"{router}: hit {result.hit_rate:.4f} p99 {result.ttft_p99_s:.1f} mean {result.ttft_mean_s:.1f} "
              f"pool {workload.num_pages_per_replica}")
        tot = [0] * 6
        for number, r in enumerate(sim.replicas):
            row = (r.num_routed, r.num_copied_pages, r.num_tier_pages, r.num_private, r.num_evicted,
                   round(r.busy_ms / 1000) if hasattr(r, "busy_ms") else 0)
            tot = [a + b for a, b in zip(tot, row)]
            print(f"  r{number:2d} routed {row[0]:4d} copied {row[1]:5d} tier {row[2]:5d} private {row[3]:6d} "
                  f"evicted {row[4]:6d}")
        print(f"  all routed {tot[0]} copied {tot[1]} tier {tot[2]} private {tot[3]} evicted {tot[4]}")


if __name__ == "__main__":
    main()
