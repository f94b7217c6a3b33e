"""deploy/grafana/prefixserve-dashboard.json and deploy/prometheus.yml, without a server: the dashboard covers what
operators look at, every metric its queries name is one /metrics exports (or Ray Serve's), and promtool accepts the
scrape config and every query (skipped without promtool; tests/test_e2e_ecosystem.py runs them on a real Prometheus).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.metrics import IngressMetrics
from common.types import (CachedTokens, CacheSource, EngineStats, KVSourceStats, RequestLatencyStats, RequestOutput,
                          SourceStats, TierReport, TierStats)
from router.decision_metrics import DECISIONS

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "prefixserve-dashboard.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
PROMTOOL = shutil.which("promtool")
def queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("$__rate_interval", "1m").replace("$model_name", ".*"))
            for panel in dashboard["panels"] for target in panel["targets"]]


def exported_names() -> set[str]:
    """Sample names of a /metrics rendering with one finished request, one replica, a host and a disk tier."""
    metrics = IngressMetrics(model_name="m")
    output = RequestOutput("r", [1], "x", False, None, 300, 1, CachedTokens(), "rep")
    metrics.observe_first_token(0.1, output)
    metrics.observe_finished(RequestOutput("r", [2], "y", True, "length", 300, 2, CachedTokens(local=128), "rep"))
    metrics.observe_aborted("client_gone", "rep", "r2")
    stats = EngineStats("rep", 300, 128, 8, 4, 2, 2, 0, 0, 0, 0, 1, 128, latency=RequestLatencyStats())
    sources = KVSourceStats("rep", {CacheSource.HOST: SourceStats()},
                            {"host": TierReport(TierStats(), True), "disk": TierReport(TierStats(), True)})
    saved = DECISIONS.snapshot()
    DECISIONS.add("PrefixServeReplica", "rep", "prefix_hit")  # what a router in this process would have counted
    try:
        text = metrics.render([stats], [sources]).decode()
    finally:
        DECISIONS.clear()
        for (deployment, replica_id, reason), count in saved.items():
            DECISIONS.add(deployment, replica_id, reason, count)
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_dashboard_covers_the_operators_questions():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("hit rate per replica", "by source", "time to first token", "inter-token", "pages by state",
                  "routing decisions by reason", "tier kv events", "tier and fetch errors", "request phases",
                  "finished requests by reason", "ray serve", "chats taken for ended"):
        assert topic in titles, topic
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    assert all(panel["datasource"]["uid"] == "${datasource}" and panel["targets"] for panel in dashboard["panels"])
    assert [variable["name"] for variable in dashboard["templating"]["list"]] == ["datasource", "model_name"]


def test_every_metric_a_query_names_is_exported():
    exported = exported_names()
    for title, expr in queries():
        for name in re.findall(r"\b((?:prefixserve_|vllm:)[a-z0-9_:]+|ray_serve_[a-z0-9_]+)", expr):
            assert name in exported or name.startswith("ray_serve_"), (title, name)


def test_scrape_config_has_both_jobs():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["prefixserve"]["metrics_path"] == "/metrics"
    assert jobs["ray"]["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install -y prometheus)")
def test_promtool_accepts_the_config_and_every_query(tmp_path):
    check = subprocess.run([PROMTOOL, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{index}", "expr": expr} for index, (_, expr) in enumerate(queries())]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    check = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_vllm_series_for_aborts_external_hits_and_engine_timings():
    """request_success has every vLLM finish reason per replica from the start, aborts land as abort / error, the
    external prefix cache counts what peers and tiers supplied, and the engine-side histograms render per replica."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = IngressMetrics(model_name="m")
    metrics.observe_first_token(0.1, RequestOutput("r1", [1], "x", False, None, 300, 1, CachedTokens(), "a"))
    metrics.observe_finished(RequestOutput("r1", [2], "y", True, "stop", 300, 2,
                                           CachedTokens(local=128, peer=128, disk=0), "a"))
    metrics.observe_aborted("client_gone", "a", "r2")
    metrics.observe_aborted("deadline", "b", "r3")
    metrics.observe_aborted("replica_lost", None, "r4")
    latency = RequestLatencyStats()
    for seconds in (0.02, 0.02, 0.3):
        latency.inter_token.observe(seconds)
    latency.queue.observe(0.4)
    stats = [EngineStats("a", 300, 256, 8, 4, 2, 2, 0, 0, 0, 0, 1, 128, latency=latency, num_prompt_tokens_hit_local=128),
             EngineStats("b", 300, 128, 8, 4, 2, 2, 0, 0, 0, 0, 1, 128, latency=latency)]  # b: an older replica
    samples = {}
    for family in text_string_to_metric_families(metrics.render(stats).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name")))] = (
                sample.value)
    success = {labels: value for (name, labels), value in samples.items() if name == "vllm:request_success_total"}
    assert success == {
        **{(("engine", engine), ("finished_reason", reason)): 0.0 for engine in "ab"
           for reason in ("stop", "length", "abort", "error", "repetition")},
        (("engine", "a"), ("finished_reason", "stop")): 1.0, (("engine", "a"), ("finished_reason", "abort")): 1.0,
        (("engine", "b"), ("finished_reason", "abort")): 1.0, (("engine", "unknown"), ("finished_reason", "error")): 1.0}
    assert samples[("prefixserve_aborted_requests_total", (("reason", "client_gone"),))] == 1
    assert samples[("vllm:external_prefix_cache_queries_total", (("engine", "a"),))] == 300 - 128
    assert samples[("vllm:external_prefix_cache_hits_total", (("engine", "a"),))] == 128
    # vLLM's prefix_cache_hits are the local cache's only (external hits are the series above); ours count both
    assert samples[("vllm:prefix_cache_hits_total", (("engine", "a"),))] == 128
    assert samples[("prefixserve_prefix_cache_hits_total", (("replica", "a"),))] == 256
    assert samples[("vllm:prefix_cache_hits_total", (("engine", "b"),))] == 128  # no split known: the total
    assert samples[("vllm:inter_token_latency_seconds_count", (("engine", "b"),))] == 3
    assert samples[("vllm:inter_token_latency_seconds_bucket", (("engine", "b"), ("le", "0.025")))] == 2
    assert samples[("vllm:request_queue_time_seconds_bucket", (("engine", "a"), ("le", "0.5")))] == 1
    assert ("vllm:request_decode_time_seconds_count", (("engine", "a"),)) in samples
