#!/bin/bash
# README's server on the 0.5B shape (bf16); per-thread schedstat (ns on CPU, ns runnable but waiting) over one
# 256-token stream, for the replica's and the ingress's busiest threads: is the step helper waiting for a core?
source "$(dirname "$0")/q05_server.sh"
start_q05 "${1:-1}" /tmp/schedstat_server.log
.venv/bin/python - <<'PY'
import asyncio, os, sys, time, httpx
sys.path.insert(0, "benchmarks")
from serving_overhead import prompt_of, stream_request
def snap():
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:60]
            if "ray::" not in cmd and "raylet" not in cmd and "gcs" not in cmd: continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                run, wait, slices = map(int, open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
                out[(pid, tid)] = (cmd, run, wait, slices)
        except OSError:
            pass
    return out
async def main():
    async with httpx.AsyncClient(base_url="http://127.0.0.1:8300", timeout=300) as c:
        await stream_request(c, "tiny-llama", prompt_of(64, 1, 8192), 8)
        for r in range(2):
            a = snap(); t = time.perf_counter()
            ttft, tpot = await stream_request(c, "tiny-llama", prompt_of(64, 50 + r, 8192), 256)
            wall = time.perf_counter() - t; b = snap()
            print(f"round {r}: tpot {tpot:.2f} ms, wall {wall:.2f} s")
            rows = []
            for k, (cmd, run, wait, sl) in b.items():
                if k in a:
                    dr, dw, ds = run - a[k][1], wait - a[k][2], sl - a[k][3]
                    if dr > 20e6: rows.append((dr, dw, ds, cmd, k[1]))
            for dr, dw, ds, cmd, tid in sorted(rows, reverse=True)[:6]:
                print(f"  {cmd[:45]:45s} tid {tid}: on CPU {dr/1e6/256:.2f} ms/token, waiting {dw/1e6/256:.2f} ms/token, {ds/256:.1f} slices/token")
asyncio.run(main())
PY
stop_q05
