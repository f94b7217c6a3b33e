"""The router simulator's calibration error: scaled-down workloads run for real on a DP=2..4 prefixserve cluster on this
box (through ``prefixserve bench``'s Python API) and replayed, request for request, in the simulator
(benchmarks/router_sim/) with a cost model measured on the same cluster; plus the hot-prefix demonstration (one
prefix's demand above one replica's: does the second replica get its pages by peer copy?).

    PYTHONPATH=. .venv/bin/python benchmarks/sim_calibration.py [--dp 2,3,4] [--workloads NAME,...] [--repeats 2]
        [--dtype bfloat16] [--model-dir benchmarks/.scratch/tiny-llama-512x8] [--config-label main]
        [--serve-config '{"field": value}'] [--hot-prefix] [--out benchmarks/results/sim_calibration]

What one run does:

1. Starts a local Ray (``--ray-cpus``, default 2: the box's cores) and, per DP, deploys the prefixserve app (tiny Llama
   512 x 8, page size 128, prefix caching and peer copy on, disk tier off, no Redis, eager, each replica reserving
   ``ray_cpus / DP`` CPUs and one torch thread). ``--serve-config`` overrides ServeConfig fields (e.g. a later
   hot-prefix replication flag) and ``--config-label`` names that configuration in the results.
2. Calibration (first DP only, or ``--calibration FILE``): pinned requests (``x-prefixserve-target-replica``) on an
   otherwise idle cluster measure TTFT for 64 new tokens, 64 new after 2048 cached, 2048 cold, and after 2048 tokens
   copied from the peer, and the time per output token at batch 1 (short and long context) and batch 4. The cost
   model's numbers are fitted through these points (:func:`fit_costs`).
3. Per DP and workload point (prefix caches reset before each): the workload runs through
   ``bench.runner.run_benchmark``; an httpx transport records which replica served each prompt. The exact prompts are
   rebuilt from the workload's seeds (:func:`rebuild_requests`, checked against what was sent), written as a
   simulator trace with the measured send times, and simulated with the real router code (``prefixserve`` policy with
   the cluster's PolicyConfig): ``timed`` (the real send times), with and without the replicas sharing the cores, and
   ``closed`` (the bench client's concurrency, a prediction that does not see the real run's timing).
4. Writes OUT.json (everything) and OUT.md (the tables), and prints them.

Numbers on a shared 2-core box are noisy; each point runs ``--repeats`` times.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.workloads import IdPromptFactory, WorkloadConfig, build_sessions, seeded_rng  # noqa: E402
from benchmarks.router_sim.costs import CostModel  # noqa: E402
from benchmarks.router_sim.trace import load_trace, trace_row  # noqa: E402
from benchmarks.standard_workloads import SCALED  # noqa: E402  (the same points as BENCHMARKS.md section 9)

PAGE_SIZE = 128
VOCAB = 8192
NAMED = ("generated-shared-prefix", "prefix-repetition", "shared-prefix-groups", "multi-round-qa", "zipf-hot")

ZIPF = dict(num_requests=48, num_prefixes=8, exponent=1.5, prefix_blocks=2, block_size=512, question_len=128,
            output_len=16, rate=6.0)
"""Zipf hot prefix as a Mooncake-format trace: prefix k (2 x 512 tokens) drawn with weight 1 / (k + 1)^1.5 (the
hottest ~49% of requests), a 128-token question each, Poisson arrivals at ``rate`` per second."""
HOT = dict(num_requests=64, num_prefixes=4, exponent=3.0, prefix_blocks=2, block_size=512, question_len=128,
           output_len=32, rate=12.0, lead_s=2.0)
"""The hot-prefix demonstration: ~84% of requests on one prefix, arriving faster than one replica serves them; the
first request (the hot prefix, alone) gets ``lead_s`` to compute and publish its pages before the rest arrive.
``hot-prefix-burst`` is the same without the lead (the burst arrives while the prefix is still being computed)."""


# ----------------------------------------------------------------------------------------------------------------
# Pure logic (tested in tests/test_sim_calibration.py)


def prompt_digest(token_ids: Sequence[int]) -> str:
    return hashlib.blake2b(",".join(str(int(t)) for t in token_ids).encode(), digest_size=12).hexdigest()


def zipf_trace_rows(num_requests: int, num_prefixes: int, exponent: float, prefix_blocks: int, block_size: int,
                    question_len: int, output_len: int, rate: float, seed: int = 0, lead_s: float = 0.0) -> list[dict]:
    """A Mooncake-format trace (bench's ``mooncake-trace`` workload): request i uses prefix k ~ Zipf(exponent)
    (hash ids ``k * prefix_blocks ...``) plus one block of its own, cut to ``prefix + question_len`` tokens;
    Poisson arrivals at ``rate`` per second (timestamps in ms). ``lead_s`` > 0: request 0 is the hottest prefix, alone,
    and the others start ``lead_s`` later."""
    rng = random.Random(f"zipf-trace/{seed}")
    weights = [1.0 / (rank + 1) ** exponent for rank in range(num_prefixes)]
    rows, now = [], 0.0
    for number in range(num_requests):
        prefix = rng.choices(range(num_prefixes), weights)[0]
        if lead_s > 0 and number == 0:
            prefix = 0
        elif lead_s > 0 and number == 1:
            now = lead_s
        hash_ids = [prefix * prefix_blocks + block for block in range(prefix_blocks)]
        hash_ids.append(1_000_000 + number)
        rows.append({"timestamp": round(now * 1000.0, 3), "input_length": prefix_blocks * block_size + question_len,
                     "output_length": output_len, "hash_ids": hash_ids})
        now += rng.expovariate(rate)
    return rows


def rebuild_requests(workload_config: WorkloadConfig, factory: IdPromptFactory,
                     completion_tokens: dict[int, int]) -> list[dict]:
    """Every request the bench runner sent for ``workload_config`` (id prompts, completions endpoint): its index,
    session, turn, exact prompt token ids, output length and pacing. Later turns resend the conversation with the
    runner's stand-in answer (``completion_tokens[request_index]`` seeded ids, as bench.runner.answer_piece makes
    them when the server returns no token ids)."""
    out = []
    for session in build_sessions(workload_config, factory):
        prompt = list(session.system)
        for number, turn in enumerate(session.turns):
            prompt = prompt + list(turn.user)
            out.append({"request_index": turn.request_index, "session": session.session_id, "turn": number,
                        "prompt": list(prompt), "output_len": turn.output_len, "min_gap_s": turn.min_gap_s,
                        "group": session.group, "intended_s": session.start_s or 0.0})
            if number + 1 < len(session.turns):
                rng = seeded_rng(workload_config.seed, "answer", session.session_id, number)
                prompt = prompt + list(factory.make(completion_tokens.get(turn.request_index, turn.output_len), rng))
    return sorted(out, key=lambda item: item["request_index"])


def trace_rows(requests: Sequence[dict], records: Sequence[Any], page_size: int, timing: str = "measured") -> list[dict]:
    """Simulator trace rows (benchmarks/router_sim/trace.py) of the successful measured requests, at their measured
    send times (``timing="measured"``) or at their sessions' intended start times (``"intended"``: what the client
    meant to send, for the simulator's closed loop; bench sends every session at 0 unless it has its own start)."""
    by_index = {record.request_index: record for record in records if not record.warmup}
    rows = []
    for request in requests:
        record = by_index.get(request["request_index"])
        if record is None or not record.success:
            continue
        at = record.start_s if timing == "measured" else request["intended_s"]
        rows.append(trace_row(f"r{request['request_index']}", request["session"], request["turn"], at,
                              request["prompt"], request["output_len"], page_size, request["min_gap_s"]))
    return rows


