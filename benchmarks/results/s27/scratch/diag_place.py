"""Scratch: each chat's replicas over its turns and its final length, tight multi-turn, one seed."""
import json
import sys
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS
cost = CostModel()
KW = json.loads(sys.argv[-1]) if sys.argv[-1].startswith("{") else {}  # policy kwargs, last
seed = int(sys.argv[1]); router = sys.argv[2]
wl = WORKLOADS["multi-turn"](4, cost, seed=seed)
wl.num_pages_per_replica = 128
r = Simulation(wl, router, 4, cost, seed=seed, policy_kwargs={**cost.policy_kwargs(), **KW}).run()
print(f"{router} seed {seed}: hit {r.hit_rate:.4f} p99 {r.ttft_p99_s:.2f}")
for first in sorted(wl.first_requests, key=lambda q: q.arrival_s):
    reps, q, last = [], first, first
    while q is not None:
        reps.append(q.replica); last = q; q = q.next_turn
    chat = first.request_id.split("t")[0]
    print(f"  {chat:4s} sys{int(chat[1:]) % 8} start {first.arrival_s:5.1f} end {last.arrival_s:6.1f} "
          f"final pages {last.prompt_len // 128:3d} replicas {''.join(map(str, reps))}")
