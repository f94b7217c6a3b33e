"""The named prefix-caching workloads other projects publish, with their published parameters, and Mooncake traces.

Each builds :class:`bench.workloads.Session` objects (token-id or word prompts from the run's prompt factory, every
draw seeded) that the runner sends like any other workload::

    generated-shared-prefix   SGLang ``bench_serving --dataset-name generated-shared-prefix``: G groups, each a
                              system prompt of L_sys tokens shared by P prompts that add an L_q-token question; all
                              G x P requests shuffled. Published defaults: 64 groups x 16 prompts, 2048 / 128 tokens,
                              256 output tokens.
    prefix-repetition         vLLM ``bench serve --dataset-name prefix_repetition``: K prefixes of L_p tokens, each
                              followed by an L_s-token random suffix, N // K requests per prefix, shuffled. Published
                              defaults: 10 prefixes, 256 + 256 tokens, 128 output tokens (N is --num-requests).
    shared-prefix-groups      llm-d-benchmark's ``shared_prefix_synthetic`` profile of inference-perf's
                              ``shared_prefix`` data type: the same shape as SGLang's, in group order (inference-perf
                              sends each group's prompts in turn). Published: 32 groups x 32 prompts, 2048 / 256
                              tokens, 256 output tokens (inference-perf's own defaults: 10 x 10, 100 / 50, 50).
    multi-round-qa            LMCache ``benchmarks/multi-round-qa``: U users share one system prompt of L_sys tokens,
                              each has its own history of L_h tokens, and asks R questions one after the other; every
                              round resends the conversation so far (system + history + earlier questions and
                              answers) plus a new question, and asks for A tokens. Requests start at ``qps`` overall:
                              user u starts at u / qps, and its rounds are at least U / qps apart. Published: 10
                              users, 5 rounds, 0.5 qps, 1000 / 2000 tokens, 100-token answers (the question is ~20
                              tokens of text there; ``question_len`` here).
    mooncake-trace            A Mooncake-format trace (JSONL, one request per line: ``timestamp`` in ms,
                              ``input_length``, ``output_length``, ``hash_ids``): request i starts at its timestamp
                              (scaled by ``time_scale``); its prompt is the concatenation of one seeded block of
                              ``block_size`` tokens (512 in Mooncake's traces) per hash id, cut to ``input_length``,
                              so requests sharing leading hash ids share exactly those prefix tokens.

Token lengths are exact for id prompts and for word prompts built from a tokenizer (bench/workloads.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.workloads import PromptFactory, Session, Turn, seeded_rng

MAX_TRACE_LINE_BYTES = 1 << 20
MAX_TRACE_HASH_IDS = 1 << 16


@dataclass(frozen=True)
class GeneratedSharedPrefix:
    num_groups: int = 64
    prompts_per_group: int = 16
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256


@dataclass(frozen=True)
class PrefixRepetition:
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128


@dataclass(frozen=True)
class SharedPrefixGroups:
    num_groups: int = 32
    num_prompts_per_group: int = 32
    system_prompt_len: int = 2048
    question_len: int = 256
    output_len: int = 256


@dataclass(frozen=True)
class MultiRoundQA:
    num_users: int = 10
    num_rounds: int = 5
    qps: float = 0.5
    shared_system_prompt: int = 1000
    user_history_prompt: int = 2000
    answer_len: int = 100
    question_len: int = 20


@dataclass(frozen=True)
class MooncakeTrace:
    trace_file: str = ""
    time_scale: float = 1.0
    """Multiplies the trace's timestamps (0.5: twice as fast)."""
    block_size: int = 512
    max_requests: int | None = None
    """Replay only the first N lines."""


STANDARD_WORKLOADS: dict[str, type] = {
    "generated-shared-prefix": GeneratedSharedPrefix,
    "prefix-repetition": PrefixRepetition,
    "shared-prefix-groups": SharedPrefixGroups,
    "multi-round-qa": MultiRoundQA,
    "mooncake-trace": MooncakeTrace,
}


