"""Session 34 scratch: under the tier-priced router, how many requests found fewer pages at admission (own + copied +
tier) than the tier held for them when they were routed, and how long they had waited.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s34/scratch/tier_stale.py llmd-prefix 16 3
"""
import statistics
import sys

from benchmarks.router_sim import routers
from benchmarks.router_sim.costs import COST_MODELS
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS

_route = routers.Ours.route


def route(self, request, now):
    request.priced_host = self.policy.tier_runs(request.page_keys)[0]
    request.routed_at = now
    return _route(self, request, now)


def main():
    routers.Ours.route = route
    workload_name, dp, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    router = sys.argv[4] if len(sys.argv) > 4 else "prefixserve-tier"
    cost = COST_MODELS["calibrated"]
    workload = WORKLOADS[workload_name](dp, cost, seed=seed, scale=0.5)
    workload.num_pages_per_replica = max(1, round(workload.num_pages_per_replica * 0.35))
    sim = Simulation(workload, router, dp, cost, seed=seed, host_tier_pages=8192)
    requests = []
    _run_route = routers.Ours.route

    def keep(self, request, now):
        requests.append(request)
        return _run_route(self, request, now)

    routers.Ours.route = keep
    result = sim.run()
    ps = cost.page_size
    short, total, lost_pages = [], 0, 0
    for request in requests:
        priced = min(getattr(request, "priced_host", 0), request.prompt_len // ps)
        got = (getattr(request, "cached_local", 0) + getattr(request, "cached_peer", 0)
               + getattr(request, "cached_tier", 0)) // ps
        total += 1
        if got < priced:
            short.append(request)
            lost_pages += priced - got
    print(f"{router}: p99 {result.ttft_p99_s:.1f}; {len(short)} of {total} requests got fewer pages than the tier "
          f"held when routed ({lost_pages} pages)")


if __name__ == "__main__":
    main()
