"""The ``prefixserve bench`` command line (also ``python -m bench``): its flags, and ``bench compare``.

Usage::

    prefixserve bench --base-url http://127.0.0.1:8000 --workload shared-prefix --num-prefixes 4 \\
        --prefix-len 1792 --suffix-len 256 --output-len 32 --num-requests 40 --concurrency 4 \\
        --warmup-requests 4 --result-file out.json --plot ttft.png
    prefixserve bench compare prefixserve.json vllm.json --plot compare.png --markdown compare.md

A failed request is counted and recorded, never fatal; the command exits 1 only when no measured request succeeded,
and 2 on a usage error or when the server's model cannot be listed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Sequence

from bench import workloads as wl
from bench.config import ENDPOINTS, ClientConfig, LoadConfig
from bench.report import (
    compare_rows,
    format_markdown_table,
    format_run_table,
    format_text_table,
    plot_comparison,
    plot_ttft,
    print_errors,
)
from bench.result import load_result, write_json
from bench.runner import run_benchmark
from bench.workloads import WorkloadConfig


def parse_output_range(text: str) -> tuple[int, int]:
    """``"a:b"`` -> (a, b)."""
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a:b with integers, got {text!r}") from exc
    return low, high


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``prefixserve bench`` flags."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    server.add_argument("--model", default=None, help="model name to send (default: first id from /v1/models)")
    server.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    server.add_argument("--api-key", default=None, help="sent as a Bearer token")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    server.add_argument("--return-token-ids", action="store_true",
                        help="ask for generated token ids (vLLM); multi-turn id prompts then resend the exact answer")
    server.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", choices=wl.WORKLOADS + wl.STANDARD_WORKLOAD_NAMES, default="shared-prefix",
                          help="ours, or another project's named workload with its published parameters "
                               "(bench/standard_workloads.py; the flags below override them)")
    workload.add_argument("--num-requests", type=int, default=40)
    workload.add_argument("--num-prefixes", type=int, default=4, help="K distinct prefixes / system prompts")
    workload.add_argument("--prefix-len", type=int, default=1792, help="P: tokens per shared prefix")
    workload.add_argument("--suffix-len", type=int, default=256, help="S: tokens per request suffix / user turn")
    workload.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    workload.add_argument("--replica-cache-tokens", type=int, default=None,
                          help="cross-replica: one replica's cache size; K becomes 2 x ceil(this / P)")
    workload.add_argument("--output-len", type=int, default=32)
    workload.add_argument("--output-len-range", type=parse_output_range, default=None,
                          help="a:b, output lengths drawn uniformly (seeded) from [a, b]")
    workload.add_argument("--prompt-format", choices=wl.PROMPT_FORMATS, default=None,
                          help="token ids (default for completions) or words (default for chat)")
    workload.add_argument("--tokenizer", default=None, help="local HF tokenizer folder for exact token counts")
    workload.add_argument("--vocab-size", type=int, default=None,
                          help="id prompts draw ids from [100, this - 100) (default: the tokenizer's size, else 1024)")
    workload.add_argument("--seed", type=int, default=0)
    add_standard_workload_arguments(parser)
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=4, help="requests in flight at most (0: unlimited)")
    load.add_argument("--request-rate", type=float, default=math.inf, help="sessions per second, Poisson (default inf)")
    load.add_argument("--warmup-requests", type=int, default=0, help="unmeasured requests of the same shape first")
    output = parser.add_argument_group("output")
    output.add_argument("--result-file", default=None, help="write the JSON result here")
    output.add_argument("--plot", default=None, help="write a PNG of the TTFT distribution here")
    output.add_argument("--label", default=None, help="name of this run in tables and charts")
    output.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


STANDARD_FLAGS = {
    "generated-shared-prefix": ("SGLang bench_serving", "gsp", {
        "num_groups": ("--gsp-num-groups", int), "prompts_per_group": ("--gsp-prompts-per-group", int),
        "system_prompt_len": ("--gsp-system-prompt-len", int), "question_len": ("--gsp-question-len", int),
        "output_len": ("--gsp-output-len", int)}),
    "prefix-repetition": ("vLLM bench serve; requests: --num-requests", "prefix_repetition", {
        "prefix_len": ("--prefix-repetition-prefix-len", int), "suffix_len": ("--prefix-repetition-suffix-len", int),
        "num_prefixes": ("--prefix-repetition-num-prefixes", int),
        "output_len": ("--prefix-repetition-output-len", int)}),
    "shared-prefix-groups": ("llm-d-benchmark / inference-perf shared_prefix", "shared_prefix", {
        "num_groups": ("--shared-prefix-num-groups", int),
        "num_prompts_per_group": ("--shared-prefix-num-prompts-per-group", int),
        "system_prompt_len": ("--shared-prefix-system-prompt-len", int),
        "question_len": ("--shared-prefix-question-len", int), "output_len": ("--shared-prefix-output-len", int)}),
    "multi-round-qa": ("LMCache multi-round-qa", "mrqa", {
        "num_users": ("--num-users", int), "num_rounds": ("--num-rounds", int), "qps": ("--qps", float),
        "shared_system_prompt": ("--shared-system-prompt", int), "user_history_prompt": ("--user-history-prompt", int),
        "answer_len": ("--answer-len", int), "question_len": ("--question-len", int)}),
    "mooncake-trace": ("Mooncake trace replay", "trace", {
        "trace_file": ("--trace-file", str), "time_scale": ("--trace-time-scale", float),
        "block_size": ("--trace-block-size", int), "max_requests": ("--trace-max-requests", int)}),
}
"""Per standard workload: (origin, dest prefix, parameter -> (flag, type)); defaults are the published ones."""


def add_standard_workload_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.standard_workloads import STANDARD_WORKLOADS

    for workload, (origin, prefix, params) in STANDARD_FLAGS.items():
        group = parser.add_argument_group(f"--workload {workload} ({origin})")
        defaults = STANDARD_WORKLOADS[workload]()
        for name, (flag, kind) in params.items():
            default = getattr(defaults, name)
            group.add_argument(flag, dest=f"{prefix}__{name}", type=kind, default=None, metavar=name.upper(),
                               help=f"default {default}" if default not in ("", None) else None)


def standard_params(args: argparse.Namespace):
    """The chosen standard workload's parameters (published defaults, overridden by the flags given), or None."""
    from bench.standard_workloads import make_params

    if args.workload not in STANDARD_FLAGS:
        return None
    _, prefix, params = STANDARD_FLAGS[args.workload]
    return make_params(args.workload, {name: getattr(args, f"{prefix}__{name}") for name in params})