def make_params(workload: str, overrides: dict[str, Any]) -> Any:
    """The workload's published parameters with ``overrides`` (None values ignored); ValueError names bad ones."""
    params_class = STANDARD_WORKLOADS[workload]
    params = params_class(**{key: value for key, value in overrides.items() if value is not None})
    for name, value in vars(params).items():
        if name in ("trace_file", "max_requests"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not value > 0:
            raise ValueError(f"{workload}: {name} must be > 0, got {value}")
    if workload == "mooncake-trace":
        if not params.trace_file:
            raise ValueError("mooncake-trace needs --trace-file (JSONL: timestamp, input_length, output_length, "
                             "hash_ids)")
        if params.max_requests is not None and params.max_requests < 0:
            raise ValueError(f"--num-requests must be >= 0, got {params.max_requests}")
    return params


@dataclass
class _Builder:
    factory: PromptFactory
    seed: int
    sessions: list[Session] = field(default_factory=list)
    request_index: int = 0

    def piece(self, num_tokens: int, *names: object):
        return self.factory.make(num_tokens, seeded_rng(self.seed, *names)) if num_tokens else self.factory.empty()

    def add(self, group: int, system, users_and_outputs, start_s: float | None = None, min_gap_s: float = 0.0):
        turns = []
        for user, output_len in users_and_outputs:
            turns.append(Turn(self.request_index, user, output_len, min_gap_s=min_gap_s))
            self.request_index += 1
        self.sessions.append(Session(len(self.sessions), group, system, tuple(turns), start_s=start_s))


def build_standard_sessions(workload: str, params: Any, factory: PromptFactory, seed: int,
                            num_requests: int) -> list[Session]:
    """The sessions of a named workload (module docstring); ``num_requests`` only sizes prefix-repetition."""
    builder = _Builder(factory, seed)
    if workload in ("generated-shared-prefix", "shared-prefix-groups"):
        per_group = params.prompts_per_group if workload == "generated-shared-prefix" else params.num_prompts_per_group
        pairs = [(group, index) for group in range(params.num_groups) for index in range(per_group)]
        if workload == "generated-shared-prefix":
            seeded_rng(seed, workload, "shuffle").shuffle(pairs)
        systems = [builder.piece(params.system_prompt_len, workload, "system", g) for g in range(params.num_groups)]
        for group, index in pairs:
            question = builder.piece(params.question_len, workload, "question", group, index)
            builder.add(group, systems[group], [(question, params.output_len)])
    elif workload == "prefix-repetition":
        per_prefix = num_requests // params.num_prefixes
        if per_prefix == 0:
            raise ValueError(f"prefix-repetition needs --num-requests >= --prefix-repetition-num-prefixes "
                             f"({params.num_prefixes}), got {num_requests}")
        pairs = [(k, index) for k in range(params.num_prefixes) for index in range(per_prefix)]
        seeded_rng(seed, workload, "shuffle").shuffle(pairs)
        prefixes = [builder.piece(params.prefix_len, workload, "prefix", k) for k in range(params.num_prefixes)]
        for k, index in pairs:
            suffix = builder.piece(params.suffix_len, workload, "suffix", k, index)
            builder.add(k, prefixes[k], [(suffix, params.output_len)])
    elif workload == "multi-round-qa":
        system = builder.piece(params.shared_system_prompt, workload, "system")
        gap_s = params.num_users / params.qps
        for user in range(params.num_users):
            history = builder.piece(params.user_history_prompt, workload, "history", user)
            questions = [(history + builder.piece(params.question_len, workload, "question", user, 0),
                          params.answer_len)]
            questions += [(builder.piece(params.question_len, workload, "question", user, r), params.answer_len)
                          for r in range(1, params.num_rounds)]
            builder.add(0, system, questions, start_s=user / params.qps, min_gap_s=gap_s)
    elif workload == "mooncake-trace":
        blocks: dict[int, Any] = {}
        for row in read_mooncake_trace(params.trace_file, params.max_requests):
            pieces = []
            for hash_id in row["hash_ids"]:
                if hash_id not in blocks:
                    blocks[hash_id] = builder.piece(params.block_size, workload, "block", hash_id)
                pieces.append(blocks[hash_id])
            prompt = cut(pieces, row["input_length"], params.block_size, builder, row)
            group = row["hash_ids"][0] if row["hash_ids"] else -1
            builder.add(group, prompt, [(factory.empty(), row["output_length"])],
                        start_s=row["timestamp"] / 1000.0 * params.time_scale)
    else:
        raise ValueError(f"unknown standard workload {workload!r}")
    return builder.sessions


def cut(pieces: list, input_length: int, block_size: int, builder: _Builder, row: dict):
    """The first ``input_length`` tokens of the blocks (padded with seeded tokens if the hash ids cover fewer)."""
    num_covered = len(pieces) * block_size
    if input_length > num_covered:
        pieces = pieces + [builder.piece(input_length - num_covered, "mooncake-trace", "pad", row["line"])]
    prompt = pieces[0] if pieces else builder.factory.empty()
    for piece in pieces[1:]:
        prompt = prompt + piece
    if isinstance(prompt, list):
        return prompt[:input_length]
    words = prompt.split(" ")  # word prompts: " w1 w2 ...", one token per word
    return " ".join(words[: input_length + 1])


def read_mooncake_trace(path: str, max_requests: int | None = None) -> list[dict]:
    """The trace's rows (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``), validated and bounded;
    ValueError names the line of the first bad row."""
    rows = []
    with Path(path).open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if max_requests is not None and len(rows) >= max_requests:
                break
            if len(raw) > MAX_TRACE_LINE_BYTES:
                raise ValueError(f"{path}:{number}: line longer than {MAX_TRACE_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
                timestamp, input_length = float(row["timestamp"]), int(row["input_length"])
                output_length, hash_ids = int(row["output_length"]), [int(h) for h in row.get("hash_ids", [])]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a Mooncake trace row ({error!r}); expected "
                                 '{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}')
            if not (math.isfinite(timestamp) and timestamp >= 0 and input_length >= 1 and output_length >= 1
                    and len(hash_ids) <= MAX_TRACE_HASH_IDS):
                raise ValueError(f"{path}:{number}: timestamp must be >= 0 and lengths >= 1 "
                                 f"(at most {MAX_TRACE_HASH_IDS} hash ids)")
            rows.append({"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
                         "hash_ids": hash_ids, "line": number})
    return rows
