"""Router comparison: the same prefixserve app (DP=2 unless --data-parallel-degree), once per request router, on one
shared-system-prompt workload.

Routers (the replica deployment's ``request_router_config``; everything else identical):

    prefix-aware     our PrefixAwareRequestRouter (router/ray_router.py)
    pow2             Serve's default PowerOfTwoChoicesRequestRouter
    round-robin      RoundRobinRequestRouter below
    ray-prefix       Ray's own PrefixCacheAffinityRouter, through TokenPromptAffinityRouter below (a shim that shows
                     it the request's token ids as its "prompt" string: one character per token)
    prefix-aware+copy  our router again with cross-replica prefix copy on (the product default)
    cost-model       ours, the product default (cost model on, peer copy on)
    affinity         ours with --no-router-cost-model (pure affinity with fallback), peer copy on
                     (the measured comparison of issue 12, "cost-aware routing vs pure affinity"; both set through
                     ServeConfig.router_cost_model)
    cost-model-abs4  the product default but with the load bound of sessions 8-13 (balance_abs_threshold 4, now 3;
                     BENCHMARKS.md 0f)
    tier-nocopy      ours, peer copy off, the disk tier on (a fresh folder each run): the router prices the pages the
                     tier holds as fetches (--route-on-tier-contents, the default with copy off)
    blind-nocopy     the same with --no-route-on-tier-contents: the router prices them as recomputed

The disk tier is off in every row but the last two (a fresh folder each run, removed at the end), and peer copy is
off in the first four and the last two, so the cached-token rate shows what routing alone achieves. The KV budget of each replica holds fewer pages than all K system prompts need, but the two
replicas together hold them all: a router must partition the prompts between the replicas to reach the ideal.

Workload: K system prompts of P tokens; N users, N/K per prompt, in seeded random order; each request is its
prompt + a fresh S-token user suffix, O output tokens, greedy, sent as token ids to /v1/completions, C in flight.

    ideal cached-token rate = (N - K) * floor(P / page) * page / sum(prompt tokens)
                              (every prompt computed once in the whole cluster, every later use a hit)

``--workload zipf`` skews it: each request's prompt is drawn (seeded) with probability proportional to
1 / (k + 1) ** ``--zipf-exponent`` (1.5 by default, the zipf-hot point of BENCHMARKS.md section 11: the hottest prompt
takes about half the requests), so one replica's prompt is hot.

``--repeats R`` runs the router list R times, interleaved (A, B, A, B, ...), each run on a fresh deployment (empty
caches) with the same requests; the table has one row per run and one pooled row per router (all its runs' requests).
``--model-dir`` / ``--dtype`` / ``--num-cpus-per-replica`` serve another model (e.g.
benchmarks/.scratch/tiny-llama-512x8 in bfloat16, one CPU per replica) instead of the generated 256 x 4 float32 one.

Usage:
    python benchmarks/router_compare.py [--num-requests 320] [--concurrency 4] [--routers prefix-aware,pow2,...]
    python benchmarks/router_compare.py --routers cost-model,affinity --repeats 2 --workload zipf \
        --model-dir benchmarks/.scratch/tiny-llama-512x8 --dtype bfloat16 --num-cpus-per-replica 1
``--request-rate R``: open loop instead, R requests per second (seeded Poisson arrivals), so a replica's queue can grow
(the closed loop bounds it at ``--concurrency``).
Writes benchmarks/results/router_compare.md and .json (override with --out); ``--smoke`` runs a handful of requests.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import logging
import math
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica  # noqa: E402

# Ray's own prefix-aware router; this internal path is the one that imports without vLLM (ray.serve.llm needs it).
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (  # noqa: E402
    PrefixCacheAffinityRouter,
)

from bench.client import absorb_chunk, parse_sse_data  # noqa: E402
from bench.metrics import percentile, usage_counts  # noqa: E402
from bench.workloads import IdPromptFactory, seeded_rng  # noqa: E402

MODEL_NAME = "tiny-llama-256x4"
PAGE_SIZE = 128
TARGET_RATIO_TO_IDEAL = 0.90
TARGET_BUSIEST_OVER_MEAN = 1.3
RESULTS_DIR = ROOT / "benchmarks" / "results"


# ----------------------------------------------------------------------------------------------------------------
# Routers under comparison (defined here so that only the benchmark knows them; Serve pickles them by value)


class RoundRobinRequestRouter(RequestRouter):
    """Sends request i to replica i mod n (replicas in id order); the others are the fallback tier."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._num_routed = 0

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        chosen = ordered[getattr(self, "_num_routed", 0) % len(ordered)]
        if pending_request is not None:
            self._num_routed = getattr(self, "_num_routed", 0) + 1
        rest = [replica for replica in ordered if replica is not chosen]
        return [[chosen], rest] if rest else [[chosen]]


