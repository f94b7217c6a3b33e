"""Hot-prefix replication on vs off: two DP=2 prefixserve apps side by side on one hot-prefix workload.

Both apps run at once on one Ray (the same model, KV budget, router and peer copy); only
``--enable-hot-prefix-replication`` differs. They are driven in lockstep: the request list is cut into ``--rounds``
chunks and each chunk is sent to one app, then the other (alternating which goes first), so load from other jobs on the
machine falls on both alike. Compare the two columns of one run, not runs with each other.

Workload: ``--num-prefixes`` system prompts of P tokens; a share ``--hot-share`` of the requests use prompt 0 (the hot
one), the rest the others evenly, in seeded random order; each request is its prompt + a fresh S-token suffix, O output
tokens, greedy, token ids to /v1/completions, C in flight (closed loop).

Reported per app: TTFT p50 / p90 / p99 (all requests, and those of the hot prompt), the cached-token rate, cached tokens
by source (local = the replica's own cache, peer = copied on the request's path), requests per replica, and from
/metrics the proactive copies (started / done / cancelled / failed), pages copied ahead of need and their hits.

Usage:
    python benchmarks/hot_prefix.py [--num-requests 192] [--rounds 4] [--concurrency 8]
Appends nothing by itself: writes benchmarks/results/hot_prefix.md and .json (override with --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

from router_compare import (MODEL_NAME, PAGE_SIZE, Request, kv_bytes_per_page, model_description,  # noqa: E402
                            model_dir, run_load, start_ray, warmup_requests)

from bench.metrics import percentile  # noqa: E402
from bench.workloads import IdPromptFactory, seeded_rng  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
MODES = ("on", "off")


def build_requests(args: argparse.Namespace) -> list[Request]:
    factory = IdPromptFactory(vocab_size=args.vocab_size)
    prefixes = [factory.make(args.prefix_len, seeded_rng(args.seed, "hot-prefix", k)) for k in range(args.num_prefixes)]
    rng = seeded_rng(args.seed, "hot-order")
    requests = []
    for index in range(args.num_requests):
        group = 0 if rng.random() < args.hot_share or args.num_prefixes == 1 else 1 + index % (args.num_prefixes - 1)
        suffix = factory.make(args.suffix_len, seeded_rng(args.seed, "hot-suffix", index))
        requests.append(Request(index, group, prefixes[group] + suffix))
    return requests


def serve_config(args: argparse.Namespace, replication: bool):
    from cluster.config import ServeConfig

    return ServeConfig(
        model=str(model_dir(args)), devices="cpu", dtype=args.dtype, data_parallel_degree=2, page_size=PAGE_SIZE,
        kv_cache_memory=args.pages_per_replica * kv_bytes_per_page(args),
        num_cpus_per_replica=args.num_cpus_per_replica,
        max_model_len=2048, max_num_batched_tokens=2048, served_model_name=MODEL_NAME, log_level="warning",
        enable_disk_cache=False, enable_dp_cross_replica_prefix_copy=True, enable_hot_prefix_replication=replication,
    )


def scrape(port: int, name: str) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/{name}/metrics", timeout=30).text


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for raw_labels, value in re.findall(rf"^{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.MULTILINE):
        if all(f'{key}="{wanted}"' in raw_labels for key, wanted in labels.items()):
            total += float(value)
    return total


def summarize(mode: str, records: list, metrics: str, duration_s: float) -> dict:
    done = [r for r in records if r.error is None]
    ttfts = sorted(r.ttft_s * 1000 for r in done if r.ttft_s is not None)
    hot = sorted(r.ttft_s * 1000 for r in done if r.ttft_s is not None and r.prefix == 0)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    by_source: Counter = Counter()
    for r in done:
        by_source.update(r.cached_by_source)
    copies = {outcome: metric_sum(metrics, "prefixserve_hot_prefix_copies_total", outcome=outcome)
              for outcome in ("planned", "started", "done", "cancelled", "failed")}
    return {
        "mode": mode,
        "num_requests": len(records),
        "num_errors": len(records) - len(done),
        "duration_s": duration_s,
        "ttft_p50_ms": percentile(ttfts, 50) if ttfts else None,
        "ttft_p90_ms": percentile(ttfts, 90) if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 99) if ttfts else None,
        "hot_ttft_p50_ms": percentile(hot, 50) if hot else None,
        "hot_ttft_p99_ms": percentile(hot, 99) if hot else None,
        "cached_token_rate": sum(by_source.values()) / prompt_tokens if prompt_tokens else 0.0,
        "cached_by_source": dict(by_source),
        "requests_per_replica": sorted(Counter(r.replica_id for r in done).values(), reverse=True),
        "proactive_copies": copies,
        "proactive_pages_copied": metric_sum(metrics, "prefixserve_hot_prefix_pages_total", kind="copied"),
        "proactive_hit_pages": metric_sum(metrics, "prefixserve_hot_prefix_hit_pages_total"),
        "proactive_hit_requests": metric_sum(metrics, "prefixserve_hot_prefix_hit_requests_total"),
        "peer_pages_fetched": metric_sum(metrics, "prefixserve_kv_fetch_pages_total", source="peer"),
        "first_errors": [r.error for r in records if r.error][:3],
    }


def format_table(rows: list[dict]) -> str:
    def ms(value):
        return "-" if value is None else f"{value:.0f}"

    header = ["replication", "TTFT p50 / p90 / p99 ms", "hot prompt TTFT p50 / p99 ms", "cached-token rate",
              "cached local / peer tokens", "requests per replica", "proactive copies started / done / cancelled / "
              "failed", "pages copied ahead", "hits on them (pages / requests)", "peer pages fetched (all)",
              "errors", "req/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        copies = row["proactive_copies"]
        lines.append("| " + " | ".join([
            row["mode"],
            f"{ms(row['ttft_p50_ms'])} / {ms(row['ttft_p90_ms'])} / {ms(row['ttft_p99_ms'])}",
            f"{ms(row['hot_ttft_p50_ms'])} / {ms(row['hot_ttft_p99_ms'])}",
            f"{100 * row['cached_token_rate']:.1f}%",
            f"{row['cached_by_source'].get('local', 0)} / {row['cached_by_source'].get('peer', 0)}",
            " / ".join(str(n) for n in row["requests_per_replica"]),
            " / ".join(f"{copies[k]:.0f}" for k in ("started", "done", "cancelled", "failed")),
            f"{row['proactive_pages_copied']:.0f}",
            f"{row['proactive_hit_pages']:.0f} / {row['proactive_hit_requests']:.0f}",
            f"{row['peer_pages_fetched']:.0f}",
            str(row["num_errors"]),
            f"{row['num_requests'] / row['duration_s']:.2f}" if row["duration_s"] else "-",
        ]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=4, help="lockstep chunks (each sent to one app, then the other)")
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--hot-share", type=float, default=0.8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pages-per-replica", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=None,
                        help="serve this model folder (default: a generated --hidden-size x --num-layers Llama)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--num-cpus-per-replica", type=float, default=0.5,
                        help="Ray CPUs per replica (two apps of DP 2 run at once: 0.5 fills 2 CPUs)")
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--out", default=str(RESULTS_DIR / "hot_prefix.md"))
    parser.add_argument("--smoke", action="store_true", help="a handful of requests, results to a temp folder")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_requests, args.rounds = min(args.num_requests, 24), 2
        args.out = str(Path(tempfile.gettempdir()) / "hot_prefix_smoke.md")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    command = "python benchmarks/hot_prefix.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started = time.perf_counter()
    model_dir(args)
    requests = build_requests(args)
    import ray
    from ray import serve

    from cluster.app import build_app

    port = start_ray(args)
    mode_to_records: dict[str, list] = {mode: [] for mode in MODES}
    mode_to_seconds = {mode: 0.0 for mode in MODES}
    try:
        for mode in MODES:
            serve.run(build_app(serve_config(args, mode == "on")), name=f"hot-{mode}", route_prefix=f"/hot-{mode}")
        for mode in MODES:
            warm, _ = asyncio.run(run_load(f"http://127.0.0.1:{port}/hot-{mode}/v1/completions",
                                           warmup_requests(args), args, warmup=True))
            if any(r.error for r in warm):
                raise RuntimeError(f"warm-up of {mode} failed: {[r.error for r in warm if r.error][:1]}")
        time.sleep(args.settle_s)
        chunk = -(-len(requests) // args.rounds)
        for round_index in range(args.rounds):
            part = requests[round_index * chunk : (round_index + 1) * chunk]
            order = MODES if round_index % 2 == 0 else MODES[::-1]
            for mode in order:
                records, seconds = asyncio.run(run_load(f"http://127.0.0.1:{port}/hot-{mode}/v1/completions", part,
                                                        args, warmup=False))
                mode_to_records[mode].extend(records)
                mode_to_seconds[mode] += seconds
                print(f"round {round_index} {mode}: {len(records)} requests in {seconds:.1f} s", flush=True)
        rows = [summarize(mode, mode_to_records[mode], scrape(port, f"hot-{mode}"), mode_to_seconds[mode])
                for mode in MODES]
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    wall_s = time.perf_counter() - started
    settings = (
        f"model: {model_description(args)}, {args.dtype}, 1 torch thread per replica; two DP=2 apps on one host at "
        f"once (4 replicas, {args.num_cpus_per_replica:g} CPU each); page size {PAGE_SIZE}; KV "
        f"budget {args.pages_per_replica} pages per replica; peer copy on in both; disk tier and Redis off; "
        f"replication defaults (hot after 4 requests in 5 s, holder busy at 4 requests, 256 pages per 10 s).\n"
        f"workload: {args.num_prefixes} system prompts x {args.prefix_len} tokens, {args.hot_share:.0%} of "
        f"{args.num_requests} requests on prompt 0, each + a fresh {args.suffix_len}-token suffix, {args.output_len} "
        f"output tokens, greedy, concurrency {args.concurrency}, {args.rounds} lockstep rounds, seed {args.seed}."
    )
    text = "\n".join(["# Hot-prefix replication on vs off (prefixserve, DP=2)", "", "Command:", "",
                      f"    {command.strip()}", "", settings, "", format_table(rows), "", f"Whole run: {wall_s:.0f} s.",
                      ""])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"command": command.strip(), "settings": vars(args), "rows": rows},
                                                   indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
