"""The simulator's trace input (benchmarks/router_sim/trace.py), its client concurrency limit and shared-core option,
and the pure parts of benchmarks/sim_calibration.py: prompts rebuilt exactly as the bench runner sent them (checked
against a real bench run over a mock HTTP transport), the cost-model fit, the error arithmetic. No Ray."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.config import ClientConfig, LoadConfig
from bench.runner import run_benchmark
from bench.standard_workloads import make_params
from bench.workloads import IdPromptFactory, WorkloadConfig
from benchmarks.router_sim.__main__ import main as sim_main
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation
from benchmarks.router_sim.trace import load_trace, read_trace, token_page_keys, trace_row, write_trace
from benchmarks.sim_calibration import (
    calibration_errors,
    fit_costs,
    prompt_digest,
    rebuild_requests,
    trace_rows,
    zipf_trace_rows,
)

COST = CostModel()
PAGE = COST.page_size


def ids(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


# ---- trace input ---------------------------------------------------------------------------------------------------


def test_page_keys_are_chained_over_full_pages_only():
    shared = ids(0, 300)
    a = token_page_keys(shared + ids(1000, 100), PAGE)
    b = token_page_keys(shared + ids(2000, 100), PAGE)
    assert len(a) == len(b) == 3  # 400 tokens: 3 full pages, the partial 4th has no key
    assert a[:2] == b[:2] and a[2] != b[2]
    assert token_page_keys(ids(0, 127), PAGE) == []
    # a page's key depends on everything before it: same page tokens after a different first page differ
    assert token_page_keys(ids(5000, 128) + ids(128, 128), PAGE)[1] != a[1]


def test_trace_file_round_trip_and_bad_rows(tmp_path):
    rows = [trace_row("x", 0, 0, 0.5, ids(0, 300), 8, PAGE), trace_row("y", 0, 1, 1.0, ids(0, 400), 8, PAGE, 2.0)]
    path = tmp_path / "t.jsonl"
    write_trace(path, rows)
    assert read_trace(path) == rows
    path.write_text(json.dumps({"request_id": "z", "arrival_s": -1, "prompt_len": 5, "output_len": 1}) + "\n")
    with pytest.raises(ValueError, match=":1:"):
        read_trace(path)
    with pytest.raises(ValueError, match="page keys"):
        load_trace([{**rows[0], "page_keys": rows[0]["page_keys"][:1]}], PAGE)
    with pytest.raises(ValueError, match="mode"):
        load_trace(rows, PAGE, mode="open")


def test_timed_trace_replays_send_times_and_shares_prefixes_across_sessions():
    system = ids(0, 1024)
    rows = [trace_row("a", 0, 0, 0.0, system + ids(5000, 64), 4, PAGE),
            trace_row("b", 1, 0, 5.0, system + ids(6000, 64), 4, PAGE)]
    workload = load_trace(rows, PAGE, mode="timed", num_pages_per_replica=64)
    first, second = workload.all_requests()
    assert (first.ideal_cached_pages, second.ideal_cached_pages) == (0, 8)
    simulation = Simulation(workload, "prefixserve", 2, COST)
    result = simulation.run()
    assert second.arrival_s == 5.0 and second.replica == first.replica and second.cached_local == 1024
    assert result.hit_rate == pytest.approx(1024 / (2 * 1088))
    # a lone first request costs exactly the cost model: one prefill step of 1088 tokens
    assert first.first_token_s == pytest.approx((COST.step_ms + COST.prefill_chunk_ms(1088, 0)) / 1000.0)


def test_later_turns_wait_for_the_previous_turn_and_its_gap():
    rows = [trace_row("t0", 7, 0, 0.0, ids(0, 200), 4, PAGE),
            trace_row("t1", 7, 1, 0.1, ids(0, 200) + ids(900, 60), 4, PAGE, min_gap_s=3.0)]
    for mode, earliest in (("timed", 3.0), ("closed", 3.0)):
        workload = load_trace(rows, PAGE, mode=mode)
        Simulation(workload, "prefixserve", 1, COST).run()
        turn0, turn1 = workload.all_requests()
        # sent after turn 0 finished and no sooner than 3 s after turn 0 was sent (not at its recorded 0.1 s)
        assert turn1.arrival_s == pytest.approx(max(turn0.finished_s, earliest))
        assert turn1.cached_local == 128  # turn 0's one full prompt page
    # timed: a recorded send time later than both bounds is kept
    late = [rows[0], {**rows[1], "arrival_s": 9.0}]
    workload = load_trace(late, PAGE, mode="timed")
    Simulation(workload, "prefixserve", 1, COST).run()
    assert workload.all_requests()[1].arrival_s == 9.0


def test_closed_loop_keeps_at_most_concurrency_in_flight():
    rows = [trace_row(f"r{i}", i, 0, 0.0, ids(10_000 * i, 600), 8, PAGE) for i in range(6)]
    workload = load_trace(rows, PAGE, mode="closed")
    simulation = Simulation(workload, "round-robin", 2, COST, concurrency=2)
    simulation.run()
    requests = sorted(workload.all_requests(), key=lambda r: r.arrival_s)
    events = sorted([(r.arrival_s, 1) for r in requests] + [(r.finished_s, -1) for r in requests],
                    key=lambda e: (e[0], e[1]))
    in_flight, peak = 0, 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak == 2
    # the held ones were sent as slots freed (TTFT counts from the send), in order
    assert [r.request_id for r in requests[:2]] == ["r0", "r1"]
    assert requests[2].arrival_s == pytest.approx(min(requests[0].finished_s, requests[1].finished_s))


def test_shared_cores_slow_concurrent_steps():
    rows = [trace_row(f"r{i}", i, 0, 0.0, ids(10_000 * i, 1000), 1, PAGE) for i in range(2)]
    alone = load_trace(rows, PAGE)
    Simulation(alone, "round-robin", 2, COST).run()
    shared = load_trace(rows, PAGE)
    Simulation(shared, "round-robin", 2, COST, cores=1.0).run()
    one_step = (COST.step_ms + COST.prefill_chunk_ms(1000, 0)) / 1000.0
    assert [r.first_token_s for r in alone.all_requests()] == pytest.approx([one_step, one_step])
    # the first replica starts alone (full speed), the second while the first is stepping: twice as slow
    assert sorted(r.first_token_s for r in shared.all_requests()) == pytest.approx([one_step, 2 * one_step])


# ---- the calibration script's pure parts ---------------------------------------------------------------------------


def sse_server(sent: list):
    """A mock OpenAI completions server: records each prompt, streams max_tokens one-character chunks + usage."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        sent.append(body["prompt"])
        chunks = [{"choices": [{"index": 0, "text": "x", "finish_reason": None}], "replica_id": "r"}
                  for _ in range(body["max_tokens"])]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": 0}}
        chunks.append({"choices": [], "usage": usage})
        text = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("workload, params, num_requests", [
    ("multi-round-qa", dict(num_users=2, num_rounds=3, qps=100.0, shared_system_prompt=200, user_history_prompt=150,
                            answer_len=5, question_len=7), 6),
    ("generated-shared-prefix", dict(num_groups=2, prompts_per_group=3, system_prompt_len=300, question_len=20,
                                     output_len=3), 6),
])
def test_rebuilt_prompts_are_exactly_what_the_bench_runner_sent(workload, params, num_requests):
    config = WorkloadConfig(workload=workload, num_requests=num_requests, standard=make_params(workload, params))
    sent: list = []
    run = asyncio.run(run_benchmark(ClientConfig(base_url="http://mock", model="m"), LoadConfig(concurrency=2),
                                    config, IdPromptFactory(8192), show_progress=False, http_client=sse_server(sent)))
    completion = {r.request_index: r.completion_tokens for r in run.records}
    rebuilt = rebuild_requests(config, IdPromptFactory(8192), completion)
    assert sorted(prompt_digest(p) for p in sent) == sorted(prompt_digest(r["prompt"]) for r in rebuilt)
    rows = trace_rows(rebuilt, run.records, PAGE)
    assert len(rows) == num_requests
    if workload == "multi-round-qa":  # later turns resend the whole conversation, so they extend earlier prompts
        by_session = {}
        for row in rows:
            by_session.setdefault(row["session"], []).append(row)
        for turns in by_session.values():
            turns.sort(key=lambda row: row["turn"])
            for earlier, later in zip(turns, turns[1:]):
                assert later["page_keys"][: len(earlier["page_keys"])] == earlier["page_keys"]
                assert later["min_gap_s"] == pytest.approx(2 / 100.0)


