"""Short requests against one running server, the step helper toggled by /tmp/xp_helper_off between blocks.
PYTHONPATH=benchmarks .venv/bin/python benchmarks/results/s40/scratch/helper_ab.py URL BLOCKS N"""
import os, statistics, sys, time
import httpx
from short_request_split import totals

url, blocks, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def prompt(i):
    return [(i * 7919 + k * 104729) % 8000 + 100 for k in range(12)]
res = {"on": [], "off": []}
with httpx.Client(base_url=url, timeout=60) as c:
    for i in range(30):
        c.post("/v1/completions", json={"model": "tiny-llama", "prompt": prompt(i), "max_tokens": 1, "temperature": 0})
    i = 0
    for b in range(blocks):
        for mode in (("on", "off") if b % 2 == 0 else ("off", "on")):
            if mode == "off": open("/tmp/xp_helper_off", "w").close()
            elif os.path.exists("/tmp/xp_helper_off"): os.remove("/tmp/xp_helper_off")
            time.sleep(1.3)
            before = totals(c); walls = []
            for _ in range(n):
                i += 1; s = time.perf_counter()
                c.post("/v1/completions", json={"model": "tiny-llama", "prompt": prompt(1000 + i), "max_tokens": 1,
                                                "temperature": 0}).raise_for_status()
                walls.append(time.perf_counter() - s)
            time.sleep(1.3); after = totals(c)
            pre = (after["engine_prefill"][0] - before["engine_prefill"][0]) / max(1, after["engine_prefill"][1] - before["engine_prefill"][1])
            res[mode].append((statistics.median(walls) * 1e3, pre * 1e3))
            print(mode, f"wall median {statistics.median(walls)*1e3:.2f} ms, engine prefill mean {pre*1e3:.2f} ms", flush=True)
if os.path.exists("/tmp/xp_helper_off"): os.remove("/tmp/xp_helper_off")
for mode, v in res.items():
    print(mode, "wall medians", [round(a, 2) for a, _ in v], "prefill", [round(b, 2) for _, b in v])
