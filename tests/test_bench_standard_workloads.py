"""Other projects' named workloads (bench/standard_workloads.py) with their published parameters, and Mooncake trace
replay: shapes, sharing, seeding, pacing; the CLI flags; one paced run against the fake OpenAI server of test_bench."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench import cli
from bench import workloads as wl
from bench.standard_workloads import build_standard_sessions, make_params, read_mooncake_trace
from tests.test_bench import fake_server, run_bench  # noqa: F401 - the fixture is used by name

FACTORY = wl.IdPromptFactory(vocab_size=1024)


def sessions_of(workload: str, num_requests: int = 40, seed: int = 0, **overrides):
    return build_standard_sessions(workload, make_params(workload, overrides), FACTORY, seed, num_requests)


def prompt(session: wl.Session, turn: int = 0) -> list[int]:
    return session.system + session.turns[turn].user


def test_published_defaults():
    assert vars(make_params("generated-shared-prefix", {})) == dict(
        num_groups=64, prompts_per_group=16, system_prompt_len=2048, question_len=128, output_len=256)
    assert vars(make_params("prefix-repetition", {})) == dict(prefix_len=256, suffix_len=256, num_prefixes=10,
                                                              output_len=128)
    assert vars(make_params("shared-prefix-groups", {})) == dict(num_groups=32, num_prompts_per_group=32,
                                                                 system_prompt_len=2048, question_len=256,
                                                                 output_len=256)
    assert vars(make_params("multi-round-qa", {})) == dict(num_users=10, num_rounds=5, qps=0.5,
                                                           shared_system_prompt=1000, user_history_prompt=2000,
                                                           answer_len=100, question_len=20)
    with pytest.raises(ValueError, match="question_len must be > 0"):
        make_params("generated-shared-prefix", {"question_len": 0})
    with pytest.raises(ValueError, match="--trace-file"):
        make_params("mooncake-trace", {})


def test_generated_shared_prefix_groups_share_their_system_prompt_and_are_shuffled():
    sessions = sessions_of("generated-shared-prefix", num_groups=4, prompts_per_group=3, system_prompt_len=256,
                           question_len=16, output_len=8)
    assert len(sessions) == 12 and Counter(s.group for s in sessions) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert [s.turns[0].request_index for s in sessions] == list(range(12))
    systems = {s.group: s.system for s in sessions}
    assert all(s.system == systems[s.group] and len(s.system) == 256 for s in sessions)
    assert len({tuple(v) for v in systems.values()}) == 4
    assert all(len(s.turns[0].user) == 16 and s.turns[0].output_len == 8 for s in sessions)
    assert len({tuple(prompt(s)) for s in sessions}) == 12
    assert [s.group for s in sessions] != sorted(s.group for s in sessions)  # shuffled, like SGLang's
    again = sessions_of("generated-shared-prefix", num_groups=4, prompts_per_group=3, system_prompt_len=256,
                        question_len=16, output_len=8)
    assert [prompt(s) for s in again] == [prompt(s) for s in sessions]


def test_shared_prefix_groups_keep_group_order():
    sessions = sessions_of("shared-prefix-groups", num_groups=3, num_prompts_per_group=2, system_prompt_len=128,
                           question_len=8, output_len=4)
    assert [s.group for s in sessions] == [0, 0, 1, 1, 2, 2]
    assert sessions[0].system == sessions[1].system != sessions[2].system


def test_prefix_repetition_gives_n_over_k_requests_per_prefix():
    sessions = sessions_of("prefix-repetition", num_requests=23, num_prefixes=5, prefix_len=64, suffix_len=32)
    assert len(sessions) == 20 and Counter(s.group for s in sessions) == {k: 4 for k in range(5)}
    assert all(len(prompt(s)) == 96 and s.turns[0].output_len == 128 for s in sessions)
    with pytest.raises(ValueError, match="--num-requests"):
        sessions_of("prefix-repetition", num_requests=3, num_prefixes=5)


def test_multi_round_qa_users_rounds_history_and_pacing():
    sessions = sessions_of("multi-round-qa", num_users=3, num_rounds=4, qps=2.0, shared_system_prompt=100,
                           user_history_prompt=50, question_len=10, answer_len=7)
    assert len(sessions) == 3 and all(len(s.turns) == 4 for s in sessions)
    assert all(s.system == sessions[0].system and len(s.system) == 100 for s in sessions)
    assert [s.start_s for s in sessions] == [0.0, 0.5, 1.0]  # user u starts at u / qps
    assert all(t.min_gap_s == 1.5 and t.output_len == 7 for s in sessions for t in s.turns)  # rounds U / qps apart
    first = [s.turns[0].user for s in sessions]
    assert all(len(user) == 60 for user in first) and len({tuple(u[:50]) for u in first}) == 3  # own histories
    assert all(len(t.user) == 10 for s in sessions for t in s.turns[1:])
    assert sorted(t.request_index for s in sessions for t in s.turns) == list(range(12))


def write_trace(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_mooncake_trace_shares_exactly_the_blocks_of_common_hash_ids(tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl", [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 250, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [0, 3]},
        {"timestamp": 1500, "input_length": 700, "output_length": 3, "hash_ids": [4]},  # longer than its blocks
    ])
    sessions = sessions_of("mooncake-trace", trace_file=trace, time_scale=0.5)
    prompts = [prompt(s) for s in sessions]
    assert [len(p) for p in prompts] == [1100, 1024, 600, 700]
    assert [s.start_s for s in sessions] == [0.0, 0.125, 0.5, 0.75]
    assert [s.turns[0].output_len for s in sessions] == [5, 7, 3, 3]
    assert prompts[1] == prompts[0][:1024]  # hash ids 0, 1 in common
    assert prompts[2][:512] == prompts[0][:512] and prompts[2][512:] != prompts[0][512:600]
    assert prompts[3][:512] != prompts[0][:512]
    assert len(sessions_of("mooncake-trace", trace_file=trace, max_requests=2)) == 2


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 10}', "not a Mooncake trace row"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": []}', "timestamp must be >= 0"),
    ("not json", "not a Mooncake trace row"),
])
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: {message}"):
        read_mooncake_trace(str(path))


def test_cli_flags_override_the_published_parameters():
    parser = cli.add_arguments(cli.argparse.ArgumentParser())
    args = parser.parse_args(["--workload", "generated-shared-prefix", "--gsp-num-groups", "2",
                              "--gsp-output-len", "9"])
    _, _, config, _ = cli.configs_from_args(args)
    assert (config.workload, config.standard.num_groups, config.standard.output_len,
            config.standard.system_prompt_len) == ("generated-shared-prefix", 2, 9, 2048)
    args = parser.parse_args(["--workload", "multi-round-qa", "--num-users", "2", "--qps", "4"])
    assert cli.configs_from_args(args)[2].standard.qps == 4.0
    assert cli.configs_from_args(parser.parse_args(["--workload", "shared-prefix"]))[2].standard is None


def test_runner_paces_multi_round_qa_and_replays_trace_times(fake_server, tmp_path):  # noqa: F811
    base_url, fake = fake_server
    params = make_params("multi-round-qa", dict(num_users=2, num_rounds=2, qps=10.0, shared_system_prompt=32,
                                                user_history_prompt=16, question_len=8, answer_len=3))
    run = run_bench(base_url, workload="multi-round-qa", standard=params, concurrency=0, return_token_ids=True)
    assert run.metrics.num_completed == 4
    starts = {(r.session_id, r.turn): r.start_s for r in run.records}
    assert starts[(1, 0)] >= 0.1 - 0.01  # user 1 starts 1 / qps after user 0
    assert starts[(0, 1)] - starts[(0, 0)] >= 0.2 - 0.01  # rounds of one user U / qps apart
    second = [body["prompt"] for body in fake.bodies if len(body["prompt"]) > 56]
    assert len(second) == 2 and all(len(p) == 32 + 16 + 8 + 3 + 8 for p in second)  # history + answer resent

    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [7]},
        {"timestamp": 300, "input_length": 40, "output_length": 2, "hash_ids": [7]}])
    run = run_bench(base_url, workload="mooncake-trace", standard=make_params("mooncake-trace", dict(
        trace_file=trace, block_size=32)), concurrency=0)
    assert run.metrics.num_completed == 2 and run.records[1].start_s >= 0.29
    assert run.records[1].cached_tokens == 32  # the fake's 16-token pages: the shared 32-token block
