"""Session 33 scratch: how many sessions the policy took for ended (idle) in the simulator's tight multi-turn, how
many of those went on after all (resumed), and the idle time it learned. Usage:
PYTHONPATH=. .venv/bin/python benchmarks/results/s33/scratch/idle_events.py \
    > benchmarks/results/s33/scratch/idle_events.txt"""
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS

cost = CostModel()
for dp, seeds in ((2, range(8)), (4, range(8)), (16, range(4)), (64, range(2))):
    idle = resumed = requests = chats = 0
    learned = []
    for seed in seeds:
        workload = WORKLOADS["multi-turn"](dp, cost, seed=seed)
        workload.num_pages_per_replica = 128
        simulation = Simulation(workload, "prefixserve", dp, cost, seed=seed, policy_kwargs=cost.policy_kwargs())
        result = simulation.run()
        policy = simulation.router.policy
        events = policy.drain_session_events()
        idle += sum(n for (_, event), n in events.items() if event == "idle")
        resumed += sum(n for (_, event), n in events.items() if event == "resumed")
        requests += result.num_requests
        chats += sum(1 for request in workload.all_requests() if request.first_turn)
        learned.append(policy._idle_s())
    print(f"DP {dp}, seeds {seeds.start}-{seeds.stop - 1}: {requests} requests of {chats} chats; sessions taken for "
          f"ended {idle}, of which went on {resumed}; idle time learned {min(learned):.2f}-{max(learned):.2f} s")
