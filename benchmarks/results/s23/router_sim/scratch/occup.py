import sys, json, collections
sys.path.insert(0, __import__('os').path.dirname(__file__)); pass
from benchmarks.router_sim import sim as simmod
samples = []
orig = simmod.Simulation._sync
def _sync(self):
    orig(self)
    if int(self.now * 2) % 400 == 0:
        row = []
        for r in self.replicas:
            groups = {run.request.request_id.split('u')[0].split('g')[1] for run in r.running}
            row.append((len(r.running), len(r.waiting), len(groups), r.num_free, len(r.lru)))
        samples.append((self.now, row))
simmod.Simulation._sync = _sync
from analyze import run
router = sys.argv[1]; seed = int(sys.argv[2]); kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
sim, res, reqs = run(router, seed=seed, policy_kwargs=kw)
s4 = min(r.arrival_s for r in reqs if r.request_id.startswith('s4'))
print(router, seed, res.ttft_p99_s, 'stage4 at', round(s4))
for now, row in samples:
    if now > s4 + 1600:
        print(f" {now-s4:6.0f} " + " | ".join(f"run {a:2d} wait {b:2d} grp {c:2d} free {d:4d} lru {e:4d}" for a, b, c, d, e in row))
