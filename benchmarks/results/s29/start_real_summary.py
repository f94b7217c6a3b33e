"""Session 29: summary of start_real.sh's runs (and start_real_nocap/, the rule before its cap; session 32's
move_real/ too): per run and pooled per setting, the cached prompt-token rate, TTFT mean / p50 / p90 / p99 and the
requests per replica (the router's decision counters). Usage: python benchmarks/results/s29/start_real_summary.py
[DIR ...]"""
import glob
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def per_replica(path: str) -> list:
    counts: dict = {}
    for line in open(path):
        if not line.startswith("prefixserve_router_decisions_total"):  # not session 33's session events
            continue
        match = re.search(r'replica="([^"]+)"\} ([0-9.]+)', line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0) + float(match.group(2))
    return sorted(counts.values(), reverse=True)


for folder in sys.argv[1:] or [os.path.join(HERE, "start_real")]:
    print(f"== {os.path.relpath(folder, HERE)}")
    pooled: dict = {}
    for path in sorted(glob.glob(os.path.join(folder, "*-seed*.json"))):
        label = os.path.basename(path)[:-5]
        metrics = json.load(open(path))["metrics"]
        ttft = metrics["ttft_ms"]
        counts = per_replica(path[:-5] + ".decisions.txt")
        busiest = counts[0] / (sum(counts) / len(counts)) if counts else float("nan")
        row = (metrics["cached_token_rate"], ttft["mean"], ttft["p50"], ttft["p90"], ttft["p99"], busiest)
        pooled.setdefault(label.split("-")[0], []).append(row)
        print(f"{label:14s} cached {row[0]:.1%}  TTFT mean {row[1]:6.0f}  p50 {row[2]:5.0f}  p90 {row[3]:6.0f}  "
              f"p99 {row[4]:6.0f} ms  requests per replica {'/'.join(f'{c:.0f}' for c in counts)}  "
              f"busiest/mean {busiest:.2f}")
    for setting, rows in sorted(pooled.items()):
        means = [statistics.mean(column) for column in zip(*rows)]
        print(f"{setting:14s} mean of {len(rows)}: cached {means[0]:.1%}  TTFT mean {means[1]:6.0f}  "
              f"p50 {means[2]:5.0f}  p90 {means[3]:6.0f}  p99 {means[4]:6.0f} ms  busiest/mean {means[5]:.2f}")
