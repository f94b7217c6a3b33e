"""The ecosystem operators already run, end to end on real Ray Serve: vLLM's metric names on /metrics agree with ours,
and each replica publishes vLLM-schema KV events over ZMQ (``--kv-events-config``) that an outside subscriber turns
into exactly the pages the replica caches.

One app: two data-parallel replicas of the tiny random Llama, KV events on ipc:// endpoints (rank r adds ``_dp<r>``),
block hashes as the full 32-byte page keys so the subscriber can re-hash each block from its parent and token ids.
Besides the replicas' pools ("GPU"), the disk tier's events ("DISK") must add up to the pages its index holds; the
metric checks include per-token inter-token latency and the request phases (measured on the engines), the external
prefix cache, and a client that hangs up mid-stream counted as ``abort`` in both metric sets.
The slow test starts a real Prometheus on deploy/prometheus.yml, drives ``prefixserve bench`` traffic and evaluates
every query of deploy/grafana/prefixserve-dashboard.json through Prometheus' HTTP API (skipped without prometheus).
"""

from __future__ import annotations

import json
import shutil
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.test_kv_events_vllm import Subscriber

pytestmark = pytest.mark.ray

MODEL = "tiny"
PAGE_SIZE = 128
APP = "eco"


@pytest.fixture(scope="module")
def app(ray_session, serve_http_port, tiny_llama_dir, tmp_path_factory):
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ServeConfig

    folder = tmp_path_factory.mktemp("kv-events")
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{folder}/pub",
              "replay_endpoint": f"ipc://{folder}/rep", "topic": "kv", "block_hash_format": "bytes"}
    config = ServeConfig(model=tiny_llama_dir, devices="cpu", data_parallel_degree=2, page_size=PAGE_SIZE,
                         kv_cache_memory="32MiB", num_cpus_per_replica=0.5, served_model_name=MODEL, max_model_len=2048,
                         max_num_batched_tokens=1024, disk_cache_dir=str(folder / "disk"), dtype="float32",
                         enforce_eager=True, kv_events_config=events)
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield {"base_url": f"http://127.0.0.1:{serve_http_port}/{APP}", "folder": folder}
    serve.delete(APP)


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app["base_url"], timeout=60) as session:
        yield session


