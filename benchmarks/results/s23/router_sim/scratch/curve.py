import sys, json, collections
sys.path.insert(0, __import__('os').path.dirname(__file__))
from analyze import run
router = sys.argv[1]; seed = int(sys.argv[2]); kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
sim, res, reqs = run(router, seed=seed, policy_kwargs=kw)
s4 = sorted([r for r in reqs if r.request_id.startswith('s4') or r.request_id.startswith('s3')], key=lambda r: r.arrival_s)
# bucket by arrival time, 300 s buckets: per replica mean TTFT
t0 = s4[0].arrival_s
b = collections.defaultdict(lambda: collections.defaultdict(list))
for r in s4:
    b[int((r.arrival_s - t0) // 400)][r.replica].append(r.first_token_s - r.arrival_s)
print(router, seed, res.ttft_p99_s)
for k in sorted(b):
    print(f" t+{k*400:5d}: " + "  ".join(f"r{n}:{(sum(v)/len(v) if v else 0):6.1f}({len(v):2d})" for n, v in sorted(b[k].items())))