def token_ids_as_text(token_ids: list[int]) -> str:
    """One character per token id (code points from U+0100, skipping the surrogates): a prefix of the text is
    exactly a prefix of the tokens, so a character-matching router matches on tokens."""
    return "".join(chr(0x100 + i) if 0x100 + i < 0xD800 else chr(0x900 + i) for i in token_ids)


class TokenPromptAffinityRouter(PrefixCacheAffinityRouter):
    """Ray's PrefixCacheAffinityRouter, shown an ``EngineRequest``'s token ids as its prompt text.

    The stock class looks for a ``.prompt`` / ``.messages`` attribute on a handle argument (vLLM's request types) and
    raises ValueError when none has one; our ingress sends token ids (``EngineRequest.prompt_token_ids``). The shim
    only replaces that extraction; routing, the prefix tree actor and its load checks are Ray's own. Calls without
    an EngineRequest (``info()``) return None, which the stock code treats as "no text": plain power of two choices.
    """

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str | None:
        for arg in list(pending_request.args) + list(pending_request.kwargs.values()):
            token_ids = getattr(arg, "prompt_token_ids", None)
            if token_ids:
                return token_ids_as_text(token_ids)
        return None


@dataclass(frozen=True)
class RouterCase:
    name: str
    description: str
    peer_copy: bool
    make_router_config: Callable[[], Any] | None
    """None: build_app's own prefix-aware router config."""
    cost_model: bool = True
    """ServeConfig.router_cost_model (--router-cost-model / --no-router-cost-model)."""
    disk_tier: bool = False
    """The disk KV tier on, in a fresh folder for each run (the replicas share it, as on one node)."""
    tier_routing: bool | None = None
    """ServeConfig.route_on_tier_contents (None: its default, on exactly when peer copy is off and a tier is on)."""


def serve_default_router_config() -> Any:
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig()  # PowerOfTwoChoicesRequestRouter


def round_robin_router_config() -> Any:
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=RoundRobinRequestRouter)


def abs4_router_config() -> Any:
    from router.ray_router import router_config

    return router_config(balance_abs_threshold=4)  # peer hint and cost model on, as build_app's default


def ray_prefix_router_config() -> Any:
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=TokenPromptAffinityRouter)


ROUTER_CASES = {
    case.name: case
    for case in (
        RouterCase("prefix-aware", "ours: PrefixAwareRequestRouter", False, None),
        RouterCase("pow2", "Serve default: PowerOfTwoChoicesRequestRouter", False, serve_default_router_config),
        RouterCase("round-robin", "RoundRobinRequestRouter (this file)", False, round_robin_router_config),
        RouterCase("ray-prefix", "Ray PrefixCacheAffinityRouter (token-id shim)", False, ray_prefix_router_config),
        RouterCase("prefix-aware+copy", "ours, peer copy ON (product default)", True, None),
        RouterCase("cost-model", "ours, cost model ON, peer copy ON (product default)", True, None, True),
        RouterCase("affinity", "ours, --no-router-cost-model, peer copy ON", True, None, False),
        RouterCase("cost-model-abs4", "ours, the product default with balance_abs_threshold 4", True,
                   abs4_router_config, True),
        RouterCase("tier-nocopy", "ours, peer copy OFF, disk tier ON, routing on its contents (the default)", False,
                   None, True, disk_tier=True),
        RouterCase("blind-nocopy", "ours, peer copy OFF, disk tier ON, --no-route-on-tier-contents", False, None,
                   True, disk_tier=True, tier_routing=False),
    )
}


# ----------------------------------------------------------------------------------------------------------------
# Model, workload, deployment


