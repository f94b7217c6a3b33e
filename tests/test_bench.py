"""Tests of ``prefixserve bench``: workloads (seeded, exact sizes), metrics (exact percentiles), the streaming client
against a small fake OpenAI server (stdlib, in a thread), and one run against a real ``prefixserve serve`` (ray)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

import bench
from bench import workloads as wl
from bench.metrics import RequestRecord
from tests.conftest import find_free_port, port_was_taken

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------------------------
# Workloads


def id_factory(vocab_size: int = 1024) -> wl.IdPromptFactory:
    return wl.IdPromptFactory(vocab_size=vocab_size)


def full_prompts(sessions: list[wl.Session]) -> list[list[int]]:
    """Single-turn sessions -> their prompts (system + user)."""
    return [session.system + session.turns[0].user for session in sessions]


@pytest.mark.parametrize("workload", wl.WORKLOADS)
def test_same_seed_gives_same_prompts_and_another_seed_does_not(workload):
    config = wl.WorkloadConfig(workload=workload, num_requests=10, prefix_len=64, suffix_len=16, num_turns=3, seed=7)
    first = wl.build_sessions(config, id_factory())
    again = wl.build_sessions(config, id_factory())
    other = wl.build_sessions(wl.WorkloadConfig(**{**config.__dict__, "seed": 8}), id_factory())
    assert first == again
    assert [s.turns for s in first] != [s.turns for s in other]
    assert wl.count_requests(first) == 10


def test_id_prompts_have_exact_lengths_and_safe_ids():
    config = wl.WorkloadConfig(workload="shared-prefix", num_requests=12, num_prefixes=3, prefix_len=300, suffix_len=20)
    sessions = wl.build_sessions(config, id_factory(vocab_size=500))
    for prompt in full_prompts(sessions):
        assert len(prompt) == 320
        assert all(100 <= token < 400 for token in prompt)


def test_shared_prefix_requests_reuse_exactly_k_prefixes_with_distinct_suffixes():
    config = wl.WorkloadConfig(workload="shared-prefix", num_requests=20, num_prefixes=3, prefix_len=32, suffix_len=8)
    sessions = wl.build_sessions(config, id_factory())
    prefixes = {tuple(session.system) for session in sessions}
    assert len(prefixes) == 3
    assert {session.group for session in sessions} == {0, 1, 2}
    assert len({tuple(session.turns[0].user) for session in sessions}) == 20
    # The prefixes do not depend on how many requests are drawn.
    fewer = wl.build_sessions(wl.WorkloadConfig(**{**config.__dict__, "num_requests": 5}), id_factory())
    assert [s.system for s in fewer] == [s.system for s in sessions[:5]]


def test_cross_replica_visits_prefixes_round_robin_and_sizes_k_from_the_cache():
    config = wl.WorkloadConfig(
        workload="cross-replica", num_requests=10, num_prefixes=2, prefix_len=128, suffix_len=4,
        replica_cache_tokens=300,
    )
    assert config.effective_num_prefixes == 6  # 2 x ceil(300 / 128)
    sessions = wl.build_sessions(config, id_factory())
    assert [session.group for session in sessions] == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert sessions[0].system == sessions[6].system != sessions[1].system


def test_unique_requests_share_nothing():
    config = wl.WorkloadConfig(workload="unique", num_requests=8, prefix_len=16, suffix_len=4)
    prompts = full_prompts(wl.build_sessions(config, id_factory()))
    assert all(len(prompt) == 20 for prompt in prompts)
    assert len({tuple(prompt[:4]) for prompt in prompts}) == 8


def test_multi_turn_builds_conversations_with_contiguous_request_indices():
    config = wl.WorkloadConfig(
        workload="multi-turn", num_requests=10, num_turns=4, num_prefixes=2, prefix_len=24, suffix_len=6
    )
    sessions = wl.build_sessions(config, id_factory())
    assert [len(session.turns) for session in sessions] == [4, 4, 2]
    assert [turn.request_index for s in sessions for turn in s.turns] == list(range(10))
    assert [session.group for session in sessions] == [0, 1, 0]
    assert all(len(turn.user) == 6 for s in sessions for turn in s.turns)


def test_output_lengths_are_fixed_or_drawn_from_the_seeded_range():
    fixed = wl.WorkloadConfig(workload="unique", num_requests=5, prefix_len=4, suffix_len=4, output_len=9)
    assert {s.turns[0].output_len for s in wl.build_sessions(fixed, id_factory())} == {9}
    ranged = wl.WorkloadConfig(workload="unique", num_requests=50, prefix_len=4, suffix_len=4, output_len_range=(3, 6))
    lengths = [s.turns[0].output_len for s in wl.build_sessions(ranged, id_factory())]
    assert set(lengths) == {3, 4, 5, 6}
    assert lengths == [s.turns[0].output_len for s in wl.build_sessions(ranged, id_factory())]


def test_warmup_requests_do_not_touch_the_measured_prefixes():
    config = wl.WorkloadConfig(workload="shared-prefix", num_requests=4, num_prefixes=1, prefix_len=16, suffix_len=4)
    measured = wl.build_sessions(config, id_factory())
    warmup = wl.build_warmup_sessions(config, id_factory(), 3)
    assert len(warmup) == 3
    assert all(len(s.system) == 16 and len(s.turns[0].user) == 4 for s in warmup)
    assert all(s.system != measured[0].system for s in warmup)


@pytest.mark.parametrize(
    "kwargs, remedy",
    [
        ({"workload": "nope"}, "choose one of"),
        ({"num_prefixes": 0}, "--num-prefixes"),
        ({"output_len_range": (5, 2)}, "--output-len-range"),
        ({"prefix_len": 0, "suffix_len": 0}, "at least one prompt token"),
    ],
)
def test_invalid_workload_configs_name_the_fix(kwargs, remedy):
    with pytest.raises(ValueError, match=remedy):
        wl.WorkloadConfig(**kwargs)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from bench.tiny_models import build_tokenizer

    return build_tokenizer(1024, 4096)


def test_text_prompts_have_exact_token_counts_with_a_tokenizer(tiny_tokenizer):
    factory = wl.make_prompt_factory("text", None, tiny_tokenizer)
    assert len(factory.words) > 50
    config = wl.WorkloadConfig(workload="shared-prefix", num_requests=6, num_prefixes=2, prefix_len=200, suffix_len=37)
    for session in wl.build_sessions(config, factory):
        prompt = session.system + session.turns[0].user
        tokens = tiny_tokenizer.encode(prompt, add_special_tokens=False)
        assert len(tokens) == 237
        assert tokens[:200] == tiny_tokenizer.encode(session.system, add_special_tokens=False)
        assert factory.count(prompt) == 237


def test_id_prompts_take_the_vocabulary_from_the_tokenizer(tiny_tokenizer):
    factory = wl.make_prompt_factory("ids", None, tiny_tokenizer)
    assert factory.vocab_size == len(tiny_tokenizer)
    assert wl.make_prompt_factory("ids", None, None).vocab_size == 1024


# ---------------------------------------------------------------------------------------------------------------------
# Metrics


def record(index: int, ttft_s: float, e2e_s: float, completion_tokens: int = 5, **kwargs: Any) -> RequestRecord:
    fields = dict(
        request_index=index, session_id=index, turn=0, group=0, warmup=False, output_len=completion_tokens,
        client_prompt_len=100, start_s=0.0, success=True, ttft_s=ttft_s, e2e_s=e2e_s, prompt_tokens=100,
        completion_tokens=completion_tokens, cached_tokens=0, usage_reported=True,
    )
    fields.update(kwargs)
    return RequestRecord(**fields)


def test_percentile_interpolates_like_numpy():
    values = [float(v) for v in range(1, 102)]
    assert bench.percentile(values, 50) == 51.0
    assert bench.percentile(values, 90) == 91.0
    assert bench.percentile(values, 99) == 100.0
    assert bench.percentile([10.0, 20.0], 50) == 15.0
    assert bench.percentile([10.0, 20.0, 40.0], 75) == 30.0
    assert bench.percentile([7.0], 99) == 7.0
    numpy = pytest.importorskip("numpy")
    sample = sorted(random.Random(0).uniform(0, 100) for _ in range(37))
    for q in (1, 25, 50, 90, 99):
        assert bench.percentile(sample, q) == pytest.approx(float(numpy.percentile(sample, q)))


def test_metrics_on_synthetic_records_are_exact():
    # TTFT 1..101 ms; every request: E2E = TTFT + 40 ms for 5 tokens -> TPOT 10 ms; ITLs [10, 10, 10, 10] ms.
    records = [
        record(i, ttft_s=(i + 1) / 1000, e2e_s=(i + 1) / 1000 + 0.040, itl_s=[0.010] * 4, cached_tokens=50,
               cached_tokens_by_source={"local": 30, "peer": 20})
        for i in range(101)
    ]
    records.append(record(101, ttft_s=None, e2e_s=0.5, success=False, error="HTTP 500: boom", completion_tokens=0))
    records.append(record(102, ttft_s=9.0, e2e_s=9.5, warmup=True))
    metrics = bench.compute_metrics(records, duration_s=10.0)
    assert (metrics.num_requests, metrics.num_completed, metrics.num_errors) == (102, 101, 1)
    assert (metrics.ttft_ms.p50, metrics.ttft_ms.p90, metrics.ttft_ms.p99) == pytest.approx((51.0, 91.0, 100.0))
    assert metrics.ttft_ms.mean == pytest.approx(51.0)
    assert (metrics.ttft_ms.min, metrics.ttft_ms.max, metrics.ttft_ms.count) == pytest.approx((1.0, 101.0, 101))
    assert metrics.tpot_ms.mean == pytest.approx(10.0) and metrics.tpot_ms.p99 == pytest.approx(10.0)
    assert metrics.itl_ms.count == 404 and metrics.itl_ms.p50 == pytest.approx(10.0)
    assert metrics.e2e_ms.p50 == pytest.approx(91.0)
    assert metrics.request_throughput == pytest.approx(10.1)
    assert metrics.output_throughput == pytest.approx(50.5)
    assert metrics.total_token_throughput == pytest.approx(1060.5)
    assert (metrics.prompt_tokens, metrics.completion_tokens, metrics.cached_tokens) == (10100, 505, 5050)
    assert metrics.cached_token_rate == pytest.approx(0.5)
    assert metrics.cached_tokens_by_source == {"local": 3030, "peer": 2020}


def test_metrics_of_a_run_without_successes_are_empty_not_errors():
    metrics = bench.compute_metrics([record(0, None, 0.1, success=False, error="x")], duration_s=1.0)
    assert metrics.num_errors == 1 and metrics.ttft_ms.count == 0 and metrics.ttft_ms.p50 is None
    assert metrics.cached_token_rate == 0.0


def test_tpot_needs_two_tokens():
    assert record(0, 0.1, 0.1, completion_tokens=1).tpot_s is None
    assert record(0, 0.1, 0.3, completion_tokens=3).tpot_s == pytest.approx(0.1)


def test_stream_chunks_classify_role_held_back_and_closing_pieces():
    result = bench.StreamResult()
    last = bench.absorb_chunk(result, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.1, None)
    assert result.ttft_s is None
    last = bench.absorb_chunk(result, {"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}, 0.2, last)
    last = bench.absorb_chunk(result, {"choices": [{"text": "", "finish_reason": None}]}, 0.25, last)
    last = bench.absorb_chunk(result, {"choices": [{"text": "", "finish_reason": "length"}]}, 0.26, last)
    bench.absorb_chunk(result, {"choices": [], "usage": {"prompt_tokens": 3}}, 0.27, last)
    assert result.ttft_s == 0.2 and result.itl_s == pytest.approx([0.05])
    assert result.finish_reason == "length" and result.usage == {"prompt_tokens": 3}
    bench.absorb_chunk(result, {"error": {"message": "bad"}}, 0.3, last)
    assert "bad" in result.error


def test_usage_counts_treat_missing_details_as_zero():
    assert bench.usage_counts({"prompt_tokens": 10, "completion_tokens": 2}) == (10, 2, 0, {})
    usage = {"prompt_tokens": 10, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 8, "cached_tokens_by_source": {"local": 8, "disk": 0}}}
    assert bench.usage_counts(usage) == (10, 2, 8, {"local": 8, "disk": 0})
    assert bench.usage_counts(None) == (0, 0, 0, {})


def test_poisson_arrivals_are_seeded():
    delays = bench.arrival_delays(200, 10.0, seed=3)
    assert delays == bench.arrival_delays(200, 10.0, seed=3) and delays[0] == 0.0
    assert delays[-1] / 199 == pytest.approx(0.1, rel=0.25)
    assert bench.arrival_delays(3, math.inf, seed=3) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------------
# The client against a fake OpenAI server (stdlib HTTP server in a thread)

FAKE_PAGE = 16


class FakeOpenAI:
    """A streaming OpenAI-style server that reports cached tokens like a prefix cache of 16-token pages would.

    It answers token ids 1000 + i (sent as ``token_ids`` when asked), records every body it gets, and fails the
    requests whose numbers (0-based arrival order) are in ``fail``.
    """

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.seen: list[list[Any]] = []
        self.fail: set[int] = set()
        self.lock = threading.Lock()

    def cached_tokens(self, prompt: list[Any]) -> int:
        best = 0
        for old in self.seen:
            common = 0
            for a, b in zip(old, prompt):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return min(best, len(prompt) - 1) // FAKE_PAGE * FAKE_PAGE

    def handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                body = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    number = len(fake.bodies)
                    fake.bodies.append(body)
                    prompt = body.get("prompt")
                    if prompt is None:
                        prompt = list("".join(m["role"] + m["content"] for m in body["messages"]))
                    elif isinstance(prompt, str):
                        prompt = prompt.split(" ")
                    cached = fake.cached_tokens(prompt)
                    fake.seen.append(prompt)
                if number in fake.fail:
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b'{"error": {"message": "injected failure"}}')
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                chat = "messages" in body
                if chat:
                    self.send_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                for i in range(body["max_tokens"]):
                    time.sleep(0.002)
                    finish = "length" if i == body["max_tokens"] - 1 else None
                    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
                    if chat:
                        choice["delta"] = {"content": f" w{i}"}
                    else:
                        choice["text"] = f" w{i}"
                    if body.get("return_token_ids"):
                        choice["token_ids"] = [1000 + i]
                    self.send_event({"choices": [choice], "usage": None})
                usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                         "prompt_tokens_details": {"cached_tokens": cached,
                                                   "cached_tokens_by_source": {"local": cached, "peer": 0}}}
                self.send_event({"choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")

            def send_event(self, chunk: dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()

        return Handler


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeOpenAI]]:
    fake = FakeOpenAI()
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", fake
    server.shutdown()
    server.server_close()


def run_bench(base_url: str, *, workload: str = "shared-prefix", **overrides: Any) -> bench.BenchRun:
    """run_benchmark with small defaults; ``overrides`` go to the three configs by field name."""
    workload_fields = {k: overrides.pop(k) for k in list(overrides) if k in wl.WorkloadConfig.__dataclass_fields__}
    load_fields = {k: overrides.pop(k) for k in list(overrides) if k in bench.LoadConfig.__dataclass_fields__}
    factory = overrides.pop("factory", id_factory())
    tokenizer = overrides.pop("tokenizer", None)
    client = bench.ClientConfig(base_url=base_url, **overrides)
    load = bench.LoadConfig(**{"concurrency": 2, **load_fields})
    config = wl.WorkloadConfig(**{
        "workload": workload, "num_requests": 6, "num_prefixes": 1, "prefix_len": 64, "suffix_len": 8,
        "output_len": 4, **workload_fields,
    })
    return asyncio.run(bench.run_benchmark(client, load, config, factory, tokenizer, show_progress=False))


def test_client_measures_every_request_and_reads_cached_tokens(fake_server):
    base_url, fake = fake_server
    run = run_bench(base_url, concurrency=1)
    assert run.model == "fake-model"
    assert run.metrics.num_completed == 6 and run.metrics.num_errors == 0
    assert [r.request_index for r in run.records] == list(range(6))
    assert all(r.completion_tokens == 4 and len(r.itl_s) == 3 and r.ttft_s > 0 for r in run.records)
    assert run.records[0].cached_tokens == 0
    assert all(r.cached_tokens == 64 for r in run.records[1:])
    assert run.metrics.cached_token_rate == pytest.approx(5 * 64 / (6 * 72))
    assert run.metrics.cached_tokens_by_source == {"local": 320, "peer": 0}
    body = fake.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 4
    assert body["model"] == "fake-model" and len(body["prompt"]) == 72


def test_warmup_is_sent_first_and_left_out_of_the_figures(fake_server):
    base_url, fake = fake_server
    run = run_bench(base_url, warmup_requests=3, num_requests=4, concurrency=1)  # request 0 is then sent first
    assert len(run.warmup_records) == 3 and all(r.warmup for r in run.warmup_records)
    assert run.metrics.num_requests == 4
    assert len(fake.bodies) == 7
    assert run.records[0].cached_tokens == 0  # warm-up did not fill the measured prefix


def test_failed_requests_are_counted_not_fatal(fake_server):
    base_url, fake = fake_server
    fake.fail = {1, 3}
    run = run_bench(base_url, concurrency=1)
    assert (run.metrics.num_completed, run.metrics.num_errors) == (4, 2)
    failed = [r for r in run.records if not r.success]
    assert all(r.http_status == 500 and "injected failure" in r.error for r in failed)


def test_multi_turn_resends_history_and_the_servers_answer(fake_server):
    base_url, fake = fake_server
    run = run_bench(base_url, workload="multi-turn", num_requests=3, num_turns=3, prefix_len=32, suffix_len=8,
                    output_len=4, return_token_ids=True)
    assert run.metrics.num_completed == 3
    prompts = [body["prompt"] for body in fake.bodies]
    assert [len(p) for p in prompts] == [40, 52, 64]
    assert prompts[1][:40] == prompts[0] and prompts[1][40:44] == [1000, 1001, 1002, 1003]
    assert prompts[2][:52] == prompts[1]
    assert [r.answer_source for r in run.records] == ["server", "server", None]
    assert [r.cached_tokens for r in run.records] == [0, 32, 48]


def test_multi_turn_without_token_ids_uses_stand_in_answers_of_the_right_length(fake_server):
    base_url, fake = fake_server
    run = run_bench(base_url, workload="multi-turn", num_requests=2, num_turns=2, prefix_len=16, suffix_len=4)
    assert [len(body["prompt"]) for body in fake.bodies] == [20, 28]
    assert run.records[0].answer_source == "synthetic"


def test_chat_endpoint_sends_messages_and_skips_the_role_chunk(fake_server):
    base_url, fake = fake_server
    run = run_bench(base_url, workload="multi-turn", endpoint="chat", num_requests=2, num_turns=2,
                    factory=wl.make_prompt_factory("text", None, None))
    assert run.metrics.num_completed == 2
    second = fake.bodies[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"] == " w0 w1 w2 w3"
    assert all(len(r.itl_s) == 3 for r in run.records)


def test_cli_writes_json_table_and_plots_and_compare_reads_them(fake_server, tmp_path, capsys):
    base_url, _ = fake_server
    common = ["--base-url", base_url + "/v1", "--num-requests", "6", "--num-prefixes", "2", "--prefix-len", "64",
              "--suffix-len", "8", "--output-len-range", "2:5", "--concurrency", "3", "--request-rate", "200",
              "--warmup-requests", "2", "--no-progress"]
    shared, unique = tmp_path / "shared.json", tmp_path / "unique.json"
    assert bench.main(common + ["--result-file", str(shared), "--plot", str(tmp_path / "ttft.png")]) == 0
    assert bench.main(common + ["--workload", "unique", "--result-file", str(unique), "--label", "no reuse"]) == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "Request throughput" in out and "Cached prompt tokens" in out
    result = json.loads(shared.read_text())
    assert set(result) >= {"format_version", "label", "started_at", "server", "config", "metrics", "requests"}
    assert result["config"]["workload"]["output_len_range"] == [2, 5]
    assert result["config"]["load"]["request_rate"] == 200.0
    assert len(result["requests"]) == 8 and sum(r["warmup"] for r in result["requests"]) == 2
    assert result["metrics"]["cached_token_rate"] > 0
    assert json.loads(unique.read_text())["metrics"]["cached_token_rate"] == 0
    assert (tmp_path / "ttft.png").read_bytes()[:4] == b"\x89PNG"
    chart, table = tmp_path / "compare.png", tmp_path / "compare.md"
    assert bench.main(["compare", str(shared), str(unique), "--plot", str(chart), "--markdown", str(table)]) == 0
    out = capsys.readouterr().out
    assert "no reuse" in out and "x)" in out
    assert chart.read_bytes()[:4] == b"\x89PNG" and table.read_text().startswith("| run |")


def test_cli_reports_an_unreachable_server_without_a_traceback(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert bench.main(["--base-url", f"http://127.0.0.1:{port}", "--no-progress"]) == 2
    assert "could not list models" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Against a real prefixserve server


class PortTaken(RuntimeError):
    """The server exited at start-up because its port was taken (by another process, after it was found free)."""


START_ATTEMPTS = 3


@contextmanager
def prefixserve_process(model_dir: Path, timeout_s: float = 240.0) -> Iterator[str]:
    """``prefixserve serve`` (DP=1, CPU, page 128, eager: the bench is what is tested, and a compile of the forward
    costs a start tens of seconds on a slow CI box) as a subprocess; yields its base URL once /health answers. The port
    is found free, then bound by the server seconds later: if another process took it meanwhile, the server exits and
    is started again on a fresh port."""
    for attempt in range(1, START_ATTEMPTS + 1):
        serving = False
        try:
            with _prefixserve_on_a_free_port(model_dir, timeout_s) as base_url:
                serving = True
                yield base_url
            return
        except PortTaken:
            if serving or attempt == START_ATTEMPTS:
                raise


@contextmanager
def _prefixserve_on_a_free_port(model_dir: Path, timeout_s: float) -> Iterator[str]:
    import httpx

    port = find_free_port()
    command = [
        sys.executable, "-m", "cluster", "serve", "--model", str(model_dir), "--devices", "cpu",
        "--data-parallel-degree", "1", "--kv-cache-page-size", "128", "--kv-cache-memory", "64MiB",
        "--dtype", "float32", "--port", str(port), "--enable-prefix-caching", "--enforce-eager",
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    # the server's output goes to a file: a pipe nobody reads while it runs would block it once full
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                log.seek(0)
                output = log.read()
                error = PortTaken if port_was_taken(output) else RuntimeError
                raise error(f"prefixserve serve exited with {process.returncode}:\n{output[-5000:]}")
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200 and \
                        httpx.get(base_url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefixserve serve did not answer /health within {timeout_s} s")
            time.sleep(1)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def bench_model_dir(tmp_path_factory) -> Path:
    from bench.tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("bench-model"), hidden_size=64, num_layers=2, vocab_size=1024)


def bench_against(base_url: str, result_file: Path, workload: str = "shared-prefix") -> dict[str, Any]:
    argv = ["--base-url", base_url, "--workload", workload, "--num-requests", "6", "--num-prefixes", "1",
            "--prefix-len", "256", "--suffix-len", "16", "--output-len", "4", "--concurrency", "2",
            "--warmup-requests", "1", "--vocab-size", "1024", "--no-progress", "--result-file", str(result_file)]
    assert bench.main(argv) == 0
    return json.loads(result_file.read_text())


def assert_sane(result: dict[str, Any]) -> None:
    metrics = result["metrics"]
    assert metrics["num_requests"] == 6 and metrics["num_completed"] == 6 and metrics["num_errors"] == 0
    assert metrics["prompt_tokens"] == 6 * 272 and metrics["completion_tokens"] == 6 * 4
    assert metrics["request_throughput"] > 0 and metrics["output_throughput"] > 0 and metrics["duration_s"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        dist = metrics[key]
        assert dist["count"] > 0 and 0 < dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    assert metrics["ttft_ms"]["p50"] <= metrics["e2e_ms"]["p50"]
    measured = [r for r in result["requests"] if not r["warmup"]]
    assert len(measured) == 6 and all(r["usage_reported"] and r["finish_reason"] == "length" for r in measured)


@pytest.mark.ray
def test_bench_against_a_real_prefixserve(bench_model_dir, tmp_path):
    """One server (each start of one costs a minute on a slow CI box): the shared-prefix workload reads cached tokens
    back by source; the unique workload, on the same server, shares no page. A server with caching off reports no
    cached tokens: tests/test_e2e_http.py::test_caching_off_reports_zero_cached_tokens (the flag's parsing:
    tests/test_cluster_config.py)."""
    with prefixserve_process(bench_model_dir) as base_url:
        cached = bench_against(base_url, tmp_path / "on.json")
        unique = bench_against(base_url, tmp_path / "unique.json", workload="unique")
    assert_sane(cached)
    assert cached["metrics"]["cached_token_rate"] > 0
    assert sum(cached["metrics"]["cached_tokens_by_source"].values()) == cached["metrics"]["cached_tokens"]
    assert_sane(unique)
    assert unique["metrics"]["cached_token_rate"] == 0