def test_zipf_trace_is_seeded_and_skewed():
    rows = zipf_trace_rows(200, 8, 1.5, 2, 512, 128, 16, 6.0, seed=3)
    assert rows == zipf_trace_rows(200, 8, 1.5, 2, 512, 128, 16, 6.0, seed=3)
    firsts = [row["hash_ids"][0] for row in rows]
    assert firsts.count(0) > 200 * 0.35 and all(row["input_length"] == 1152 for row in rows)
    assert len({row["hash_ids"][-1] for row in rows}) == 200  # each request's own last block
    assert all(b["timestamp"] >= a["timestamp"] for a, b in zip(rows, rows[1:]))
    lead = zipf_trace_rows(10, 8, 1.5, 2, 512, 128, 16, 6.0, seed=4, lead_s=2.0)
    assert lead[0]["hash_ids"][:2] == [0, 1] and lead[0]["timestamp"] == 0 and lead[1]["timestamp"] == 2000.0


def test_fit_costs_recovers_a_known_cost_model():
    truth = CostModel(step_ms=10.0, prefill_token_ms=0.2, attention_pair_us=0.1, decode_row_ms=3.0,
                      decode_context_us=1.5, peer_copy_page_ms=2.0, cached_token_us=5.0, request_overhead_ms=7.0)
    ctx_short, ctx_long = 144, 2064

    def ttft(new: int, context: int) -> float:
        return (truth.request_overhead_ms + truth.step_ms + truth.prefill_chunk_ms(new, context)
                + truth.cached_token_us * 1e-3 * context)

    points = {**{f"ttft_cold_{n}": ttft(n, 0) for n in (64, 512, 1024, 2048)},
              "ttft_warm_1024": ttft(64, 1024), "ttft_warm_2048": ttft(64, 2048),
              "ttft_peer": ttft(64, 0) + truth.prefill_chunk_ms(64, 2048) - truth.prefill_chunk_ms(64, 0)
              + 16 * truth.peer_copy_page_ms,
              "tpot_b1": truth.step_ms + truth.decode_ms(1, ctx_short),
              "tpot_b1_long": truth.step_ms + truth.decode_ms(1, ctx_long),
              "tpot_b4": truth.step_ms + truth.decode_ms(4, 4 * ctx_short), "ctx_short": ctx_short,
              "ctx_long": ctx_long}
    fitted, extra = fit_costs(points)
    for name in ("step_ms", "prefill_token_ms", "attention_pair_us", "decode_row_ms", "decode_context_us",
                 "peer_copy_page_ms", "cached_token_us", "request_overhead_ms"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name)), name
    assert extra["ttft_constant_ms"] == pytest.approx(17.0)