def model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    path = Path(tempfile.gettempdir()) / f"prefixserve-router-compare-llama-{args.hidden_size}x{args.num_layers}"
    if not (path / "config.json").exists():
        from bench.tiny_models import write_tiny_model

        write_tiny_model(path, arch="llama", hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=4,
                         num_kv_heads=2, vocab_size=args.vocab_size, max_position_embeddings=4096, seed=0)
    return path


def model_shape(args: argparse.Namespace) -> dict:
    """Layers, KV heads, head size and vocabulary of the served model (from its config.json)."""
    config = json.loads((model_dir(args) / "config.json").read_text())
    num_heads = config["num_attention_heads"]
    return {"num_layers": config["num_hidden_layers"], "num_kv_heads": config.get("num_key_value_heads", num_heads),
            "head_dim": config.get("head_dim") or config["hidden_size"] // num_heads,
            "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"]}


def kv_bytes_per_page(args: argparse.Namespace) -> int:
    shape = model_shape(args)
    dtype_bytes = 4 if args.dtype == "float32" else 2
    return shape["num_layers"] * 2 * PAGE_SIZE * shape["num_kv_heads"] * shape["head_dim"] * dtype_bytes


@dataclass(frozen=True)
class Request:
    index: int
    prefix: int
    prompt: list[int]


def build_requests(args: argparse.Namespace) -> list[Request]:
    """N/K users per system prompt (rounded up for the first N mod K prompts), shuffled with a seeded generator."""
    factory = IdPromptFactory(vocab_size=args.vocab_size)
    prefixes = [factory.make(args.prefix_len, seeded_rng(args.seed, "prefix", k)) for k in range(args.num_prefixes)]
    if args.workload == "zipf":
        weights = [1.0 / (k + 1) ** args.zipf_exponent for k in range(args.num_prefixes)]
        groups = seeded_rng(args.seed, "zipf").choices(range(args.num_prefixes), weights=weights, k=args.num_requests)
    else:
        groups = [user % args.num_prefixes for user in range(args.num_requests)]
        seeded_rng(args.seed, "order").shuffle(groups)
    return [
        Request(index, group, prefixes[group] + factory.make(args.suffix_len, seeded_rng(args.seed, "suffix", index)))
        for index, group in enumerate(groups)
    ]


def serve_config(args: argparse.Namespace, peer_copy: bool, cost_model: bool = True, disk_tier: bool = False,
                 tier_routing: bool | None = None) -> Any:
    from cluster.config import ServeConfig

    disk: dict[str, Any] = {"enable_disk_cache": False}
    if disk_tier:
        folder = tempfile.mkdtemp(prefix="router-compare-kv-")
        atexit.register(shutil.rmtree, folder, True)
        disk = {"enable_disk_cache": True, "disk_cache_dir": folder, "route_on_tier_contents": tier_routing}
    return ServeConfig(
        model=str(model_dir(args)), devices="cpu", dtype=args.dtype, data_parallel_degree=dp_of(args),
        page_size=PAGE_SIZE,
        kv_cache_memory=args.pages_per_replica * kv_bytes_per_page(args),
        num_cpus_per_replica=args.num_cpus_per_replica, max_model_len=2048, max_num_batched_tokens=2048,
        served_model_name=MODEL_NAME, log_level="warning",
        enable_dp_cross_replica_prefix_copy=peer_copy, router_cost_model=cost_model, **disk,
    )


