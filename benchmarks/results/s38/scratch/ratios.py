"""Ours / vLLM from vs_vllm.sh vllm-client's raw files: python ratios.py DTYPE TAG (e.g. bfloat16 -s38)."""
import json
import sys
from pathlib import Path

dtype, tag = sys.argv[1], sys.argv[2]
caching = sys.argv[3] if len(sys.argv) > 3 else ""
raw = Path(__file__).resolve().parents[3] / "results" / "raw" / dtype
name = lambda server, extra="": raw / f"vllm-client-{server}{caching}{tag}{extra}.json"
ours, theirs = (json.loads(name(s).read_text()) for s in ("prefixserve", "vllm"))
ours_o, theirs_o = (json.loads(name(s, "-overhead").read_text()) for s in ("prefixserve", "vllm"))
for key in ("request_throughput", "median_ttft_ms", "median_tpot_ms", "p99_ttft_ms", "mean_ttft_ms"):
    print(f"{key}: {ours[key]:.2f} / {theirs[key]:.2f} = {ours[key] / theirs[key]:.2f}x")
for key in ours_o:
    print(f"{key}: {ours_o[key]:.2f} / {theirs_o[key]:.2f} = {ours_o[key] / theirs_o[key]:.2f}x")