def test_calibration_errors():
    errors = calibration_errors({"hit_rate": 0.8, "ttft_p50_ms": 200.0, "ttft_p99_ms": 0.0},
                                {"hit_rate": 0.6, "ttft_p50_ms": 300.0, "ttft_p99_ms": 5.0},
                                ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "missing"))
    assert errors["hit_rate"]["rel_error"] == pytest.approx(-0.25)
    assert errors["ttft_p50_ms"]["ratio"] == pytest.approx(1.5)
    assert errors["ttft_p99_ms"]["rel_error"] is None and errors["missing"]["ratio"] is None


def test_trace_command_line_replays_a_file_under_each_router(tmp_path, capsys):
    system = ids(0, 512)
    rows = [trace_row(f"r{i}", i, 0, 0.2 * i, system + ids(10_000 * (i + 1), 64), 4, PAGE) for i in range(6)]
    path = tmp_path / "t.jsonl"
    write_trace(path, rows)
    assert sim_main(["trace", str(path), "--dp", "2", "--routers", "prefixserve,round-robin", "--pages", "64"]) == 0
    ours, blind = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert ours["router"] == "prefixserve" and blind["router"] == "round-robin"
    assert ours["num_requests"] == blind["num_requests"] == 6
    assert ours["hit_rate"] == pytest.approx(ours["ideal_hit_rate"]) and blind["hit_rate"] < ours["hit_rate"]
