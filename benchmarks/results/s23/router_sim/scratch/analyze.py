"""Scratch: per-stage breakdown of llmd-prefix runs."""
import sys, json, math, collections
pass
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation, percentile
from benchmarks.router_sim.workloads import WORKLOADS

def run(router, dp=4, seed=0, scale=1.0, policy_kwargs=None, workload='llmd-prefix'):
    cost = CostModel()
    wl = WORKLOADS[workload](dp, cost, seed=seed, scale=scale)
    pk = None
    if policy_kwargs is not None:
        pk = {**cost.policy_kwargs(), **policy_kwargs}
    sim = Simulation(wl, router, dp, cost, seed=seed, policy_kwargs=pk)
    res = sim.run()
    reqs = wl.all_requests()
    return sim, res, reqs

def stages(reqs, cost=CostModel()):
    by = collections.defaultdict(list)
    for r in reqs:
        by[int(r.request_id.split('g')[0][1:])].append(r)
    out = []
    for s, rs in sorted(by.items()):
        t = [r.first_token_s - r.arrival_s for r in rs]
        hit = sum(r.cached_local + r.cached_peer for r in rs) / sum(r.prompt_len for r in rs)
        peer = sum(r.cached_peer for r in rs) / sum(r.prompt_len for r in rs)
        routed = collections.Counter(r.replica for r in rs)
        groups = collections.defaultdict(set)
        for r in rs:
            groups[r.request_id.split('u')[0].split('g')[1]].add(r.replica)
        multi = sum(1 for g in groups.values() if len(g) > 1)
        reasons = collections.Counter(r.reason for r in rs)
        out.append(f"stage {s}: hit {hit:.4f} (peer {peer:.4f}) p50 {percentile(t,50):7.2f} p99 {percentile(t,99):7.2f} max {max(t):7.2f} routed {sorted(routed.values())} multi-groups {multi} {dict(reasons)}")
    return out

if __name__ == '__main__':
    router = sys.argv[1]; seed = int(sys.argv[2]); kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    sim, res, reqs = run(router, seed=seed, policy_kwargs=kw)
    print(router, seed, f"hit {res.hit_rate:.4f} p99 {res.ttft_p99_s:.2f} busiest {res.busiest_over_mean:.3f}")
    for line in stages(reqs): print(' ', line)
    print('  evicted', [r.num_evicted for r in sim.replicas], 'copied', [r.num_copied_pages for r in sim.replicas])
