import os, sys, collections
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.workloads import WORKLOADS
dp=int(sys.argv[1]); seed=int(sys.argv[2])
cost=CostModel(); wl=WORKLOADS['llmd-prefix'](dp,cost,seed=seed,scale=1.0)
sim=Simulation(wl,'prefixserve',dp,cost,seed=seed,policy_kwargs=cost.policy_kwargs())
r=sim.run()
reqs=wl.all_requests()
served=[q for q in reqs if q.first_token_s>=0]
served.sort(key=lambda q:q.first_token_s-q.arrival_s, reverse=True)
print("hit",round(r.hit_rate,4),"p99",round(r.ttft_p99_s,2),"busiest",round(r.busiest_over_mean,2), r.reasons)
print("routed", [x.num_routed for x in sim.replicas])
for q in served[:15]:
    print(f"ttft {q.first_token_s-q.arrival_s:7.2f} at {q.arrival_s:8.1f} peer {q.cached_peer} local {q.cached_local} rep {getattr(q,'replica_number',None)} {[k for k in vars(q) if 'rep' in k or 'group' in k]}")
import re
cnt=collections.defaultdict(collections.Counter)
for q in reqs:
    st=q.name.split('g')[0] if hasattr(q,'name') else None
rep_of={}
for q in reqs:
    rid=getattr(q,'replica',None)
    rid=getattr(rid,'number',rid)
    m=re.match(r's(\d)g(\d+)u',q.request_id if hasattr(q,'request_id') else q.name)
    cnt[int(m.group(1))][rid]+=1
for st in sorted(cnt): print('stage',st, [cnt[st][i] for i in range(dp)])
for rep in sim.replicas:
    groups={k for k in rep.key_to_refs}
print([len({g for g in []})])
