"""Probe: minor page faults per request in each server process (the replica, the ingress, ...) over HTTP, for short
requests and for long-prompt requests sharing a prefix (session 42 scratch). argv: port pid=name ..."""
import json, random, sys, time, urllib.request

port = int(sys.argv[1])
procs = dict(arg.split("=") for arg in sys.argv[2:])

def faults():
    out = {}
    for pid, name in procs.items():
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        out[name] = (int(fields[7]), int(fields[11]) + int(fields[12]))
    return out

def post(prompt, max_tokens):
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()

rng = random.Random(0)
prefix = [rng.randrange(3, 8000) for _ in range(1792)]
workloads = {
    "short (12 in, 1 out)": lambda i: post([rng.randrange(3, 8000) for _ in range(12)], 1),
    "shared prefix (1792 + 256 in, 32 out)": lambda i: post(prefix + [rng.randrange(3, 8000) for _ in range(256)], 32),
    "unique (2048 in, 32 out)": lambda i: post([rng.randrange(3, 8000) for _ in range(2048)], 32),
}
for name, run in workloads.items():
    run(-1)
    n = 20
    before, t = faults(), time.perf_counter()
    for i in range(n):
        run(i)
    elapsed, after = time.perf_counter() - t, faults()
    print(f"{name}: {elapsed / n * 1000:.1f} ms a request; minor faults / CPU ms a request: " +
          ", ".join(f"{p} {(after[p][0] - before[p][0]) / n:.0f} / {(after[p][1] - before[p][1]) * 10 / n:.1f}"
                    for p in procs.values()), flush=True)
