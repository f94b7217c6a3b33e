"""Scratch: the slowest requests of one seed of tight multi-turn, for several routers / env configs."""
import json
import sys
from collections import Counter
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS
cost = CostModel()
KW = json.loads(sys.argv[-1]) if sys.argv[-1].startswith("{") else {}  # policy kwargs, last
seed = int(sys.argv[1]); router = sys.argv[2]; dp = int(sys.argv[3]) if len(sys.argv) > 3 and not sys.argv[3].startswith("{") else 4
wl = WORKLOADS["multi-turn"](dp, cost, seed=seed)
wl.num_pages_per_replica = 128
r = Simulation(wl, router, dp, cost, seed=seed, policy_kwargs={**cost.policy_kwargs(), **KW}).run()
reqs = wl.all_requests()
print(f"{router} seed {seed}: hit {r.hit_rate:.4f} p99 {r.ttft_p99_s:.2f} p50 {r.ttft_p50_s:.2f} mean {r.ttft_mean_s:.2f}")
worst = sorted(reqs, key=lambda q: q.first_token_s - q.arrival_s)[-10:]
for q in worst:
    print(f"  {q.request_id:7s} r{q.replica} t={q.arrival_s:6.1f} len={q.prompt_len} cached={q.cached_local + q.cached_peer}"
          f" ttft={q.first_token_s - q.arrival_s:.2f} routed_wait={q.routed_s - q.arrival_s:.2f}")
by = Counter(q.replica for q in reqs)
miss = Counter()
for q in reqs:
    miss[q.replica] += q.prompt_len - q.cached_local - q.cached_peer - q.cached_tier
print("  requests per replica", sorted(by.items()), "missed tokens per replica", sorted(miss.items()))
