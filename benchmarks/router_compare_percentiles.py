"""TTFT percentiles of ``router_compare.py`` results, per run and pooled per router, over all requests and over the
requests sent after the first ``--after-s`` seconds of a run (leaving out the cold start, when every prefix is computed
for the first time under any router). Nearest-rank percentiles from the per-request records of the .json files.

    python benchmarks/router_compare_percentiles.py benchmarks/results/s13/router_compare_cost_model*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.router_sim.sim import percentile as nearest_rank  # noqa: E402

QUANTILES = (50, 90, 95, 99)


def describe(values: list) -> str:
    return "/".join(f"{nearest_rank(values, q):.0f}" for q in QUANTILES) if values else "-"


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="router_compare.py .json files")
    parser.add_argument("--after-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    print(f"TTFT p{'/p'.join(map(str, QUANTILES))} ms: all requests | requests sent after {args.after_s:g} s")
    for path in args.results:
        results = json.load(open(path))
        fields = results["record_fields"].split(",")
        sent, ttft = fields.index("sent_s"), fields.index("ttft_ms")
        pooled: dict = {}
        print(path)
        for row in results["rows"]:
            if "pooled" in row["router"]:
                continue
            records = [record.split(",") for record in row["records"]]
            every = [float(r[ttft]) for r in records]
            later = [float(r[ttft]) for r in records if float(r[sent]) > args.after_s]
            name = row["router"].split()[0]
            pooled.setdefault(name, ([], []))
            pooled[name][0].extend(every)
            pooled[name][1].extend(later)
            print(f"  {' '.join(row['router'].split()[:3]):24s} {describe(every):>20s} | {len(later)} requests "
                  f"{describe(later)}")
        for name, (every, later) in pooled.items():
            print(f"  pooled {name:17s} {describe(every):>20s} | {len(later)} requests {describe(later)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