def dp_of(args: argparse.Namespace) -> int:
    """Replicas per deployment (``--data-parallel-degree``; hot_prefix.py's arguments have none: 2)."""
    return getattr(args, "data_parallel_degree", 2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ray(args: argparse.Namespace) -> int:
    """A fresh local Ray (never an existing cluster) and Serve's proxy on a free port; returns the port."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])  # workers import cluster/replica/router
    import ray
    from ray import serve

    # The replicas reserve --num-cpus-per-replica each; Ray's prefix tree actor needs 1 free to be placed.
    routers = getattr(args, "routers", "").split(",")  # hot_prefix.py runs no router case
    num_cpus = max(2, math.ceil(dp_of(args) * args.num_cpus_per_replica + ("ray-prefix" in routers)))
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="warning",
             log_to_driver=args.verbose)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def deploy(args: argparse.Namespace, case: RouterCase, name: str) -> None:
    from ray import serve

    from cluster.app import build_app

    router = case.make_router_config() if case.make_router_config is not None else None
    config = serve_config(args, case.peer_copy, case.cost_model, case.disk_tier, case.tier_routing)
    serve.run(build_app(config, router_config=router), name=name,
              route_prefix=f"/{name}")


# ----------------------------------------------------------------------------------------------------------------
# Client


@dataclass
class Record:
    index: int
    prefix: int
    warmup: bool
    replica_id: str = ""
    sent_s: float = 0.0
    """Send time, from the start of the phase."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_source: dict[str, int] = field(default_factory=dict)
    error: str | None = None


async def send(client: Any, url: str, prompt: list[int], args: argparse.Namespace, record: Record) -> Record:
    from bench.client import StreamResult

    payload = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = StreamResult()
    start = time.perf_counter()
    last_token_s = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            record.replica_id = response.headers.get("x-prefixserve-replica", "")
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return record
            async for line in response.aiter_lines():
                data = parse_sse_data(line)
                if not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                record.replica_id = record.replica_id or chunk.get("replica_id", "")
                last_token_s = absorb_chunk(result, chunk, time.perf_counter() - start, last_token_s)
    except Exception as exc:  # noqa: BLE001 - recorded per request
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.e2e_s = time.perf_counter() - start
    record.ttft_s = result.ttft_s
    record.error = result.error or (None if result.usage else "no usage in the stream")
    record.prompt_tokens, _, record.cached_tokens, record.cached_by_source = usage_counts(result.usage)
    return record


def arrival_offsets(args: argparse.Namespace, num_requests: int) -> list[float]:
    """Open loop (``--request-rate`` > 0): each request's send time from the start, a seeded Poisson process."""
    rng = seeded_rng(args.seed, "arrivals")
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(args.request_rate)
    return offsets


async def run_load(url: str, requests: list[Request], args: argparse.Namespace, warmup: bool) -> tuple[list, float]:
    """Closed loop: ``concurrency`` requests in flight, started in list order. With ``--request-rate`` (not for the
    warm-up): open loop, each request sent at its Poisson arrival time however many are in flight."""
    import httpx

    open_loop = args.request_rate > 0 and not warmup
    offsets = arrival_offsets(args, len(requests)) if open_loop else None
    in_flight = len(requests) if open_loop else args.concurrency
    limiter = asyncio.Semaphore(in_flight)
    limits = httpx.Limits(max_connections=in_flight + 2, max_keepalive_connections=in_flight + 2)

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, trust_env=False) as client:
        async def one(position: int, request: Request) -> Record:
            if offsets is not None:
                await asyncio.sleep(max(0.0, start + offsets[position] - time.perf_counter()))
            async with limiter:
                record = Record(request.index, request.prefix, warmup, sent_s=time.perf_counter() - start)
                return await send(client, url, request.prompt, args, record)

        start = time.perf_counter()
        records = await asyncio.gather(*(one(position, request) for position, request in enumerate(requests)))
        return list(records), time.perf_counter() - start


def warmup_requests(args: argparse.Namespace) -> list[Request]:
    """Prompts shorter than one page: they warm the replicas (and the HTTP path) but leave no page in any cache."""
    factory = IdPromptFactory(vocab_size=args.vocab_size)
    return [Request(-1 - i, -1, factory.make(PAGE_SIZE - 28, seeded_rng(args.seed, "warmup", i))) for i in range(8)]


# ----------------------------------------------------------------------------------------------------------------
# Metrics