def configs_from_args(args: argparse.Namespace) -> tuple[ClientConfig, LoadConfig, WorkloadConfig, str]:
    """The frozen configs a parsed command line describes, and the prompt format."""
    prompt_format = args.prompt_format or ("text" if args.endpoint == "chat" else "ids")
    if args.endpoint == "chat" and prompt_format == "ids":
        raise ValueError("--endpoint chat sends text: use --prompt-format text (with --tokenizer for exact lengths)")
    extra_body = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    client_config = ClientConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
        timeout_s=args.timeout, return_token_ids=args.return_token_ids, extra_body=extra_body,
    )
    load_config = LoadConfig(
        concurrency=args.concurrency, request_rate=args.request_rate, warmup_requests=args.warmup_requests,
        seed=args.seed,
    )
    workload_config = WorkloadConfig(
        workload=args.workload, num_requests=args.num_requests, num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len, output_len=args.output_len,
        output_len_range=args.output_len_range, num_turns=args.num_turns,
        replica_cache_tokens=args.replica_cache_tokens, seed=args.seed, standard=standard_params(args),
    )
    return client_config, load_config, workload_config, prompt_format


def run_main(argv: Sequence[str] | None) -> int:
    """``prefixserve bench ...``: run one benchmark and report it."""
    parser = add_arguments(argparse.ArgumentParser(
        prog="prefixserve bench",
        description="Benchmark an OpenAI-compatible server (subcommand: compare A.json B.json ...).",
    ))
    args = parser.parse_args(argv)
    try:
        client_config, load_config, workload_config, prompt_format = configs_from_args(args)
        tokenizer = wl.load_tokenizer(args.tokenizer) if args.tokenizer else None
        factory = wl.make_prompt_factory(prompt_format, args.vocab_size, tokenizer)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    try:
        run = asyncio.run(run_benchmark(
            client_config, load_config, workload_config, factory, tokenizer, args.label, not args.no_progress
        ))
    except RuntimeError as exc:
        print(f"prefixserve bench: {exc}", file=sys.stderr)
        return 2
    run.tokenizer_path = args.tokenizer
    result = run.to_json()
    print(format_run_table(result))
    print_errors(run.records)
    if args.result_file:
        write_json(args.result_file, result)
        print(f"result written to {args.result_file}")
    if args.plot:
        plot_ttft(result, args.plot)
        print(f"TTFT plot written to {args.plot}")
    return 0 if run.metrics.num_completed > 0 or run.metrics.num_requests == 0 else 1


# ----------------------------------------------------------------------------------------------------------------
# bench compare


def compare_main(argv: Sequence[str]) -> int:
    """``prefixserve bench compare A.json B.json ... [--plot out.png] [--markdown out.md]``."""
    parser = argparse.ArgumentParser(
        prog="prefixserve bench compare", description="Compare result files (ratios are to the first file)."
    )
    parser.add_argument("results", nargs="+", help="result files written by prefixserve bench --result-file")
    parser.add_argument("--plot", default=None, help="write a comparison chart (PNG) here")
    parser.add_argument("--markdown", default=None, help="also write the table as markdown here")
    parser.add_argument("--labels", default=None, help="comma-separated labels replacing the files' own")
    args = parser.parse_args(argv)
    results = [load_result(path) for path in args.results]
    if args.labels:
        for result, label in zip(results, args.labels.split(",")):
            result["label"] = label.strip()
    header, rows = compare_rows(results)
    print(format_text_table(header, rows))
    if args.markdown:
        Path(args.markdown).write_text(format_markdown_table(header, rows) + "\n", encoding="utf-8")
    if args.plot:
        plot_comparison(results, args.plot)
        print(f"chart written to {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``compare ...`` compares result files; anything else runs a benchmark."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    return run_main(argv)
