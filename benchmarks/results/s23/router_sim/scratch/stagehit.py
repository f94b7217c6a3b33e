import sys, json, collections
sys.path.insert(0, __import__('os').path.dirname(__file__))
from analyze import run
router = sys.argv[1]; kw = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
acc = collections.defaultdict(list)
for seed in range(8):
    sim, res, reqs = run(router, seed=seed, policy_kwargs=kw)
    for s in range(5):
        rs = [r for r in reqs if r.request_id.startswith(f's{s}')]
        acc[s].append(sum(r.cached_local + r.cached_peer for r in rs) / sum(r.prompt_len for r in rs))
        acc[f'miss{s}'].append(sum(1 for r in rs if r.cached_local + r.cached_peer < 5888))
print(router, kw, ' '.join(f"s{s} {sum(acc[s])/8:.4f} miss {sum(acc[f'miss{s}'])/8:.1f} |" for s in range(5)))