def complete(http: httpx.Client, prompt: list[int], max_tokens: int = 4, stream: bool = False,
             target: str | None = None) -> str:
    """Send a token-id prompt (to ``target`` if given); returns the replica id that served it."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    headers = {"x-prefixserve-target-replica": target} if target else {}
    if stream:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                pass
            return response.headers["x-prefixserve-replica"]
    response = http.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.headers["x-prefixserve-replica"]


def prompt_of(seed: int, num_tokens: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 900) for _ in range(num_tokens)]


def scrape(http: httpx.Client) -> dict[str, dict[tuple, float]]:
    """``{sample name: {sorted label items: value}}`` of one /metrics scrape, parsed by prometheus_client."""
    samples: dict[str, dict[tuple, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            samples[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def by(samples: dict[tuple, float], label: str, **where: str) -> dict[str, float]:
    """Sum of ``samples`` grouped by ``label``, keeping those whose labels include ``where``."""
    out: dict[str, float] = defaultdict(float)
    for labels, value in samples.items():
        labels = dict(labels)
        if all(labels.get(k) == v for k, v in where.items()):
            out[labels[label]] += value
    return dict(out)


def test_kv_events_from_every_replica_rebuild_its_cache(app, http):
    folder = app["folder"]
    context = zmq.Context()
    subscribers = [Subscriber(context, f"ipc://{folder}/pub" + ("" if rank == 0 else f"_dp{rank}"),
                              f"ipc://{folder}/rep" + ("" if rank == 0 else f"_dp{rank}"), b"kv", rank=rank)
                   for rank in (0, 1)]
    try:
        prompts = {seed: prompt_of(seed, 2 * PAGE_SIZE + 40) for seed in range(6)}
        served_by = {seed: complete(http, prompt, stream=seed % 2 == 0) for seed, prompt in prompts.items()}
        # one more page on chain 0, on the same replica
        assert complete(http, prompts[0] + prompt_of(99, PAGE_SIZE), target=served_by[0]) == served_by[0]
        assert len(set(served_by.values())) == 2, "the router used one replica only"

        def page_tokens(seed: int) -> list[tuple[int, ...]]:
            tokens = prompts[seed] + (prompt_of(99, PAGE_SIZE) if seed == 0 else [])
            return [tuple(tokens[i:i + PAGE_SIZE]) for i in range(0, len(tokens) - PAGE_SIZE + 1, PAGE_SIZE)]

        def holder_rank(seed: int) -> int | None:
            """The rank whose events hold every full page of the prompt, chained from page 0."""
            for subscriber in subscribers:
                by_parent = {(parent, tokens): block for block, (parent, tokens, _) in subscriber.blocks.items()}
                parent = None
                for tokens in page_tokens(seed):
                    parent = by_parent.get((parent, tokens))
                    if parent is None:
                        break
                else:
                    return subscriber.rank
            return None

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(holder_rank(seed) is None for seed in prompts):
            for subscriber in subscribers:
                subscriber.poll(0.2)
        rank_of = {seed: holder_rank(seed) for seed in prompts}
        assert None not in rank_of.values(), rank_of
        # one replica <-> one rank: the events of a rank are the pages of the replica that served those requests
        replica_to_ranks = defaultdict(set)
        for seed, replica in served_by.items():
            replica_to_ranks[replica].add(rank_of[seed])
        assert all(len(ranks) == 1 for ranks in replica_to_ranks.values()) and len(replica_to_ranks) == 2
        # ... and exactly as many blocks as the replica reports cached pages
        rank_to_replica = {next(iter(ranks)): replica for replica, ranks in replica_to_ranks.items()}
        cached = by(scrape(http)["prefixserve_kv_pages"], "replica", state="cached")
        for subscriber in subscribers:
            assert len(subscriber.blocks) == cached[rank_to_replica[subscriber.rank]]

        # the disk tier's events (medium DISK): together, the replicas announced exactly the pages the tier holds
        import sqlite3

        index = sqlite3.connect(f"file:{folder}/disk/index.sqlite?mode=ro", uri=True)

        def disk_rows() -> int:
            return index.execute("SELECT COUNT(*) FROM pages").fetchone()[0]

        def announced() -> set:
            return set().union(*(subscriber.by_medium.get("DISK", {}) for subscriber in subscribers))

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (disk_rows() == 0 or len(announced()) != disk_rows()):
            for subscriber in subscribers:
                subscriber.poll(0.2)
        assert disk_rows() > 0 and len(announced()) == disk_rows()  # chain 0's reuse wrote its pages
        counters = scrape(http)
        assert sum(by(counters["prefixserve_kv_tier_events_stored_total"], "tier", tier="disk").values()) >= disk_rows()
        index.close()

        # reset: every replica publishes AllBlocksCleared
        assert http.post("/reset_prefix_cache").json()["all_reset"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(subscriber.blocks for subscriber in subscribers):
            for subscriber in subscribers:
                subscriber.poll(0.2)
        assert all(subscriber.blocks == {} for subscriber in subscribers)
    finally:
        for subscriber in subscribers:
            subscriber.close()
        context.term()


def test_vllm_metric_names_agree_with_ours(app, http):
    shared = prompt_of(1000, 2 * PAGE_SIZE)
    for index in range(4):
        complete(http, shared + prompt_of(1001 + index, 50), max_tokens=6, stream=index % 2 == 1)
        time.sleep(0.6)  # let the router hear about the shared pages, so later requests hit
    samples = scrape(http)
    vllm = {name: values for name, values in samples.items() if name.startswith("vllm:")}
    assert all(dict(labels)["model_name"] == MODEL for values in vllm.values() for labels in values)

    def ours(name: str, **where: str) -> dict[str, float]:
        return by(samples["prefixserve_" + name], "replica", **where)

    def theirs(name: str, **where: str) -> dict[str, float]:
        return by(samples["vllm:" + name], "engine", **where)

    # read from the replicas in the same scrape: equal per replica
    assert len(theirs("prefix_cache_queries_total")) == 2
    assert theirs("prefix_cache_queries_total") == ours("prefix_cache_queries_total")
    # vLLM's hits are its local cache's; ours add the pages imported from peers and tiers
    assert all(theirs("prefix_cache_hits_total")[replica] <= hits for replica, hits in
               ours("prefix_cache_hits_total").items())
    assert sum(theirs("prefix_cache_hits_total").values()) > 0
    assert theirs("num_requests_running") == ours("num_requests_running")
    assert theirs("num_requests_waiting") == ours("num_requests_waiting")
    assert theirs("num_preemptions_total") == ours("preemptions_total")
    in_use, total = ours("kv_pages", state="in_use"), ours("kv_pages", state="total")
    assert theirs("kv_cache_usage_perc") == {replica: in_use[replica] / total[replica] for replica in total}
    # measured at the ingress per finished request: equal per replica
    assert theirs("prompt_tokens_total") == ours("prompt_tokens_total")
    cached = by(samples["prefixserve_cached_prompt_tokens_total"], "source")
    cached_vllm = by(samples["vllm:prompt_tokens_cached_by_source_total"], "source")
    assert cached_vllm == {"device": cached["local"], "p2p": cached["peer"], "host": cached["host"],
                           "disk": cached["disk"]}
    assert sum(theirs("prompt_tokens_cached_total").values()) == sum(cached.values()) > 0
    sources = by(samples["vllm:prompt_tokens_by_source_total"], "source")
    assert sources["local_cache_hit"] == cached["local"]
    assert sources["local_compute"] + sources["local_cache_hit"] + sources["external_kv_transfer"] == sum(
        ours("prompt_tokens_total").values())
    assert theirs("request_success_total") == ours("routing_decisions_total")
    # latency histograms: the same requests, the same TTFT observations
    num_requests = sum(theirs("request_success_total").values())
    assert sum(theirs("time_to_first_token_seconds_count").values()) == sum(
        samples["prefixserve_time_to_first_token_seconds_count"].values()) == num_requests
    assert sum(theirs("time_to_first_token_seconds_sum").values()) == pytest.approx(
        sum(samples["prefixserve_time_to_first_token_seconds_sum"].values()))
    assert sum(theirs("e2e_request_latency_seconds_count").values()) == num_requests
    assert sum(theirs("e2e_request_latency_seconds_sum").values()) > sum(
        theirs("time_to_first_token_seconds_sum").values())
    # measured on the engines: one inter-token interval per token after each request's first, one phase each
    generated = theirs("generation_tokens_total")
    finished = theirs("request_success_total")
    assert theirs("inter_token_latency_seconds_count") == {
        replica: generated[replica] - finished[replica] for replica in finished}
    for phase in ("queue", "prefill", "decode"):
        assert theirs(f"request_{phase}_time_seconds_count") == finished
    assert sum(theirs("request_decode_time_seconds_sum").values()) == pytest.approx(
        sum(theirs("inter_token_latency_seconds_sum").values()))
    # the external prefix cache (peer copy, host and disk tiers): what the local cache missed, and what they supplied
    local = ours("cached_prompt_tokens_total", source="local")
    external = {replica: sum(ours("cached_prompt_tokens_total", source=source).get(replica, 0)
                             for source in ("peer", "host", "disk")) for replica in local}
    assert theirs("external_prefix_cache_queries_total") == {
        replica: ours("prompt_tokens_total")[replica] - local[replica] for replica in local}
    assert theirs("external_prefix_cache_hits_total") == external
    # every vLLM finish reason exists for every replica from the start
    reasons = by(samples["vllm:request_success_total"], "finished_reason")
    assert set(reasons) == {"stop", "length", "abort", "error", "repetition"} and reasons["abort"] == 0
    ttft_buckets = [dict(labels)["le"] for labels in samples["vllm:time_to_first_token_seconds_bucket"]]
    assert "2560.0" in ttft_buckets and "0.001" in ttft_buckets  # vLLM's buckets


def test_a_client_gone_mid_stream_counts_as_abort_in_both_sets(app, http):
    """vLLM counts a request its client abandoned as request_success{finished_reason="abort"}; so do we, on the
    replica that was serving it, beside our aborted_requests_total{reason="client_gone"}."""
    before = scrape(http)
    body = {"model": MODEL, "prompt": prompt_of(7, 40), "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=app["base_url"], timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            replica = response.headers["x-prefixserve-replica"]
            next(response.iter_lines())  # one chunk, then hang up
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = scrape(http)
        aborted = by(after["vllm:request_success_total"], "engine", finished_reason="abort")
        if aborted.get(replica, 0) == by(before["vllm:request_success_total"], "engine",
                                         finished_reason="abort").get(replica, 0) + 1:
            break
        time.sleep(0.3)
    else:
        raise AssertionError("the abort never reached vllm:request_success")
    gone = lambda samples: sum(by(samples["prefixserve_aborted_requests_total"], "reason").get(reason, 0)  # noqa: E731
                               for reason in ("client_gone", "cancelled", "deadline", "shutdown"))
    assert gone(after) - gone(before) == 1
    assert sum(by(after["vllm:request_success_total"], "engine", finished_reason="abort").values()) == gone(after)


# ---- a real Prometheus on deploy/prometheus.yml, every dashboard panel's query -------------------------------------
PROMETHEUS = shutil.which("prometheus")
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "prefixserve-dashboard.json"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's variables as a dashboard would send them."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("$__rate_interval", "1m").replace("$model_name", ".*"))
            for panel in dashboard["panels"] for target in panel["targets"]]


def prometheus_config(template: Path, metrics_path: str, target: str, ray_sd_file: str) -> str:
    """deploy/prometheus.yml pointed at this test's app and Ray session, scraping every second."""
    config = yaml.safe_load(template.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    for job in config["scrape_configs"]:
        if job["job_name"] == "prefixserve":
            job["metrics_path"] = metrics_path
            job["static_configs"] = [{"targets": [target]}]
        if job["job_name"] == "ray":
            job["file_sd_configs"] = [{"files": [ray_sd_file], "refresh_interval": "1s"}]
    return yaml.safe_dump(config)


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (apt-get install -y prometheus)")
def test_every_dashboard_panel_returns_data_from_a_real_prometheus(app, http, tmp_path, ray_session):
    import asyncio
    import subprocess

    from bench.config import ClientConfig, LoadConfig
    from bench.runner import run_benchmark
    from bench.standard_workloads import make_params
    from bench.workloads import IdPromptFactory, WorkloadConfig
    from tests.conftest import find_free_port

    # Ray's metrics agents. A head with a dashboard lists them in <session>/prom_metrics_service_discovery.json (what
    # deploy/prometheus.yml reads); the test session runs without one, so that file is written here from ray.nodes().
    agents = [f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}" for node in ray_session.nodes()
              if node["Alive"]]
    ray_targets = tmp_path / "ray_targets.json"
    ray_targets.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": agents}]))
    port = find_free_port()
    config_file = tmp_path / "prometheus.yml"
    base = urlsplit(app["base_url"])
    config_file.write_text(prometheus_config(Path(__file__).resolve().parent.parent / "deploy" / "prometheus.yml",
                                             f"{base.path}/metrics", base.netloc,
                                             str(ray_targets)))
    process = subprocess.Popen([PROMETHEUS, f"--config.file={config_file}", f"--storage.tsdb.path={tmp_path}/data",
                                f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # prefixserve bench traffic: SGLang's generated-shared-prefix shape, scaled down
        standard = make_params("generated-shared-prefix", dict(num_groups=2, prompts_per_group=4,
                                                               system_prompt_len=256, question_len=32, output_len=8))
        for _ in range(2):  # two rounds some seconds apart, so rates over 1m windows see traffic
            run = asyncio.run(run_benchmark(
                ClientConfig(base_url=app["base_url"], model=MODEL), LoadConfig(concurrency=2),
                WorkloadConfig(workload="generated-shared-prefix", standard=standard), IdPromptFactory(1024),
                show_progress=False))
            assert run.metrics.num_completed == 8
            time.sleep(3)
        pending = set(dashboard_queries())
        deadline = time.monotonic() + 120  # Ray's metrics agents report every few seconds
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as prometheus:
            while pending and time.monotonic() < deadline:
                for title, expr in sorted(pending):
                    try:
                        body = prometheus.get("/api/v1/query", params={"query": expr}).json()
                    except (httpx.HTTPError, ValueError):
                        break  # Prometheus still starting
                    assert body["status"] == "success", (title, expr, body)  # the PromQL itself is valid
                    if body["data"]["result"]:
                        pending.discard((title, expr))
                time.sleep(2)
        assert not pending, f"queries without data: {sorted(pending)}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        assert process.poll() is not None  # nothing left running