def relative_error(simulated: float | None, measured: float | None) -> float | None:
    """(simulated - measured) / measured; None when either is missing or measured is 0."""
    if simulated is None or measured is None or measured == 0 or not math.isfinite(simulated):
        return None
    return (simulated - measured) / measured


def calibration_errors(measured: dict, simulated: dict,
                       metrics: Iterable[str] = ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "busiest_over_mean",
                                                 "peer_share")) -> dict:
    """Per metric: measured, simulated, ratio (simulated / measured) and relative error."""
    out = {}
    for name in metrics:
        real, sim = measured.get(name), simulated.get(name)
        error = relative_error(sim, real)
        out[name] = {"measured": real, "simulated": sim, "ratio": None if error is None else 1.0 + error,
                     "rel_error": error}
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (bench.metrics' definition), None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


COLD_LENGTHS = (64, 512, 1024, 2048)
WARM_CONTEXTS = (1024, 2048)
WARM_NEW = 64


def fit_costs(points: dict, page_size: int = PAGE_SIZE, base: CostModel | None = None) -> tuple[CostModel, dict]:
    """The cost model through the measured points (milliseconds):

        ttft_cold_N   N new tokens, nothing cached (N in COLD_LENGTHS)     = K + p N + a N^2 / 2
        ttft_warm_C   64 new after C cached (C in WARM_CONTEXTS)           = K + 64 p + a 64 (C + 32) + h C
        ttft_peer     64 new after 2048 tokens copied from a peer          = ttft_warm_2048 - 2048 h + 16 x copy_page
        tpot_b1       batch 1, context ~ctx_short                          = step + row + c ctx_short
        tpot_b1_long  batch 1, context ~ctx_long                           = step + row + c ctx_long
        tpot_b4       batch 4, context ~ctx_short                          = step + 4 (row + c ctx_short)

    K, p (prefill per token), a (attention per token pair) by least squares over the cold points; h (per cached
    token reused) from the warm points' residuals; c (decode per context token), row (decode per request) and step
    from the decode points. ``request_overhead_ms`` = K - step: time before the engine works on the request (HTTP,
    ingress, routing) and the first token's way back. Negative fits are clamped to 0."""
    import numpy

    base = base or CostModel()
    lengths = [n for n in COLD_LENGTHS if f"ttft_cold_{n}" in points]
    matrix = numpy.array([[1.0, n, n * n / 2.0] for n in lengths])
    measured = numpy.array([points[f"ttft_cold_{n}"] for n in lengths])
    (constant, prefill_ms, attention_ms), *_ = numpy.linalg.lstsq(matrix, measured, rcond=None)
    prefill_ms, attention_ms = max(0.0, float(prefill_ms)), max(0.0, float(attention_ms))
    constant = float(numpy.mean(measured - prefill_ms * matrix[:, 1] - attention_ms * matrix[:, 2]))
    residuals = {}
    for context in WARM_CONTEXTS:
        if f"ttft_warm_{context}" in points:
            model = constant + WARM_NEW * prefill_ms + attention_ms * WARM_NEW * (context + WARM_NEW / 2)
            residuals[context] = points[f"ttft_warm_{context}"] - model
    cached_ms = max(0.0, sum(r / c for c, r in residuals.items()) / len(residuals)) if residuals else 0.0
    ctx_short, ctx_long = points["ctx_short"], points["ctx_long"]
    context_ms = max(0.0, (points["tpot_b1_long"] - points["tpot_b1"]) / (ctx_long - ctx_short))
    row_ms = max(0.0, (points["tpot_b4"] - points["tpot_b1"]) / 3.0 - context_ms * ctx_short)
    step_ms = max(0.0, points["tpot_b1"] - row_ms - context_ms * ctx_short)
    overhead_ms = max(0.0, constant - step_ms)
    # the simulator charges h only for local pages: the peer point is the warm one without h, plus the copy
    copy_ms = max(0.0, (points["ttft_peer"] - points["ttft_warm_2048"] + cached_ms * 2048) / (2048 // page_size))
    cost = dataclasses.replace(base, step_ms=step_ms, prefill_token_ms=prefill_ms,
                               attention_pair_us=attention_ms * 1e3, decode_row_ms=row_ms,
                               decode_context_us=context_ms * 1e3, peer_copy_page_ms=copy_ms,
                               cached_token_us=cached_ms * 1e3, request_overhead_ms=overhead_ms)
    fitted_cold = {n: constant + prefill_ms * n + attention_ms * n * n / 2 for n in lengths}
    return cost, {"ttft_constant_ms": constant, "overhead_ms": overhead_ms,
                  "cold_fit_residual_ms": {n: points[f"ttft_cold_{n}"] - fitted_cold[n] for n in lengths},
                  "warm_residual_before_h_ms": residuals}


# ----------------------------------------------------------------------------------------------------------------
# Recording which replica served each prompt


def make_recording_client(concurrency: int, served: dict, timeout_s: float = 600.0):
    """An httpx.AsyncClient whose transport notes, per prompt digest, the replica_id of the response stream."""
    import httpx

    class Tee(httpx.AsyncByteStream):
        def __init__(self, inner, digest: str) -> None:
            self.inner, self.digest, self.head = inner, digest, b""

        async def __aiter__(self):
            async for chunk in self.inner:
                if self.digest and len(self.head) < 8192:
                    self.head += chunk
                    found = re.search(rb'"replica_id":"([^"]+)"', self.head)
                    if found:
                        served[self.digest] = found.group(1).decode()
                        self.digest = ""
                yield chunk

        async def aclose(self) -> None:
            await self.inner.aclose()

    class Recording(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None))

        async def handle_async_request(self, request):
            digest = ""
            if request.method == "POST" and request.url.path.endswith("/completions"):
                body = json.loads(request.content)
                if isinstance(body.get("prompt"), list):
                    digest = prompt_digest(body["prompt"])
            response = await self.inner.handle_async_request(request)
            if digest:
                response.stream = Tee(response.stream, digest)
            return response

        async def aclose(self) -> None:
            await self.inner.aclose()

    return httpx.AsyncClient(transport=Recording(), timeout=httpx.Timeout(timeout_s, connect=30.0), trust_env=False)


# ----------------------------------------------------------------------------------------------------------------
# The real cluster


def cpu_description() -> dict:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"model": platform.processor() or "unknown", "cpus": os.cpu_count(), "flags": []}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return {"model": fields.get("Model name", "?").strip(), "cpus": fields.get("CPU(s)", "?").strip(),
            "flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]}


def load_average() -> list[float]:
    return [round(value, 1) for value in os.getloadavg()]


def ensure_model(model_dir: Path) -> None:
    if (model_dir / "config.json").exists():
        return
    subprocess.run([sys.executable, "-m", "bench.tiny_models", "--out", str(model_dir), "--arch", "llama",
                    "--hidden-size", "512", "--num-layers", "8", "--num-heads", "8", "--num-kv-heads", "4",
                    "--vocab-size", str(VOCAB)], check=True, cwd=ROOT)


def parse_metrics(text: str) -> dict:
    """{(name, frozenset(labels)): value} of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)', line)
        if not match:
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(3) or ""))
        try:
            out[(match.group(1), labels)] = float(match.group(4))
        except ValueError:
            continue
    return out


def per_replica(before: dict, after: dict, name: str, extra: str | None = None) -> dict:
    """Counter increase per replica (and per ``extra`` label value when given)."""
    out: dict = {}
    for (metric, labels), value in after.items():
        if metric != name:
            continue
        labels_dict = dict(labels)
        key = labels_dict.get("replica", "?") if extra is None else (labels_dict.get("replica", "?"),
                                                                    labels_dict.get(extra, "?"))
        out[key] = out.get(key, 0.0) + value - before.get((metric, labels), 0.0)
    return out


class Cluster:
    def __init__(self, args: argparse.Namespace) -> None:
        import httpx

        self.args = args
        self.port = 0
        self.http = httpx.Client(timeout=120.0, trust_env=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import ray
        from ray import serve

        from tests.conftest import find_free_port

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        ray.init(num_cpus=self.args.ray_cpus, include_dashboard=False, logging_level="warning")
        self.port = find_free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})

    def deploy(self, dp: int) -> None:
        from ray import serve

        from cluster.app import build_app
        from cluster.config import ServeConfig

        fields = dict(model=str(self.args.model_dir), devices="cpu", data_parallel_degree=dp, page_size=PAGE_SIZE,
                      kv_cache_memory=self.args.kv_cache_memory, num_cpus_per_replica=self.args.ray_cpus / dp,
                      served_model_name="calib", max_model_len=4096, enable_prefix_caching=True,
                      enable_disk_cache=False, dtype=self.args.dtype, enforce_eager=True)
        fields.update(json.loads(self.args.serve_config or "{}"))
        serve.run(build_app(ServeConfig(**fields)), name="calib", route_prefix="/")
        self.wait_replicas(dp)

    def undeploy(self) -> None:
        from ray import serve

        serve.delete("calib")

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    def metrics(self) -> dict:
        return parse_metrics(self.http.get(self.base_url + "/metrics").text)

    def replica_ids(self) -> list[str]:
        return sorted({dict(labels)["replica"] for (name, labels) in self.metrics()
                       if name == "prefixserve_kv_pages" and "replica" in dict(labels)})

    def wait_replicas(self, dp: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if len(self.replica_ids()) >= dp:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{dp} replicas did not report within {timeout_s} s")

    def pages_per_replica(self) -> int:
        totals = [v for (name, labels), v in self.metrics().items()
                  if name == "prefixserve_kv_pages" and dict(labels).get("state") == "total"]
        return int(min(totals))

    def reset(self) -> None:
        self.http.post(self.base_url + "/reset_prefix_cache").raise_for_status()
        time.sleep(1.5)  # the routers' index hears of it with the next stats period

    def complete(self, prompt: list[int], max_tokens: int, target: str | None = None) -> dict:
        """One streamed completion; TTFT and mean time per output token (ms), usage and replica."""
        headers = {"x-prefixserve-target-replica": target} if target else {}
        body = {"model": "calib", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        times, usage, replica = [], None, None
        with self.http.stream("POST", self.base_url + "/v1/completions", json=body, headers=headers) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                replica = chunk.get("replica_id", replica)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):
                    times.append(time.perf_counter() - start)
        tpot = (times[-1] - times[0]) / (len(times) - 1) * 1000.0 if len(times) > 1 else None
        return {"ttft_ms": times[0] * 1000.0, "tpot_ms": tpot, "usage": usage, "replica": replica}


def calibrate(cluster: Cluster, repeats: int = 3) -> dict:
    """The points :func:`fit_costs` needs, medians of ``repeats`` (fresh prompts each time), on replicas A and B."""
    import concurrent.futures

    replica_a, replica_b = cluster.replica_ids()[:2]
    rng = random.Random("calibration")

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, VOCAB - 100) for _ in range(n)]

    for _ in range(2):  # warm the path
        cluster.complete(fresh(256), 4, replica_a)
        cluster.complete(fresh(256), 4, replica_b)
    samples: dict = {key: [] for key in [f"ttft_cold_{n}" for n in COLD_LENGTHS] + [
        f"ttft_warm_{c}" for c in WARM_CONTEXTS] + ["ttft_peer", "tpot_b1", "tpot_b1_long", "tpot_b4"]}
    peer_tokens = []
    for _ in range(repeats):
        for n in COLD_LENGTHS:
            samples[f"ttft_cold_{n}"].append(cluster.complete(fresh(n), 1, replica_a)["ttft_ms"])
        for context in WARM_CONTEXTS:
            prefix = fresh(context)
            cluster.complete(prefix + fresh(WARM_NEW), 1, replica_a)
            samples[f"ttft_warm_{context}"].append(cluster.complete(prefix + fresh(WARM_NEW), 1, replica_a)["ttft_ms"])
        time.sleep(1.5)  # the router's index learns A's pages
        peer = cluster.complete(prefix + fresh(WARM_NEW), 1, replica_b)
        samples["ttft_peer"].append(peer["ttft_ms"])
        peer_tokens.append(peer["usage"]["prompt_tokens_details"].get("cached_tokens_by_source", {}).get("peer", 0))
        samples["tpot_b1"].append(cluster.complete(fresh(128), 33, replica_a)["tpot_ms"])
        samples["tpot_b1_long"].append(cluster.complete(fresh(2048), 33, replica_a)["tpot_ms"])
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            prompts = [fresh(128) for _ in range(4)]
            results = list(pool.map(lambda p: cluster.complete(p, 65, replica_a), prompts))
        samples["tpot_b4"].append(sorted(r["tpot_ms"] for r in results)[len(results) // 2])
    points = {key: percentile(values, 50) for key, values in samples.items()}
    points.update(ctx_short=128 + 16, ctx_long=2048 + 16)
    return {"points": points, "samples": samples, "peer_tokens": peer_tokens, "load_average": load_average()}


# ----------------------------------------------------------------------------------------------------------------
# One workload point


def workload_config(name: str, seed: int, trace_dir: Path) -> tuple[WorkloadConfig, int, dict]:
    """(config, concurrency, description) of a named point."""
    from bench.standard_workloads import make_params

    if name in SCALED:
        params = make_params(name, SCALED[name])
        return WorkloadConfig(workload=name, num_requests=40, standard=params, seed=seed), 4, SCALED[name]
    shape = ZIPF if name == "zipf-hot" else HOT if name == "hot-prefix" else {**HOT, "lead_s": 0.0}
    path = trace_dir / f"{name}-{seed}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in zipf_trace_rows(seed=seed, **shape)))
    params = make_params("mooncake-trace", {"trace_file": str(path), "block_size": shape["block_size"]})
    return WorkloadConfig(workload="mooncake-trace", num_requests=shape["num_requests"], standard=params,
                          seed=seed), 0, shape


def measured_summary(run: Any, requests: list[dict], served: dict, replica_ids: list[str], before: dict,
                     after: dict) -> dict:
    metrics = run.metrics
    records = [r for r in run.records if r.success]
    by_source = dict(metrics.cached_tokens_by_source)
    digest_of = {r["request_index"]: prompt_digest(r["prompt"]) for r in requests}
    replica_of = {r.request_index: served.get(digest_of.get(r.request_index, "")) for r in records}
    counts = {replica: 0 for replica in replica_ids}
    for replica in replica_of.values():
        if replica is not None:
            counts[replica] = counts.get(replica, 0) + 1
    mean = sum(counts.values()) / max(len(counts), 1)
    routed = per_replica(before, after, "prefixserve_routing_decisions_total")
    sources = per_replica(before, after, "prefixserve_cached_prompt_tokens_total", "source")
    prompt_tokens = max(metrics.prompt_tokens, 1)
    return {
        "requests": metrics.num_completed, "errors": metrics.num_errors,
        "hit_rate": metrics.cached_tokens / prompt_tokens,
        "local_rate": by_source.get("local", 0) / prompt_tokens,
        "peer_share": by_source.get("peer", 0) / prompt_tokens,
        "by_source": by_source,
        "ttft_p50_ms": metrics.ttft_ms.p50, "ttft_p99_ms": metrics.ttft_ms.p99, "ttft_mean_ms": metrics.ttft_ms.mean,
        "requests_per_replica": counts,
        "busiest_over_mean": max(counts.values()) / mean if mean else None,
        "matched_to_replica": sum(1 for v in replica_of.values() if v is not None),
        "metrics_requests_per_replica": {r: v for r, v in routed.items()},
        "metrics_sources_per_replica": {f"{r}/{s}": v for (r, s), v in sources.items() if v},
        "fetch_per_replica": {field: {f"{r}/{s}": v for (r, s), v in per_replica(
            before, after, f"prefixserve_kv_fetch_{field}_total", "source").items() if v}
            for field in ("pages", "seconds", "errors")},
        "duration_s": metrics.duration_s,
        "per_request": [{"i": r.request_index, "group": r.group, "replica": replica_of.get(r.request_index),
                         "ttft_ms": r.ttft_s * 1000.0, "cached": r.cached_tokens,
                         "by_source": r.cached_tokens_by_source, "prompt": r.prompt_tokens} for r in records],
    }


def simulate_trace(rows: list[dict], dp: int, cost: CostModel, num_pages: int, *, mode: str, concurrency: int,
                   cores: float, policy_kwargs: dict) -> dict:
    from benchmarks.router_sim.sim import Simulation

    workload = load_trace(rows, PAGE_SIZE, mode=mode, num_pages_per_replica=num_pages)
    simulation = Simulation(workload, "prefixserve", dp, cost, concurrency=concurrency if mode == "closed" else 0,
                            cores=cores, policy_kwargs=policy_kwargs)
    result = simulation.run()
    requests = workload.all_requests()
    prompt_tokens = sum(r.prompt_len for r in requests)
    overhead_s = cost.request_overhead_ms / 1000.0
    ttfts = [(r.first_token_s - r.arrival_s + overhead_s) * 1000.0 for r in requests if r.first_token_s >= 0]
    routed = [replica.num_routed for replica in simulation.replicas]
    mean = sum(routed) / len(routed)
    return {"mode": mode, "cores": cores, "hit_rate": result.hit_rate, "local_rate": result.local_hit_rate,
            "peer_share": sum(r.cached_peer for r in requests) / prompt_tokens, "ideal_hit_rate": result.ideal_hit_rate,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "ttft_mean_ms": sum(ttfts) / max(len(ttfts), 1), "requests_per_replica": routed,
            "busiest_over_mean": max(routed) / mean if mean else None, "reasons": result.reasons,
            "rejected": result.num_rejected}


async def run_real(cluster: Cluster, config: WorkloadConfig, concurrency: int, served: dict):
    from bench.config import ClientConfig, LoadConfig
    from bench.runner import run_benchmark

    client = make_recording_client(concurrency, served)
    return await run_benchmark(ClientConfig(base_url=cluster.base_url, model="calib"),
                               LoadConfig(concurrency=concurrency, seed=config.seed), config, IdPromptFactory(VOCAB),
                               show_progress=False, http_client=client)


def run_point(cluster: Cluster, dp: int, name: str, seed: int, cost: CostModel, num_pages: int, trace_dir: Path,
              policy_kwargs: dict, cores: float) -> dict:
    config, concurrency, shape = workload_config(name, seed, trace_dir)
    cluster.reset()
    before = cluster.metrics()
    served: dict = {}
    load_before = load_average()
    began = time.perf_counter()
    run = asyncio.run(run_real(cluster, config, concurrency, served))
    wall_s = time.perf_counter() - began
    time.sleep(1.2)  # /metrics is cached for 1 s
    after = cluster.metrics()
    (trace_dir / f"bench-dp{dp}-{name}-{seed}.json").write_text(json.dumps(run.to_json(), default=str) + "\n")
    completion = {r.request_index: r.completion_tokens for r in run.records if r.success}
    requests = rebuild_requests(config, IdPromptFactory(VOCAB), completion)
    sent = {prompt_digest(r["prompt"]) for r in requests}
    unmatched = sum(1 for digest in served if digest not in sent)
    measured = measured_summary(run, requests, served, cluster.replica_ids(), before, after)
    rows = trace_rows(requests, run.records, PAGE_SIZE)
    (trace_dir / f"sim-trace-dp{dp}-{name}-{seed}.jsonl").write_text(
        "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))
    simulated = {
        "timed": simulate_trace(rows, dp, cost, num_pages, mode="timed", concurrency=concurrency, cores=0.0,
                                policy_kwargs=policy_kwargs),
        "timed_shared": simulate_trace(rows, dp, cost, num_pages, mode="timed", concurrency=concurrency,
                                       cores=cores, policy_kwargs=policy_kwargs),
        "closed_shared": simulate_trace(trace_rows(requests, run.records, PAGE_SIZE, "intended"), dp, cost,
                                        num_pages, mode="closed", concurrency=concurrency,
                                        cores=cores, policy_kwargs=policy_kwargs),
    }
    errors = {mode: calibration_errors(measured, sim) for mode, sim in simulated.items()}
    return {"dp": dp, "workload": name, "seed": seed, "concurrency": concurrency, "shape": shape,
            "cost_model": dataclasses.asdict(cost), "pages_per_replica": num_pages,
            "wall_s": wall_s, "load_average_before": load_before, "load_average_after": load_average(),
            "unmatched_prompts": unmatched, "num_trace_rows": len(rows), "measured": measured,
            "simulated": simulated, "errors": errors}


# ----------------------------------------------------------------------------------------------------------------
# Report


def fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "-"
    return format(value, spec)


def render(result: dict) -> str:
    calibrations = result.get("calibrations") or [result["calibration"]]
    lines = [f"Machine: {result['cpu']['model']}, {result['cpu']['cpus']} CPUs, flags {' '.join(result['cpu']['flags'])}; "
             f"Python {result['python']}; dtype {result['dtype']}; config `{result['config_label']}`; "
             f"load average before/after the runs {result['load_average_start']} / {result['load_average_end']}.",
             f"Command: `{result['command']}`", "",
             *[line for cal in calibrations for line in (
                 f"Calibration at DP={cal.get('dp', '?')} (ms, medians of 3; load average {cal['load_average']}): "
                 + ", ".join(f"{k} {fmt(v, '.1f')}" for k, v in cal["points"].items()),
                 "Fitted cost model: " + ", ".join(f"{k} {fmt(v, '.4g')}" for k, v in
                                                   (cal.get("cost_model") or result["cost_model"]).items()), "")],
             "Per point: measured (real cluster) vs simulated (same request sequence). Sim modes: timed = the real "
             "send times, one core per replica; shared = the same with the replicas sharing "
             f"{result['sim_cores']} cores; closed = the bench client's concurrency instead of the real send times "
             "(shared cores). err = (sim - real) / real.", "",
             "| DP | workload | seed | real hit | sim hit (timed / shared / closed) | real TTFT p50 / p99 (ms) | "
             "sim p50 / p99 timed | shared | closed | err p50 / p99 (shared) | real busiest/mean | sim | real sources "
             "local/peer | sim peer | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for point in result["points"]:
        m, s = point["measured"], point["simulated"]
        t, sh, cl = s["timed"], s["timed_shared"], s["closed_shared"]
        e = point["errors"]["timed_shared"]
        src = m["by_source"]
        lines.append(
            f"| {point['dp']} | {point['workload']} | {point['seed']} | {fmt(m['hit_rate'])} | "
            f"{fmt(t['hit_rate'])} / {fmt(sh['hit_rate'])} / {fmt(cl['hit_rate'])} | "
            f"{fmt(m['ttft_p50_ms'], '.0f')} / {fmt(m['ttft_p99_ms'], '.0f')} | "
            f"{fmt(t['ttft_p50_ms'], '.0f')} / {fmt(t['ttft_p99_ms'], '.0f')} | "
            f"{fmt(sh['ttft_p50_ms'], '.0f')} / {fmt(sh['ttft_p99_ms'], '.0f')} | "
            f"{fmt(cl['ttft_p50_ms'], '.0f')} / {fmt(cl['ttft_p99_ms'], '.0f')} | "
            f"{fmt(e['ttft_p50_ms']['rel_error'], '+.2f')} / {fmt(e['ttft_p99_ms']['rel_error'], '+.2f')} | "
            f"{fmt(m['busiest_over_mean'], '.2f')} | {fmt(sh['busiest_over_mean'], '.2f')} | "
            f"{src.get('local', 0)} / {src.get('peer', 0)} | {fmt(sh['peer_share'])} | "
            f"{point['load_average_after'][0]} |")
    summary = summarize_errors(result["points"])
    lines += ["", "Calibration error over all points (median and worst |relative error|, by sim mode):", "",
              "| metric | timed | shared | closed |", "|---|---|---|---|"]
    for metric, by_mode in summary.items():
        lines.append(f"| {metric} | " + " | ".join(
            f"{fmt(by_mode.get(mode, {}).get('median'), '.2f')} (worst {fmt(by_mode.get(mode, {}).get('worst'), '.2f')})"
            for mode in ("timed", "timed_shared", "closed_shared")) + " |")
    for hot in result.get("hot_prefix", []):
        lines += ["", render_hot(hot)]
    return "\n".join(lines) + "\n"


def summarize_errors(points: list[dict]) -> dict:
    out: dict = {}
    for point in points:
        for mode, errors in point["errors"].items():
            for metric, entry in errors.items():
                if entry["rel_error"] is not None:
                    out.setdefault(metric, {}).setdefault(mode, []).append(abs(entry["rel_error"]))
    return {metric: {mode: {"median": percentile(values, 50), "worst": max(values)} for mode, values in modes.items()}
            for metric, modes in out.items()}


def hot_prefix_report(point: dict) -> dict:
    """Who got the hottest prefix's pages, and how: per replica, its requests for that prefix and the cached tokens of
    those requests by source (local / peer), and how many of them computed the prefix (no cached tokens)."""
    per_request = point["measured"]["per_request"]
    groups: dict = {}
    for request in per_request:
        groups[request["group"]] = groups.get(request["group"], 0) + 1
    hot = max(groups, key=groups.get)
    rows: dict = {}
    for request in per_request:
        if request["group"] != hot:
            continue
        row = rows.setdefault(request["replica"] or "?", {"requests": 0, "local": 0, "peer": 0, "host": 0,
                                                           "disk": 0, "computed_prefix": 0, "first_peer_at": None})
        row["requests"] += 1
        for source, value in (request["by_source"] or {}).items():
            row[source] = row.get(source, 0) + value
        if not request["cached"]:
            row["computed_prefix"] += 1
        if (request["by_source"] or {}).get("peer") and row["first_peer_at"] is None:
            row["first_peer_at"] = request["i"]
    return {"hot_group": hot, "hot_requests": groups[hot], "total_requests": len(per_request), "per_replica": rows,
            "sources_per_replica_from_metrics": point["measured"]["metrics_sources_per_replica"]}


def render_hot(hot: dict) -> str:
    lines = [f"{hot['workload']} seed {hot['seed']} (config `{hot['config_label']}`, DP={hot['dp']}): prefix group "
             f"{hot['report']['hot_group']} had {hot['report']['hot_requests']} of {hot['report']['total_requests']} "
             "requests.", "",
             "| replica | hot-prefix requests | cached tokens local | peer | computed the prefix (0 cached) |",
             "|---|---|---|---|---|"]
    for replica, row in hot["report"]["per_replica"].items():
        lines.append(f"| {replica[-8:]} | {row['requests']} | {row['local']} | {row['peer']} | "
                     f"{row['computed_prefix']} |")
    m = hot["point"]["measured"]
    s = hot["point"]["simulated"]["timed"]
    lines.append(f"\nWhole run: hit {fmt(m['hit_rate'])}, sources {m['by_source']}, TTFT p50/p99 "
                 f"{fmt(m['ttft_p50_ms'], '.0f')}/{fmt(m['ttft_p99_ms'], '.0f')} ms, requests per replica "
                 f"{list(m['requests_per_replica'].values())}; fetches {m['fetch_per_replica']}. Simulated (timed): "
                 f"hit {fmt(s['hit_rate'])}, peer share {fmt(s['peer_share'])}, TTFT p50/p99 "
                 f"{fmt(s['ttft_p50_ms'], '.0f')}/{fmt(s['ttft_p99_ms'], '.0f')} ms, reasons {s['reasons']}.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", default="2,3,4")
    parser.add_argument("--workloads", default=",".join(NAMED))
    parser.add_argument("--repeats", type=int, default=2, help="runs per point (seeds 0..repeats-1)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--model-dir", type=Path, default=ROOT / "benchmarks/.scratch/tiny-llama-512x8")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per replica")
    parser.add_argument("--ray-cpus", type=float, default=2.0, help="Ray's CPUs (each replica reserves this / DP)")
    parser.add_argument("--sim-cores", type=float, default=2.0, help="cores the replicas share in the 'shared' modes")
    parser.add_argument("--config-label", default="main", help="name of the cluster configuration in the results")
    parser.add_argument("--serve-config", default=None,
                        help="JSON object of ServeConfig fields to override; a \"_policy\" key inside it (an object of "
                             "PolicyConfig fields) is given to the simulator's router instead")
    parser.add_argument("--calibration", default=None, help="reuse the calibration of an earlier OUT.json")
    parser.add_argument("--calibrate-each-dp", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the cost model again at each DP (the box's load drifts), else once")
    parser.add_argument("--hot-prefix", action="store_true", help="also run the hot-prefix demonstration (DP=2)")
    parser.add_argument("--hot-only", action="store_true", help="only the hot-prefix demonstration")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_calibration"))
    args = parser.parse_args(argv)
    from router.policy import PolicyConfig

    ensure_model(args.model_dir)
    out = Path(args.out)
    trace_dir = out.parent / (out.name + "-traces")
    trace_dir.mkdir(parents=True, exist_ok=True)
    dps = [int(d) for d in args.dp.split(",")] if not args.hot_only else [2]
    workloads = [w for w in args.workloads.split(",") if w] if not args.hot_only else []
    for name in workloads:
        if name not in NAMED:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(NAMED)}")
    # the real router's policy (cluster/app.py: PolicyConfig defaults, peer hints on)
    policy_kwargs = dataclasses.asdict(PolicyConfig())
    policy_kwargs.update(json.loads(args.serve_config or "{}").get("_policy", {}))
    if args.serve_config:
        args.serve_config = json.dumps({k: v for k, v in json.loads(args.serve_config).items() if k != "_policy"})
    result: dict = {"cpu": cpu_description(), "python": platform.python_version(), "dtype": args.dtype,
                    "config_label": args.config_label, "serve_config": args.serve_config,
                    "command": "PYTHONPATH=. .venv/bin/python benchmarks/sim_calibration.py " + " ".join(
                        sys.argv[1:] if argv is None else argv),
                    "load_average_start": load_average(), "sim_cores": args.sim_cores, "points": [],
                    "policy_kwargs": policy_kwargs}
    cluster = Cluster(args)
    cluster.start()
    started = time.perf_counter()
    try:
        cost = None
        calibrations = []
        if args.calibration:
            earlier = json.loads(Path(args.calibration).read_text())
            result["calibration"] = earlier["calibration"]
            cost = CostModel(**earlier["cost_model"])
        for dp in dps:
            cluster.deploy(dp)
            num_pages = cluster.pages_per_replica()
            print(f"DP={dp}: {num_pages} pages per replica, replicas {cluster.replica_ids()}", flush=True)
            if cost is None or (args.calibrate_each_dp and not args.calibration):
                result["calibration"] = calibrate(cluster)
                cost, extra = fit_costs(result["calibration"]["points"])
                result["calibration"].update(extra, dp=dp, cost_model=dataclasses.asdict(cost))
                calibrations.append(result["calibration"])
                result["calibrations"] = calibrations
                print("calibration", json.dumps(result["calibration"]["points"]), flush=True)
                print("cost model", cost, flush=True)
            result["cost_model"] = dataclasses.asdict(cost)
            result["pages_per_replica"] = num_pages
            for seed in range(args.repeats):
                for name in workloads:
                    point = run_point(cluster, dp, name, seed, cost, num_pages, trace_dir, policy_kwargs,
                                      args.sim_cores)
                    point["measured"].pop("per_request")
                    result["points"].append(point)
                    m, s = point["measured"], point["simulated"]["timed_shared"]
                    print(f"DP={dp} {name} seed {seed}: real hit {m['hit_rate']:.3f} p50 {fmt(m['ttft_p50_ms'], '.0f')} "
                          f"p99 {fmt(m['ttft_p99_ms'], '.0f')} | sim hit {s['hit_rate']:.3f} p50 "
                          f"{fmt(s['ttft_p50_ms'], '.0f')} p99 {fmt(s['ttft_p99_ms'], '.0f')} | sources "
                          f"{m['by_source']} | per replica {list(m['requests_per_replica'].values())} "
                          f"[{point['wall_s']:.0f} s, load {point['load_average_after']}]", flush=True)
            if (args.hot_prefix or args.hot_only) and dp == 2:
                for seed in range(args.repeats):
                    for name in ("hot-prefix", "hot-prefix-burst"):
                        point = run_point(cluster, dp, name, seed, cost, num_pages, trace_dir, policy_kwargs,
                                          args.sim_cores)
                        hot = {"config_label": args.config_label, "dp": dp, "workload": name, "seed": seed,
                               "report": hot_prefix_report(point), "point": point}
                        result.setdefault("hot_prefix", []).append(hot)
                        print(render_hot(hot), flush=True)
            cluster.undeploy()
    finally:
        cluster.shutdown()
    result["wall_s"] = time.perf_counter() - started
    result["load_average_end"] = load_average()
    report = render(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
