import sys, json, collections, statistics
sys.path.insert(0, __import__('os').path.dirname(__file__)); pass
from benchmarks.router_sim import sim as simmod
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.workloads import WORKLOADS
router = sys.argv[1]; seed = int(sys.argv[2]); kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
cost = CostModel()
wl = WORKLOADS['llmd-prefix'](4, cost, seed=seed)
reqs = wl.all_requests()
gkey = {}
for r in reqs:
    g = r.request_id.split('u')[0].split('g')[1]
    gkey[g] = r.page_keys[45]
samples = []
orig = simmod.Simulation._sync
def _sync(self):
    orig(self)
    if int(self.now * 2) % 100 == 0:
        per = [sum(1 for k in gkey.values() if k in rep.key_to_refs) for rep in self.replicas]
        copies = collections.Counter(sum(1 for rep in self.replicas if k in rep.key_to_refs) for k in gkey.values())
        samples.append((self.now, per, copies))
simmod.Simulation._sync = _sync
pk = None if kw is None else {**cost.policy_kwargs(), **kw}
sim = simmod.Simulation(wl, router, 4, cost, seed=seed, policy_kwargs=pk)
res = sim.run()
stage_starts = sorted({min(r.arrival_s for r in reqs if r.request_id.startswith(f's{s}')) for s in range(5)})
print(router, seed, f"hit {res.hit_rate:.4f} p99 {res.ttft_p99_s:.1f}")
for i, st in enumerate(stage_starts):
    end = stage_starts[i+1] if i + 1 < len(stage_starts) else 1e18
    ss = [x for x in samples if st <= x[0] < end]
    held = statistics.mean(sum(p) for _, p, _ in ss)
    distinct = statistics.mean(150 - c.get(0, 0) for _, _, c in ss)
    dup = statistics.mean(sum(v for n, v in c.items() if n >= 2) for _, _, c in ss)
    spread = statistics.mean(max(p) - min(p) for _, p, _ in ss)
    print(f"  stage {i}: prefix copies held {held:6.1f} distinct groups {distinct:6.1f} duplicated groups {dup:5.1f} max-min groups/replica {spread:4.1f}")
