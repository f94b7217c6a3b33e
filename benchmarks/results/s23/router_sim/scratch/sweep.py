"""Scratch: ours over seeds with policy kwargs / a patch module; per-seed hit, p99, busiest vs baselines."""
import sys, json, importlib, time, argparse
sys.path.insert(0, __import__('os').path.dirname(__file__))
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS
p = argparse.ArgumentParser()
p.add_argument('--kw', default='{}'); p.add_argument('--patch', default='')
p.add_argument('--seeds', default='0,1,2,3,4,5,6,7'); p.add_argument('--dp', type=int, default=4)
p.add_argument('--scale', type=float, default=1.0); p.add_argument('--workload', default='llmd-prefix')
p.add_argument('--router', default='prefixserve')
a = p.parse_args()
if a.patch: importlib.import_module(a.patch)
cost = CostModel(); kw = json.loads(a.kw)
hits, p99s, bs = [], [], []
t0 = time.time()
for seed in [int(s) for s in a.seeds.split(',')]:
    wl = WORKLOADS[a.workload](a.dp, cost, seed=seed, scale=a.scale)
    pk = {**cost.policy_kwargs(), **kw}
    r = Simulation(wl, a.router, a.dp, cost, seed=seed, policy_kwargs=pk).run()
    hits.append(r.hit_rate); p99s.append(r.ttft_p99_s); bs.append(r.busiest_over_mean)
n = len(hits)
print(f"{a.patch or '-'} {a.kw} {a.workload} dp{a.dp}: hit {sum(hits)/n:.4f} p99 {sum(p99s)/n:.2f} busiest {max(bs):.2f} | "
      + ' '.join(f"{h:.4f}/{q:.1f}" for h, q in zip(hits, p99s)) + f"  [{time.time()-t0:.0f}s]", flush=True)