def summarize(case: RouterCase, records: list[Record], duration_s: float, args: argparse.Namespace) -> dict:
    done = [r for r in records if r.error is None]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    cacheable_prefix = (args.prefix_len // PAGE_SIZE) * PAGE_SIZE
    num_prefixes_used = len({r.prefix for r in done})
    ideal_tokens = (len(done) - num_prefixes_used) * cacheable_prefix
    rate = cached_tokens / prompt_tokens if prompt_tokens else 0.0
    ideal = ideal_tokens / prompt_tokens if prompt_tokens else 0.0
    replica_counts = Counter(r.replica_id for r in done)
    num_replicas = dp_of(args)
    per_replica = sorted(replica_counts.values(), reverse=True) + [0] * max(0, num_replicas - len(replica_counts))
    mean_load = len(done) / num_replicas if done else 0.0
    ttfts = sorted(r.ttft_s * 1000.0 for r in done if r.ttft_s is not None)
    by_source: Counter = Counter()
    for r in done:
        by_source.update(r.cached_by_source)
    prefix_to_replicas: dict[int, set] = {}
    for r in done:
        prefix_to_replicas.setdefault(r.prefix, set()).add(r.replica_id)
    spread = sum(len(s) for s in prefix_to_replicas.values()) / len(prefix_to_replicas) if prefix_to_replicas else 0.0
    busiest_over_mean = per_replica[0] / mean_load if mean_load else 0.0
    ratio = rate / ideal if ideal else 0.0
    return {
        "router": case.name,
        "description": case.description,
        "peer_copy": case.peer_copy,
        "num_requests": len(records),
        "num_errors": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cached_tokens_by_source": dict(by_source),
        "cached_token_rate": rate,
        "ideal_cached_token_rate": ideal,
        "ratio_to_ideal": ratio,
        "ttft_p50_ms": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 99) if ttfts else None,
        "requests_per_replica": per_replica,
        "busiest_over_mean": busiest_over_mean,
        "replicas_per_prompt": spread,
        "meets_cache_target": ratio >= TARGET_RATIO_TO_IDEAL,
        "meets_balance_target": busiest_over_mean <= TARGET_BUSIEST_OVER_MEAN,
        "first_errors": [r.error for r in records if r.error][:3],
        "records": compact_records(records, replica_counts),
        "_records": records,
    }


RECORD_FIELDS = "index,prefix,replica,sent_s,ttft_ms,prompt_tokens,cached_local,cached_peer,error,cached_disk"


def compact_records(records: list[Record], replica_counts: Counter) -> list[str]:
    """One line per request (fields in RECORD_FIELDS; replicas named r0, r1 by falling request count)."""
    replica_to_name = {replica: f"r{n}" for n, (replica, _) in enumerate(replica_counts.most_common())}
    lines = []
    for r in sorted(records, key=lambda record: record.sent_s):
        ttft_ms = f"{r.ttft_s * 1000:.1f}" if r.ttft_s is not None else ""
        lines.append(f"{r.index},{r.prefix},{replica_to_name.get(r.replica_id, '?')},{r.sent_s:.3f},{ttft_ms},"
                     f"{r.prompt_tokens},{r.cached_by_source.get('local', 0)},{r.cached_by_source.get('peer', 0)},"
                     f"{'error' if r.error else ''},{r.cached_by_source.get('disk', 0)}")
    return lines


def run_label(row: dict) -> str:
    return f" run {row['run']}" if "run" in row else ""


