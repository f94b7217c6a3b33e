"""Scratch: where tight multi-turn loses (per-request reasons, hits, TTFT), ours vs hints off vs llm-d."""
import json, sys
from collections import Counter
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS
cost = CostModel()
kw = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
router = sys.argv[2] if len(sys.argv) > 2 else "prefixserve"
for seed in (0, 1, 2):
    wl = WORKLOADS["multi-turn"](4, cost, seed=seed)
    wl.num_pages_per_replica = 128
    r = Simulation(wl, router, 4, cost, seed=seed, policy_kwargs={**cost.policy_kwargs(), **kw}).run()
    reqs = wl.all_requests()
    ttft = sorted(reqs, key=lambda q: q.first_token_s - q.arrival_s)
    worst = ttft[-8:]
    c = Counter(q.reason for q in reqs)
    moved = [q for q in reqs if q.reason in ("cost_away", "balanced_away")]
    miss = sum(q.prompt_len - q.cached_local - q.cached_peer - q.cached_tier for q in reqs)
    print(f"seed {seed} hit {r.hit_rate:.4f} p99 {r.ttft_p99_s:.2f} reasons {dict(c)} peer_tokens "
          f"{sum(q.cached_peer for q in reqs)} missed_tokens {miss} ideal_missed "
          f"{sum(q.prompt_len - q.ideal_cached_pages*128 for q in reqs)}")
    print("  worst:", [(q.request_id, q.reason, q.prompt_len, q.cached_local, q.cached_peer,
                        round(q.first_token_s - q.arrival_s, 2)) for q in worst[-4:]])
