"""python -m benchmarks.router_sim compare|scale ... (see benchmarks/router_sim/__init__.py)."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.router_sim.costs import COST_MODELS, CostModel
from benchmarks.router_sim.routers import ROUTERS
from benchmarks.router_sim.sim import EVICTIONS, simulate
from benchmarks.router_sim.workloads import WORKLOADS

OURS = "prefixserve"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    wanted = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    model, cpus = fields.get("Model name", "?").strip(), fields.get("CPU(s)", "?").strip()
    return f"{model}, {cpus} CPUs, flags {' '.join(wanted)}"


def compare(args: argparse.Namespace) -> int:
    cost = COST_MODELS[args.cost_model]
    rows = []
    began = time.perf_counter()
    seeds = [int(seed) for seed in args.seeds.split(",")] if args.seeds else [args.seed]
    for workload in args.workloads.split(","):
        for dp in [int(d) for d in args.dp.split(",")]:
            for router, seed in ((router, seed) for router in args.routers.split(",") for seed in seeds):
                result = simulate(workload, router, dp, seed=seed, scale=args.scale, cost=cost,
                                  host_tier_pages=args.host_tier_pages, pool_fraction=args.pool_fraction,
                                  eviction=args.eviction)
                rows.append({**result.row(), "seed": seed})
                print(f"{workload:12s} dp={dp:<3d} {router:22s} seed {seed} hit {result.hit_rate:.3f} (ideal "
                      f"{result.ideal_hit_rate:.3f}) ttft p50 {result.ttft_p50_s:6.2f} p99 {result.ttft_p99_s:6.2f} s "
                      f"busiest/mean {result.busiest_over_mean:.2f}  [{result.wall_s:.1f} s]"
                      f"{f' replication {result.replication}' if result.replication else ''}", file=sys.stderr,
                      flush=True)
    report = render(rows, args, cost, time.perf_counter() - began)
    if args.out:
        Path(args.out).with_suffix(".md").write_text(report)
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))
    print(report)
    return 0


def render(rows: list, args: argparse.Namespace, cost: CostModel, wall_s: float) -> str:
    lines = [
        "# Router simulation: our policy and index against the published routing rules",
        "",
        f"Command: `python -m benchmarks.router_sim compare --workloads {args.workloads} --dp {args.dp} "
        f"--routers {args.routers} --scale {args.scale} "
        f"{f'--seeds {args.seeds}' if args.seeds else f'--seed {args.seed}'} --cost-model {args.cost_model}"
        f"{f' --host-tier-pages {args.host_tier_pages}' if args.host_tier_pages else ''}"
        f"{f' --pool-fraction {args.pool_fraction}' if args.pool_fraction != 1.0 else ''}"
        f"{f' --eviction {args.eviction}' if args.eviction != 'own' else ''}`",
        f"Machine: {cpu_model()}; Python {platform.python_version()}; {wall_s:.0f} s in all.",
        f"Cost model (benchmarks/router_sim/costs.py): {cost}",
        "",
        "hit = cached prompt tokens (local + peer copy + host tier) / prompt tokens; local = from the replica's own "
        "cache; ideal = every page computed once in the cluster; TTFT modeled (queueing + copy + chunked prefill among other "
        "requests' steps); busiest/mean = requests routed to the busiest replica / the mean; decision = wall time of "
        "one routing decision inside the simulation (noisy: the box is shared). A `*` marks a baseline that beats "
        "ours on that column.",
        "",
    ]
    if args.seeds:
        return "\n".join(lines + [
            f"Each row: the mean over seeds {args.seeds} (the same shape, different prompts and arrivals), the "
            "per-seed values in brackets; a `*` marks a baseline whose mean beats ours.", ""] + _mean_tables(rows))
    keyed = {}
    for row in rows:
        keyed.setdefault((row["workload"], row["dp"]), []).append(row)
    for (workload, dp), group in keyed.items():
        ours = next((row for row in group if row["router"] == OURS), None)
        lines += [f"## {workload}, DP={dp}", "",
                  "| router | hit | local | ideal | TTFT p50 (s) | TTFT p99 (s) | busiest/mean | decision p99 (us) | "
                  "reasons |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in group:
            beats_hit, beats_p99 = _beats(row, ours) if row is not ours else (False, False)
            reasons = ", ".join(f"{k} {v}" for k, v in row["reasons"].items())
            if row.get("replication"):
                reasons += "; replication: " + ", ".join(f"{k} {v}" for k, v in row["replication"].items())
            lines.append(
                f"| {row['router']} | {row['hit_rate']:.3f}{'*' if beats_hit else ''} | {row['local_hit_rate']:.3f} | "
                f"{row['ideal_hit_rate']:.3f} | {row['ttft_p50_s']:.2f} | {row['ttft_p99_s']:.2f}"
                f"{'*' if beats_p99 else ''} | {row['busiest_over_mean']:.2f} | {row['decision_p99_us']:.0f} | "
                f"{reasons} |")
        lines.append("")
    return "\n".join(lines)


def _beats(other: dict, ours: dict | None) -> tuple[bool, bool]:
    """Whether ``other`` (a baseline's row or means) has a higher hit rate than ours, and a lower TTFT p99, beyond
    rounding (the `*` of the tables)."""
    if ours is None:
        return False, False
    return other["hit_rate"] > ours["hit_rate"] + 5e-4, other["ttft_p99_s"] < ours["ttft_p99_s"] * (1 - 5e-3)


def _mean_tables(rows: list) -> list:
    """One table per (workload, DP): each router's mean over the seeds, with the per-seed values."""
    keyed: dict = {}
    for row in rows:
        keyed.setdefault((row["workload"], row["dp"]), {}).setdefault(row["router"], []).append(row)
    lines = []
    for (workload, dp), by_router in keyed.items():
        means = {router: {name: sum(r[name] for r in runs) / len(runs)
                          for name in ("hit_rate", "local_hit_rate", "ttft_p50_s", "ttft_p99_s", "busiest_over_mean")}
                 for router, runs in by_router.items()}
        ours = means.get(OURS)
        lines += [f"## {workload}, DP={dp}", "",
                  "| router | hit | local | TTFT p50 (s) | TTFT p99 (s) | busiest/mean |",
                  "|---|---|---|---|---|---|"]
        for router, runs in by_router.items():
            mean = means[router]
            beats_hit, beats_p99 = _beats(mean, ours) if router != OURS else (False, False)

            def each(name: str, digits: int) -> str:
                return " (" + " / ".join(f"{r[name]:.{digits}f}" for r in runs) + ")" if len(runs) > 1 else ""

            lines.append(
                f"| {router} | {mean['hit_rate']:.4f}{'*' if beats_hit else ''}{each('hit_rate', 3)} | "
                f"{mean['local_hit_rate']:.3f} | {mean['ttft_p50_s']:.2f} | "
                f"{mean['ttft_p99_s']:.2f}{'*' if beats_p99 else ''}{each('ttft_p99_s', 2)} | "
                f"{mean['busiest_over_mean']:.2f}{each('busiest_over_mean', 2)} |")
        lines.append("")
    return lines


def scale(args: argparse.Namespace) -> int:
    from benchmarks.router_sim.scale import run_scale

    report = run_scale(num_replicas=args.replicas, num_pages=args.pages, num_decisions=args.decisions,
                       seed=args.seed)
    text = f"Machine: {cpu_model()}; Python {platform.python_version()}\n\n" + report
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


def trace(args: argparse.Namespace) -> int:
    from benchmarks.router_sim.sim import Simulation
    from benchmarks.router_sim.trace import load_trace, read_trace

    cost = CostModel(**json.loads(args.cost)) if args.cost else CostModel()
    rows = read_trace(args.trace)
    for router in args.routers.split(","):
        workload = load_trace(rows, cost.page_size, mode=args.mode, num_pages_per_replica=args.pages)
        result = Simulation(workload, router, args.dp, cost, seed=args.seed, concurrency=args.concurrency,
                            cores=args.cores).run()
        print(json.dumps(result.row(), default=str))
    return 0


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("compare", help="routers x workloads x DP in the simulator")
    one.add_argument("--workloads", default=",".join(WORKLOADS))
    one.add_argument("--routers", default=",".join(ROUTERS))
    one.add_argument("--dp", default="4,16,64")
    one.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's published size")
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--seeds", default="", help="comma-separated seeds: run each, report each router's mean")
    one.add_argument("--cost-model", default="calibrated", choices=sorted(COST_MODELS),
                     help="the simulated replicas' true costs (benchmarks/router_sim/costs.py COST_MODELS)")
    one.add_argument("--host-tier-pages", type=int, default=0,
                     help="a host tier of that many pages shared by the replicas (0: none)")
    one.add_argument("--pool-fraction", type=float, default=1.0,
                     help="scale each replica's page pool (below 1: the prefixes no longer fit)")
    one.add_argument("--eviction", default="own", choices=EVICTIONS,
                     help="replicas' eviction: own (ours segmented LRU, baselines LRU, as their engines), or one "
                          "policy "
                          "for every router")
    one.add_argument("--out", default="", help="write OUT.md and OUT.json")
    one.set_defaults(func=compare)
    two = sub.add_parser("scale", help="decision cost, index memory and event rate at 64 replicas / 1M pages")
    two.add_argument("--replicas", type=int, default=64)
    two.add_argument("--pages", type=int, default=1_000_000)
    two.add_argument("--decisions", type=int, default=20_000)
    two.add_argument("--seed", type=int, default=0)
    two.add_argument("--out", default="")
    two.set_defaults(func=scale)
    three = sub.add_parser("trace", help="replay a trace file (benchmarks/router_sim/trace.py); one JSON line per router")
    three.add_argument("trace")
    three.add_argument("--dp", type=int, default=2)
    three.add_argument("--routers", default=OURS)
    three.add_argument("--mode", choices=("timed", "closed"), default="timed")
    three.add_argument("--concurrency", type=int, default=0, help="closed mode: requests in flight at most (0: any)")
    three.add_argument("--cores", type=float, default=0.0, help="cores the replicas share (0: one each)")
    three.add_argument("--pages", type=int, default=1024, help="KV pages per replica")
    three.add_argument("--cost", default="", help="JSON object of CostModel fields")
    three.add_argument("--seed", type=int, default=0)
    three.set_defaults(func=trace)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