def format_table(rows: list[dict]) -> str:
    header = ["router", "cached-token rate", "cached local / peer / disk tokens", "ideal", "ratio to ideal", "TTFT p50 ms",
              "TTFT p99 ms", "requests per replica", "busiest / mean", "replicas per prompt", "req/s", "errors",
              "targets"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        targets = ("cache " + ("ok" if row["meets_cache_target"] else "MISS")
                   + ", balance " + ("ok" if row["meets_balance_target"] else "MISS"))
        cells = [
            f"{row['router']}{run_label(row)} ({row['description']})",
            f"{100 * row['cached_token_rate']:.1f}%",
            f"{row['cached_tokens_by_source'].get('local', 0)} / {row['cached_tokens_by_source'].get('peer', 0)} / "
            f"{row['cached_tokens_by_source'].get('disk', 0)}",
            f"{100 * row['ideal_cached_token_rate']:.1f}%",
            f"{row['ratio_to_ideal']:.2f}",
            f"{row['ttft_p50_ms']:.0f}" if row["ttft_p50_ms"] is not None else "-",
            f"{row['ttft_p99_ms']:.0f}" if row["ttft_p99_ms"] is not None else "-",
            " / ".join(str(n) for n in row["requests_per_replica"]),
            f"{row['busiest_over_mean']:.2f}",
            f"{row['replicas_per_prompt']:.2f}",
            f"{row['request_throughput']:.2f}",
            str(row["num_errors"]),
            targets,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def model_description(args: argparse.Namespace) -> str:
    shape = model_shape(args)
    where = f" ({args.model_dir})" if args.model_dir else " (generated)"
    return (f"random-weight Llama{where}, hidden {shape['hidden_size']} x {shape['num_layers']} layers, "
            f"{shape['num_kv_heads']} KV heads x {shape['head_dim']}, vocab {shape['vocab_size']} (prompts drawn from "
            f"the first {args.vocab_size} ids)")


def workload_description(args: argparse.Namespace) -> str:
    if args.workload == "zipf":
        return (f"prompt of each request drawn seeded with weight 1/(k+1)^{args.zipf_exponent:g}, "
                f"k = 0..{args.num_prefixes - 1}: "
                f"requests per prompt {prompt_histogram(args)}")
    return "users spread evenly over the prompts, seeded random order"


def prompt_histogram(args: argparse.Namespace) -> list[int]:
    counts = Counter(request.prefix for request in build_requests(args))
    return [counts.get(k, 0) for k in range(args.num_prefixes)]


def pooled_rows(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """One row per router over all its runs' requests (only with --repeats > 1)."""
    pooled = []
    for name in dict.fromkeys(row["router"] for row in rows):
        runs = [row for row in rows if row["router"] == name]
        if len(runs) < 2:
            continue
        records = [record for row in runs for record in row.pop("_records")]
        row = summarize(ROUTER_CASES[name], records, sum(r["duration_s"] for r in runs), args)
        # per-replica load: the busiest replica of each run against that run's mean, averaged over the runs
        row["busiest_over_mean"] = sum(r["busiest_over_mean"] for r in runs) / len(runs)
        row["requests_per_replica"] = [sum(r["requests_per_replica"][i] for r in runs)
                                       for i in range(dp_of(args))]
        row["replicas_per_prompt"] = sum(r["replicas_per_prompt"] for r in runs) / len(runs)  # ids differ per run
        row["router"] = f"{name} pooled x{len(runs)}"
        ideal_tokens = sum(r["ideal_cached_token_rate"] * r["prompt_tokens"] for r in runs)  # each run starts cold
        row["ideal_cached_token_rate"] = ideal_tokens / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        row["ratio_to_ideal"] = (row["cached_token_rate"] / row["ideal_cached_token_rate"]
                                 if row["ideal_cached_token_rate"] else 0.0)
        row["meets_cache_target"] = row["ratio_to_ideal"] >= TARGET_RATIO_TO_IDEAL
        row["meets_balance_target"] = row["busiest_over_mean"] <= TARGET_BUSIEST_OVER_MEAN
        row.pop("records")
        row.pop("_records")
        pooled.append(row)
    for row in rows:
        row.pop("_records", None)
    return pooled


def write_results(rows: list[dict], args: argparse.Namespace, command: str, wall_s: float) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = (
        f"model: {model_description(args)}, {args.dtype}, {args.num_cpus_per_replica:g} CPU (Ray) and "
        f"{max(1, int(args.num_cpus_per_replica))} torch thread per replica; DP={dp_of(args)} on one host; "
        f"page size {PAGE_SIZE}; "
        f"KV budget {args.pages_per_replica} pages per replica ({args.num_prefixes} prompts x "
        f"{math.ceil(args.prefix_len / PAGE_SIZE)} pages = "
        f"{args.num_prefixes * math.ceil(args.prefix_len / PAGE_SIZE)} pages in all); disk tier off (on in the "
        f"*-nocopy rows), Redis off; peer copy off except where marked.\n"
        f"workload: {args.num_prefixes} system prompts x {args.prefix_len} tokens, {args.num_requests} requests "
        f"({workload_description(args)}, seed {args.seed}), each + a fresh "
        f"{args.suffix_len}-token suffix, {args.output_len} output tokens, greedy, token-id prompts to "
        f"/v1/completions, "
        + (f"open loop at {args.request_rate:g} requests/s (seeded Poisson arrivals)"
           if args.request_rate > 0 else f"concurrency {args.concurrency} (closed loop)")
        + "; 8 sub-page warm-up requests per router "
        f"(not measured, cache nothing). "
        + (f"{args.repeats} runs per router, interleaved in the order of the rows; each run a fresh deployment "
           "(empty caches), the same requests; 'pooled' rows: all runs' requests of that router together."
           if args.repeats > 1 else "")
    )
    text = "\n".join([
        f"# Router comparison (prefixserve, DP={dp_of(args)})",
        "",
        "Command (from the repository root):",
        "",
        f"    {command}",
        "",
        settings,
        "",
        f"Targets: cached-token rate >= {TARGET_RATIO_TO_IDEAL:.0%} of ideal, busiest replica <= "
        f"{TARGET_BUSIEST_OVER_MEAN}x mean load. Ideal = (N - K) x {(args.prefix_len // PAGE_SIZE) * PAGE_SIZE} / "
        "total prompt tokens. 'replicas per prompt' = mean number of replicas that served each system prompt "
        "(1.00 = perfect partition).",
        "",
        format_table(rows),
        "",
        f"Whole run: {wall_s:.0f} s.",
        "",
    ])
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "settings": vars(args), "record_fields": RECORD_FIELDS, "rows": rows}, indent=1,
        default=str))
    print(text)


