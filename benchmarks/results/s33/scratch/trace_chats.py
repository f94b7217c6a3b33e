"""Session 33 scratch: the policy's session books at each turn of some chats of the simulator's tight multi-turn (128
pages a replica): the chat's home, the replica chosen and why, the leading pages each replica holds, each replica's
session pages / sessions (demand(r) / sessions(r)) and requests in flight; the diagnosis of BENCHMARKS.md 0y. ``KW``
(JSON) replaces our policy's fields.

    KW='{"session_idle_factor": 0}' PYTHONPATH=. .venv/bin/python benchmarks/results/s33/scratch/trace_chats.py \
        4 5 c6,c14
"""
import sys, json, os
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS
from benchmarks.router_sim import routers
dp, seed = int(sys.argv[1]), int(sys.argv[2]); watch = set(sys.argv[3].split(","))
cost = CostModel()
wl = WORKLOADS["multi-turn"](dp, cost, seed=seed); wl.num_pages_per_replica = 128
kw = {**cost.policy_kwargs(), **json.loads(os.environ.get("KW", "{}"))}
orig = routers.Ours.route
def route(self, request, now):
    chat = request.request_id.split("t")[0]
    p = self.policy
    sess = p._session_of(request.page_keys, self.partial_key_of(request), now) if chat in watch else None
    res = orig(self, request, now)
    if chat in watch:
        ids = self.view.replica_ids
        dem = " ".join(f"{p._session_demand(r):.0f}/{p._num_sessions(r):.1f}" for r in ids)
        matched = self.view.index.longest_prefix(request.page_keys, ids)
        m = " ".join(str(matched.get(r, 0)) for r in ids)
        loads = " ".join(str(l.num_requests) for l in self.view.loads)
        home = self.id_to_number[sess.replica_id] if sess else None
        print(f"{now:6.1f} {request.request_id:6s} pages {len(request.page_keys):3d} home {home} -> {res[0]} "
              f"{res[2]:14s} matched [{m}] demand/sess [{dem}] load [{loads}]")
    return res
routers.Ours.route = route
r = Simulation(wl, "prefixserve", dp, cost, seed=seed, policy_kwargs=kw).run()
print(r.hit_rate, r.ttft_p99_s)
