"""benchmarks/vs_vllm_report.py turns raw result files into the side-by-side markdown (no servers needed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import bench
from bench import workloads as wl

REPORT_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "vs_vllm_report.py"


def load_report_module():
    spec = importlib.util.spec_from_file_location("vs_vllm_report", REPORT_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def result_json(label: str, workload: str, ttft_s: float, cached_tokens: int) -> dict:
    """A result file's content for 4 identical requests of 100 prompt tokens lasting 1 s in all."""
    records = [
        bench.RequestRecord(
            request_index=i, session_id=i, turn=0, group=0, warmup=False, output_len=4, client_prompt_len=100,
            start_s=0.0, success=True, ttft_s=ttft_s, e2e_s=ttft_s + 0.03, itl_s=[0.01] * 3, prompt_tokens=100,
            completion_tokens=4, cached_tokens=cached_tokens, usage_reported=True,
        )
        for i in range(4)
    ]
    config = wl.WorkloadConfig(workload=workload, num_requests=4, prefix_len=96, suffix_len=4, output_len=4)
    run = bench.BenchRun(
        label=label, client_config=bench.ClientConfig(), load_config=bench.LoadConfig(), workload_config=config,
        prompt_format="ids", tokenizer_path=None, vocab_size=1024, model="m",
        metrics=bench.compute_metrics(records, 1.0), records=records, warmup_records=[], started_at="now",
    )
    return run.to_json()


def test_report_pairs_servers_per_workload_with_ratios(tmp_path):
    report = load_report_module()
    raw = tmp_path / "raw"
    raw.mkdir()
    for server, ttft in (("prefixserve", 0.1), ("vllm", 0.2)):
        for caching, cached in (("on", 64), ("off", 0)):
            for workload in ("shared-prefix", "unique"):
                content = result_json(f"{server} {caching}", workload, ttft, cached if workload != "unique" else 0)
                (raw / f"{server}-caching-{caching}-{workload}.json").write_text(json.dumps(content))
            facts = {"server": server, "caching": caching, "startup_s": 12.5, "rss_idle_mib": 900, "rss_after_mib": 950}
            (raw / f"{server}-caching-{caching}-server.json").write_text(json.dumps(facts))
    out = tmp_path / "vs_vllm.md"
    assert report.main(["--raw", str(raw), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.index("### shared-prefix") < text.index("### unique") < text.index("### Servers")
    assert "| TTFT p50 (ms) | 100.0 | 200.0 | 0.50x ✓ | 100.0 | 200.0 | 0.50x ✓ |" in text
    assert "| cached prompt tokens (%) | 64.0 | 64.0 | 1.00x | 0.0 | 0.0 | - |" in text
    assert "| vLLM | off | 12.5 | 900 | 950 |" in text


def test_a_named_workload_is_described_by_its_own_parameters():
    """Not by the generic prefix / suffix sizes it does not use (a generated-shared-prefix run was described as
    "prefix 1792 x 4, suffix 256, out 32")."""
    from bench.report import describe_workload

    workload = {"workload": "generated-shared-prefix", "num_requests": 60, "num_prefixes": 4, "prefix_len": 1792,
                "suffix_len": 256, "output_len": 32, "output_len_range": None, "num_turns": 4,
                "standard": {"num_groups": 6, "prompts_per_group": 10, "system_prompt_len": 1024,
                             "question_len": 384, "output_len": 16}}
    text = describe_workload({"workload": workload, "prompt_format": "ids"})
    assert text == ("generated-shared-prefix, 60 req, num groups 6, prompts per group 10, system prompt len 1024, "
                    "question len 384, output len 16, ids prompts")
    plain = describe_workload({"workload": {**workload, "workload": "shared-prefix", "standard": None},
                               "prompt_format": "text"})
    assert plain == "shared-prefix, 60 req, prefix 1792 x 4, suffix 256, out 32, text prompts"


def run_vs_vllm(tmp_path, action: str, **env):
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "vs_vllm.sh"
    full_env = {"PATH": "/usr/bin:/bin", "RESULTS": str(tmp_path / "results"), "SCRATCH": str(tmp_path / "scratch"),
                **env}
    return subprocess.run(["bash", str(script), action], env=full_env, capture_output=True, text=True, timeout=60)


def test_vs_vllm_model_shape_knob(tmp_path):
    """MODEL_SHAPE picks the model vs_vllm.sh writes and serves: an unknown shape is refused before any work; a folder
    that already holds a model is served as it is (neither shape rewrites it)."""
    refused = run_vs_vllm(tmp_path, "model", MODEL_SHAPE="gpt-9")
    assert refused.returncode == 2
    assert "MODEL_SHAPE must be tiny-llama or qwen2-0.5b" in refused.stderr
    assert not (tmp_path / "results").exists()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    for shape in ("tiny-llama", "qwen2-0.5b"):
        kept = run_vs_vllm(tmp_path, "model", MODEL_SHAPE=shape, MODEL_DIR=str(model_dir))
        assert kept.returncode == 0, kept.stderr
        assert sorted(path.name for path in model_dir.iterdir()) == ["config.json"]