# ----------------------------------------------------------------------------------------------------------------
# Main


def run_case(args: argparse.Namespace, case: RouterCase, port: int, requests: list[Request], number: int) -> dict:
    from ray import serve

    name = f"rc{number}"
    started = time.perf_counter()
    deploy(args, case, name)
    url = f"http://127.0.0.1:{port}/{name}/v1/completions"
    try:
        warm, _ = asyncio.run(run_load(url, warmup_requests(args), args, warmup=True))
        warm_errors = [r.error for r in warm if r.error]
        if warm_errors:
            raise RuntimeError(f"{case.name}: warm-up failed: {warm_errors[0]}")
        time.sleep(args.settle_s)
        records, duration_s = asyncio.run(run_load(url, requests, args, warmup=False))
    finally:
        serve.delete(name)
    row = summarize(case, records, duration_s, args)
    print(f"[{case.name}] {len(records)} requests in {duration_s:.1f} s (case {time.perf_counter() - started:.0f} s): "
          f"cached {100 * row['cached_token_rate']:.1f}% (ideal {100 * row['ideal_cached_token_rate']:.1f}%), "
          f"per replica {row['requests_per_replica']}, errors {row['num_errors']} {row['first_errors']}", flush=True)
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", default=",".join(ROUTER_CASES), help="comma-separated, in run order")
    parser.add_argument("--num-requests", type=int, default=320)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--request-rate", type=float, default=0.0,
                        help="requests per second, open loop (seeded Poisson arrivals; --concurrency then only "
                             "bounds the warm-up); 0: closed loop")
    parser.add_argument("--pages-per-replica", type=int, default=40)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=("even", "zipf"), default="even",
                        help="even: N/K requests per prompt; zipf: prompt popularity 1/(k+1)^--zipf-exponent")
    parser.add_argument("--zipf-exponent", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=1, help="run the router list this many times, interleaved")
    parser.add_argument("--model-dir", default=None,
                        help="serve this model folder (default: a generated --hidden-size x --num-layers Llama)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--num-cpus-per-replica", type=float, default=0.5)
    parser.add_argument("--data-parallel-degree", type=int, default=2, help="replicas (each --num-cpus-per-replica)")
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause between warm-up and measurement")
    parser.add_argument("--out", default=str(RESULTS_DIR / "router_compare.md"))
    parser.add_argument("--smoke", action="store_true", help="a handful of requests, results to a temp folder")
    parser.add_argument("--verbose", action="store_true", help="show Ray workers' logs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_requests = min(args.num_requests, 12)
        if args.out == parser.get_default("out"):
            args.out = str(Path(tempfile.gettempdir()) / "router_compare_smoke.md")
    unknown = [name for name in args.routers.split(",") if name not in ROUTER_CASES]
    if unknown:
        parser.error(f"unknown router(s) {unknown}; choose from {', '.join(ROUTER_CASES)}")
    if args.request_rate < 0:
        parser.error("--request-rate must be >= 0 (0: closed loop)")
    if args.hidden_size % 4:
        parser.error("--hidden-size must be a multiple of 4 (4 attention heads)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    command = "python benchmarks/router_compare.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started = time.perf_counter()
    model_dir(args)
    requests = build_requests(args)
    import ray
    from ray import serve

    port = start_ray(args)
    rows = []
    order = args.routers.split(",") * args.repeats  # A, B, A, B: noise on the shared box hits every router
    try:
        for number, name in enumerate(order):
            rows.append(run_case(args, ROUTER_CASES[name], port, requests, number))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    for number, row in enumerate(rows):
        row["run"] = number
    rows = rows + pooled_rows(rows, args)
    write_results(rows, args, command.strip(), time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
