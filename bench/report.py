"""Presenting result files (as loaded from JSON): the summary table of one run, its TTFT plot, and ``bench compare``'s
table (text or markdown, ratios to the first run) and chart. Plots need matplotlib (``prefixserve[bench]``).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from bench.metrics import PERCENTILES, RequestRecord


def format_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_run_table(result: dict[str, Any]) -> str:
    """The human summary of one result (as loaded from JSON) for stdout."""
    metrics = result["metrics"]
    config = result["config"]
    width = 62
    lines = [
        f" prefixserve bench: {result['label']} ".center(width, "="),
        row("Server / model", f"{result['server']['base_url']} / {result['server']['model']}"),
        row("Workload", describe_workload(config)),
        row("Load", describe_load(config["load"])),
        row("Successful requests", metrics["num_completed"]),
        row("Failed requests", metrics["num_errors"]),
        row("Benchmark duration (s)", f"{metrics['duration_s']:.2f}"),
        row("Request throughput (req/s)", f"{metrics['request_throughput']:.2f}"),
        row("Output token throughput (tok/s)", f"{metrics['output_throughput']:.2f}"),
        row("Total token throughput (tok/s)", f"{metrics['total_token_throughput']:.2f}"),
        row("Prompt / output tokens", f"{metrics['prompt_tokens']} / {metrics['completion_tokens']}"),
        row("Cached prompt tokens", f"{metrics['cached_tokens']} ({100 * metrics['cached_token_rate']:.1f}%)"),
    ]
    if metrics["cached_tokens_by_source"]:
        by_source = ", ".join(f"{key} {value}" for key, value in sorted(metrics["cached_tokens_by_source"].items()))
        lines.append(row("Cached tokens by source", by_source))
    if metrics["num_usage_missing"]:
        lines.append(row("Responses without usage", metrics["num_usage_missing"]))
    lines.append("-" * width)
    lines.append(f"{'(ms)':<14}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_ms")):
        dist = metrics[key]
        lines.append(
            f"{name:<14}{format_ms(dist['mean']):>12}{format_ms(dist['p50']):>12}"
            f"{format_ms(dist['p90']):>12}{format_ms(dist['p99']):>12}"
        )
    lines.append("=" * width)
    return "\n".join(lines)


def row(name: str, value: Any) -> str:
    return f"{name + ':':<34}{value}"


def describe_workload(config: dict[str, Any]) -> str:
    """One line: workload, sizes and prompt format (a named workload's own parameters, not the generic sizes it does
    not use)."""
    workload = config["workload"]
    standard = workload.get("standard")
    if standard:
        sizes = ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in standard.items()
                          if value is not None and name != "trace_file")
        return f"{workload['workload']}, {workload['num_requests']} req, {sizes}, {config['prompt_format']} prompts"
    output = workload["output_len_range"] or workload["output_len"]
    if isinstance(output, (list, tuple)):
        output = f"{output[0]}..{output[1]}"
    text = (
        f"{workload['workload']}, {workload['num_requests']} req, prefix {workload['prefix_len']} x "
        f"{config.get('num_prefixes_used', workload['num_prefixes'])}, suffix {workload['suffix_len']}, out {output}"
    )
    if workload["workload"] == "multi-turn":
        text += f", {workload['num_turns']} turns"
    return f"{text}, {config['prompt_format']} prompts"


def describe_load(load: dict[str, Any]) -> str:
    concurrency = load["concurrency"] or "unlimited"
    return f"concurrency {concurrency}, rate {load['request_rate']}/s, warm-up {load['warmup_requests']}"


def print_errors(records: Sequence[RequestRecord], limit: int = 5) -> None:
    """The first few distinct error messages, to stderr."""
    errors: dict[str, int] = {}
    for record in records:
        if record.error:
            errors[record.error] = errors.get(record.error, 0) + 1
    for message, count in list(errors.items())[:limit]:
        print(f"  {count} x {message}", file=sys.stderr)


def plot_ttft(result: dict[str, Any], path: str) -> None:
    """A PNG of the run's TTFT distribution: histogram and CDF."""
    plt = import_pyplot()
    ttfts = measured_ttfts_ms(result)
    figure, (hist_axis, cdf_axis) = plt.subplots(1, 2, figsize=(11, 4))
    hist_axis.hist(ttfts, bins=min(40, max(5, len(ttfts) // 2)), color="tab:blue")
    hist_axis.set_xlabel("TTFT (ms)")
    hist_axis.set_ylabel("requests")
    draw_cdf(cdf_axis, ttfts, result["label"])
    figure.suptitle(f"TTFT: {result['label']} ({describe_workload(result['config'])})", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def measured_ttfts_ms(result: dict[str, Any]) -> list[float]:
    """The TTFTs (ms, ascending) of a result's successful measured requests."""
    return sorted(r["ttft_s"] * 1000 for r in result["requests"] if r["success"] and not r["warmup"])


def draw_cdf(axis: Any, sorted_values: Sequence[float], label: str) -> None:
    """Draw an empirical CDF of ascending values on ``axis``."""
    count = len(sorted_values)
    axis.step(sorted_values, [(index + 1) / count for index in range(count)], where="post", label=label)
    axis.set_xlabel("TTFT (ms)")
    axis.set_ylabel("fraction of requests")
    axis.grid(alpha=0.3)


def import_pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (raises SystemExit with the install command when missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or 'prefixserve[bench]')") from exc
    return plt


# ----------------------------------------------------------------------------------------------------------------
# bench compare

COMPARE_COLUMNS = (
    # (header, getter over metrics, format, higher is better)
    ("req/s", lambda m: m["request_throughput"], "{:.2f}", True),
    ("out tok/s", lambda m: m["output_throughput"], "{:.1f}", True),
    ("TTFT mean", lambda m: m["ttft_ms"]["mean"], "{:.1f}", False),
    ("TTFT p50", lambda m: m["ttft_ms"]["p50"], "{:.1f}", False),
    ("TTFT p99", lambda m: m["ttft_ms"]["p99"], "{:.1f}", False),
    ("TPOT mean", lambda m: m["tpot_ms"]["mean"], "{:.2f}", False),
    ("ITL p50", lambda m: m["itl_ms"]["p50"], "{:.2f}", False),
    ("E2E p50", lambda m: m["e2e_ms"]["p50"], "{:.1f}", False),
    ("cached", lambda m: m["cached_token_rate"] * 100, "{:.1f}%", True),
    ("errors", lambda m: m["num_errors"], "{:d}", False),
)


def format_cell(value: Any, template: str) -> str:
    return "-" if value is None else template.format(value)


def ratio(value: Any, baseline: Any) -> str:
    """``value / baseline`` as ``1.23x`` ("-" when undefined)."""
    if value is None or baseline in (None, 0):
        return "-"
    return f"{value / baseline:.2f}x"


def compare_rows(results: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison (times in ms); each metric is followed by its ratio to the first run."""
    header = ["run", "workload"]
    for name, _, _, _ in COMPARE_COLUMNS:
        header.append(name)
    rows = []
    baseline = results[0]["metrics"]
    for result in results:
        metrics = result["metrics"]
        cells = [result["label"], result["config"]["workload"]["workload"]]
        for name, getter, template, _ in COMPARE_COLUMNS:
            cell = format_cell(getter(metrics), template)
            if result is not results[0] and getter(metrics) is not None and name != "errors":
                cell += f" ({ratio(getter(metrics), getter(baseline))})"
            cells.append(cell)
        rows.append(cells)
    return header, rows


def format_text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A fixed-width table."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(header, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend("  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)) for cells in rows)
    return "\n".join(lines)


def format_markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(str(cell).replace("|", "/") for cell in cells) + " |" for cells in rows)
    return "\n".join(lines)


def plot_comparison(results: Sequence[dict[str, Any]], path: str) -> None:
    """A 2 x 2 PNG: TTFT percentiles, TTFT CDFs, request throughput and cached-token rate per run."""
    plt = import_pyplot()
    labels = [result["label"] for result in results]
    positions = list(range(len(results)))
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    ttft_axis, cdf_axis, throughput_axis, cached_axis = axes.flat
    bar_width = 0.8 / len(PERCENTILES)
    for offset, q in enumerate(PERCENTILES):
        values = [result["metrics"]["ttft_ms"][f"p{q}"] or 0.0 for result in results]
        ttft_axis.bar([p + offset * bar_width for p in positions], values, bar_width, label=f"p{q}")
    ttft_axis.set_xticks([p + bar_width for p in positions], labels, rotation=15, ha="right", fontsize=8)
    ttft_axis.set_ylabel("TTFT (ms)")
    ttft_axis.legend()
    for result in results:
        ttfts = measured_ttfts_ms(result)
        if ttfts:
            draw_cdf(cdf_axis, ttfts, result["label"])
    cdf_axis.legend(fontsize=8)
    throughput_axis.bar(positions, [result["metrics"]["request_throughput"] for result in results])
    throughput_axis.set_xticks(positions, labels, rotation=15, ha="right", fontsize=8)
    throughput_axis.set_ylabel("requests / s")
    cached_axis.bar(positions, [100 * result["metrics"]["cached_token_rate"] for result in results], color="tab:green")
    cached_axis.set_xticks(positions, labels, rotation=15, ha="right", fontsize=8)
    cached_axis.set_ylabel("cached prompt tokens (%)")
    cached_axis.set_ylim(0, 100)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
