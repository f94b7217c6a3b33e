"""Scratch: per-chat missed tokens, ours vs hints off, one seed; and each move's context.
Usage: diag_chats.py SEED [policy-kwargs-json, e.g. '{"session_growth": 0}' for the rule off]."""
import json, sys
from collections import defaultdict
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS
cost = CostModel()
seed = int(sys.argv[1]) if len(sys.argv) > 1 else 2
runs = {}
base = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
for name, kw in (("on", base), ("off", {**base, "enable_peer_hint": False})):
    wl = WORKLOADS["multi-turn"](4, cost, seed=seed)
    wl.num_pages_per_replica = 128
    Simulation(wl, "prefixserve", 4, cost, seed=seed, policy_kwargs={**cost.policy_kwargs(), **kw}).run()
    runs[name] = wl.all_requests()
for name, reqs in runs.items():
    per = defaultdict(int)
    for q in reqs:
        per[q.request_id.split("t")[0]] += q.prompt_len - q.cached_local - q.cached_peer - q.cached_tier
    print(name, dict(sorted(per.items(), key=lambda kv: int(kv[0][1:]))))
print("moves (on):")
for q in sorted(runs["on"], key=lambda q: q.routed_s):
    if q.reason in ("cost_away", "balanced_away"):
        print(f"  t={q.routed_s:6.2f} {q.reason} {q.request_id} -> r{q.replica} hint={getattr(q.peer_hint,'number',None)} "
              f"len={q.prompt_len} local={q.cached_local} peer={q.cached_peer} ttft={q.first_token_s-q.arrival_s:.2f}")
print("per-replica timeline of chats (on):")
for q in sorted(runs["on"], key=lambda q: q.routed_s):
    pass
for name, reqs in runs.items():
    last = {}
    for q in sorted(reqs, key=lambda q: q.routed_s):
        last[q.request_id.split("t")[0]] = q.replica
    for when in (20, 40, 60, 80, 100, 140):
        cur = {}
        for q in sorted(reqs, key=lambda q: q.routed_s):
            if q.routed_s <= when:
                cur[q.request_id.split("t")[0]] = q.replica
        counts = [sum(1 for v in cur.values() if v == r) for r in range(4)]
        print(name, "t<=", when, "chats per replica", counts)
