import json, sys, os
raw = "/work/main/benchmarks/results/raw"
def load(p):
    try: return json.load(open(p))
    except Exception: return None
for dtype, tag in [a.split(":") for a in sys.argv[1:]]:
    ours = load(f"{raw}/{dtype}/vllm-client-prefixserve{tag}.json"); theirs = load(f"{raw}/{dtype}/vllm-client-vllm{tag}.json")
    oo = load(f"{raw}/{dtype}/vllm-client-prefixserve{tag}-overhead.json"); to = load(f"{raw}/{dtype}/vllm-client-vllm{tag}-overhead.json")
    print(f"## {dtype} {tag}")
    if ours and theirs:
        for k in ("request_throughput", "median_ttft_ms", "median_tpot_ms", "p99_ttft_ms", "median_itl_ms"):
            print(f"  {k}: ours {ours[k]:.2f} vllm {theirs[k]:.2f} ratio {ours[k]/theirs[k]:.2f}x")
    if oo and to:
        for k in ("short_request_ms", "stream_ttft_ms", "stream_tpot_ms", "concurrent4_tpot_ms"):
            if k in oo and k in to:
                print(f"  {k}: ours {oo[k]:.2f} vllm {to[k]:.2f} ratio {oo[k]/to[k]:.2f}x")
