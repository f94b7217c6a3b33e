"""Scratch: mean hit / p99 over seeds with a given eviction (the sim's own implementation)."""
import sys, json, time, argparse
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS
p = argparse.ArgumentParser()
p.add_argument('--seeds', default='0,1,2,3,4,5,6,7'); p.add_argument('--dp', type=int, default=4)
p.add_argument('--scale', type=float, default=1.0); p.add_argument('--workload', default='llmd-prefix')
p.add_argument('--router', default='prefixserve'); p.add_argument('--eviction', default='own')
p.add_argument('--pages', type=int, default=0); p.add_argument('--kw', default='{}'); p.add_argument('--frac', type=float, default=-1)
a = p.parse_args()
if a.frac >= 0:
    from replica.config import EngineConfig
    EngineConfig.kv_cache_protected_fraction = a.frac
cost = CostModel()
hits, p99s, bs = [], [], []
t0 = time.time()
for seed in [int(s) for s in a.seeds.split(',')]:
    wl = WORKLOADS[a.workload](a.dp, cost, seed=seed, scale=a.scale)
    if a.pages: wl.num_pages_per_replica = a.pages
    r = Simulation(wl, a.router, a.dp, cost, seed=seed, policy_kwargs={**cost.policy_kwargs(), **json.loads(a.kw)}, eviction=a.eviction).run()
    hits.append(r.hit_rate); p99s.append(r.ttft_p99_s); bs.append(r.busiest_over_mean)
n = len(hits)
print(f"{a.kw} {a.router} {a.eviction} frac={a.frac} {a.workload} dp{a.dp} pages={a.pages}: hit {sum(hits)/n:.4f} p99 {sum(p99s)/n:.2f} busiest {max(bs):.2f} | "
      + ' '.join(f"{h:.4f}/{q:.1f}" for h, q in zip(hits, p99s)) + f"  [{time.time()-t0:.0f}s]", flush=True)
