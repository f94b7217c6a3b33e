"""Session 32 scratch: where each chat of the simulator's tight multi-turn (128 pages a replica) went, turn by turn, and
the cached share of its last six turns; the diagnosis of BENCHMARKS.md 0x. ``KW`` (JSON) replaces our policy's fields.

    KW='{"session_move_fill": 0}' PYTHONPATH=. .venv/bin/python benchmarks/results/s32/scratch/chat_placement.py 4 16 prefixserve
"""
import collections
import json
import os
import sys

from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS

dp, seed, router = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cost = CostModel()
workload = WORKLOADS["multi-turn"](dp, cost, seed=seed)
workload.num_pages_per_replica = 128
kwargs = {**cost.policy_kwargs(), **json.loads(os.environ.get("KW", "{}"))} if router.startswith("prefixserve") else None
result = Simulation(workload, router, dp, cost, seed=seed, policy_kwargs=kwargs).run()
chats = collections.defaultdict(list)
for request in workload.all_requests():
    chats[request.request_id.split("t")[0]].append(request)
print(f"DP {dp} seed {seed} {router} {os.environ.get('KW', '')}: hit {result.hit_rate:.4f} p99 {result.ttft_p99_s:.2f} s")
for name, turns in sorted(chats.items(), key=lambda item: item[1][0].arrival_s):
    cached = " ".join(f"{(t.cached_local + t.cached_peer) / t.prompt_len:.2f}" for t in turns[-6:])
    worst = max(t.first_token_s - t.arrival_s for t in turns)
    print(f"{name:4s} start {turns[0].arrival_s:6.1f} end {turns[-1].finished_s:6.1f} s, {len(turns):2d} turns, last "
          f"prompt {turns[-1].prompt_len:5d} tokens, worst TTFT {worst:5.2f} s, replica per turn "
          f"{''.join(str(t.replica) for t in turns)}, cached share of the last 6: {cached}")
