"""Seeded workloads, sized to published ones, as page-key streams (no tokenizer: a prompt is a list of segments).

    sglang-gsp        SGLang bench_serving generated-shared-prefix: 64 groups x 16 prompts, 2048-token system prompt,
                      128-token question, 256 out; shuffled, Poisson arrivals at ``load`` x modeled cluster capacity
    llmd-prefix       llm-d's shared-prefix: 150 groups x 5 users, 6000-token prefix, 1200-token question, 1000 out;
                      five Poisson stages rising in QPS (0.4, 0.6, 0.8, 1.0, 1.2 x ``load`` x capacity), every user one
                      request per stage; KV pages per replica sized so its share of the prefixes plus 8 running
                      requests are 73% of them
    zipf              32 prefixes of 2048 tokens, popularity Zipf(1.1) (the hottest ~29% of the traffic: more than one
                      replica's share at every DP here), 128-token question, 128 out, Poisson at ``load`` x capacity
    multi-turn        4 x DP chats of 12-18 turns over 8 shared 1024-token system prompts; each turn 64-256 new user
                      tokens and 128 out; the next turn is sent 0-4 s (uniform) after the previous answer ends

A segment is (segment id, number of tokens); its tokens are distinct from every other segment's. A page's key chains
its parent's key with the (segment id, start, end) pieces covering it, so equal keys mean equal prefixes, as with the
real page keys (common/page_keys.py), at a fraction of the hashing cost. A request keeps its segments, so the router
gets partial page keys from them the same way (``segment_partial_key``; router/policy.py ``PartialKey``).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Sequence

from benchmarks.router_sim.costs import CostModel

Segment = tuple  # (segment id: str, num_tokens: int)


@dataclass
class SimRequest:
    request_id: str
    arrival_s: float
    """Absolute for a first turn; for a later turn of a chat, the think time after the previous turn ended."""
    prompt_len: int
    out_len: int
    page_keys: tuple
    """Keys of the prompt's full pages."""
    final_keys: tuple
    """Keys of the full pages of prompt + output (what the replica caches when the request ends)."""
    ideal_cached_pages: int = 0
    """Leading reusable pages some earlier request already had: what a perfect cluster cache would reuse."""
    segments: tuple = ()
    """Segments whose first ``prompt_len`` tokens are the prompt (a chat's turns share the whole conversation's); the
    router's partial page keys come from them. Empty (a trace): the request has none."""
    next_turn: "SimRequest | None" = None
    min_gap_s: float = 0.0
    """A later turn: sent no sooner than this long after the previous turn was sent (bench's multi-round-qa pacing)."""
    not_before_s: float = 0.0
    """A later turn: sent no sooner than this absolute time (a timed trace's recorded send time)."""
    # filled by the simulator
    first_turn: bool = True
    routed_s: float = 0.0
    first_token_s: float = -1.0
    finished_s: float = -1.0
    replica: int = -1
    cached_local: int = 0
    cached_peer: int = 0
    cached_tier: int = 0
    peer_hint: object = None
    holder_wait_since: float = -1.0
    """When it first waited for pages its hinted peer was computing (-1: never)."""
    reason: str = ""


@dataclass
class Workload:
    name: str
    first_requests: list = field(default_factory=list)
    """Requests that arrive at their own arrival_s (chats: only the first turns)."""
    num_pages_per_replica: int = 1024
    description: str = ""

    def all_requests(self) -> list:
        out = []
        for request in self.first_requests:
            while request is not None:
                out.append(request)
                request = request.next_turn
        return out


def chain_keys(segments: Sequence[Segment], page_size: int) -> list:
    """Keys of every full page of the token stream the segments spell."""
    keys = []
    parent = b""
    pieces: list = []
    filled = 0
    for segment_id, length in segments:
        offset = 0
        while offset < length:
            take = min(page_size - filled, length - offset)
            pieces.append(f"{segment_id}:{offset}:{offset + take}")
            offset += take
            filled += take
            if filled == page_size:
                parent = hashlib.blake2b(parent + "|".join(pieces).encode(), digest_size=32).digest()
                keys.append(parent)
                pieces = []
                filled = 0
    return keys


def segment_partial_key(segments: Sequence[Segment], page_keys: Sequence, prompt_len: int, page_size: int,
                        num_pages: int, num_tokens: int) -> bytes | None:
    """The simulator's partial page key (router/policy.py ``PartialKey``) of a prompt spelled by the first
    ``prompt_len`` tokens of ``segments``: the (segment id, start, end) pieces covering the ``num_tokens`` tokens after
    its first ``num_pages`` full pages, chained to the last of those pages' keys, as ``chain_keys`` keys a page."""
    start = num_pages * page_size
    end = start + num_tokens
    if not 0 < num_pages <= len(page_keys) or num_tokens < 0 or end > prompt_len:
        return None
    pieces = []
    offset = 0
    for segment_id, length in segments:
        if offset >= end:
            break
        if offset + length > start:
            pieces.append(f"{segment_id}:{max(start - offset, 0)}:{min(end - offset, length)}")
        offset += length
    return hashlib.blake2b(page_keys[num_pages - 1] + ("partial|" + "|".join(pieces)).encode(), digest_size=16).digest()


def request_seconds(cost: CostModel, new_tokens: int, context: int, out_len: int, batch: int = 16) -> float:
    """Replica time one request takes at a typical batch: its prefill plus its share of the decode steps."""
    prefill_ms = cost.prefill_chunk_ms(new_tokens, context) + math.ceil(new_tokens / cost.max_num_batched_tokens) * (
        cost.step_ms / batch)
    mean_context = context + new_tokens + out_len / 2
    decode_ms = out_len * (cost.step_ms / batch + cost.decode_ms(1, int(mean_context)))
    return (prefill_ms + decode_ms) / 1000.0


def _mark_ideal(requests: list, page_size: int) -> None:
    """ideal_cached_pages in arrival order (chats: turn order within a chat is the arrival order)."""
    seen: set = set()
    for request in sorted(requests, key=lambda r: r.arrival_s):
        reusable = request.page_keys[: (request.prompt_len - 1) // page_size]
        num = 0
        for key in reusable:
            if key not in seen:
                break
            num += 1
        request.ideal_cached_pages = num
        seen.update(request.final_keys)


def _poisson_times(rng: random.Random, rate: float, count: int, start: float = 0.0) -> list:
    times, now = [], start
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def sglang_gsp(dp: int, cost: CostModel, *, seed: int = 0, load: float = 0.7, scale: float = 1.0) -> Workload:
    rng = random.Random(f"sglang-gsp/{seed}")
    num_groups, per_group = max(1, round(64 * scale)), 16
    system_len, question_len, out_len = 2048, 128, 256
    pairs = [(g, i) for g in range(num_groups) for i in range(per_group)]
    rng.shuffle(pairs)
    mean_s = (request_seconds(cost, question_len, system_len, out_len) * (per_group - 1)
              + request_seconds(cost, system_len + question_len, 0, out_len)) / per_group
    times = _poisson_times(rng, load * dp / mean_s, len(pairs))
    requests = []
    for (group, index), arrival in zip(pairs, times):
        segments = [(f"g{group}", system_len), (f"g{group}q{index}", question_len)]
        keys = chain_keys(segments + [(f"g{group}q{index}o", out_len)], cost.page_size)
        prompt_len = system_len + question_len
        requests.append(SimRequest(f"g{group}-{index}", arrival, prompt_len, out_len,
                                   tuple(keys[: prompt_len // cost.page_size]), tuple(keys), segments=tuple(segments)))
    _mark_ideal(requests, cost.page_size)
    return Workload("sglang-gsp", requests, 1024, f"{num_groups} groups x {per_group}, 2048+128 in, 256 out, "
                                                 f"Poisson {load} x capacity")


def llmd_prefix(dp: int, cost: CostModel, *, seed: int = 0, load: float = 0.9, scale: float = 1.0) -> Workload:
    rng = random.Random(f"llmd-prefix/{seed}")
    num_groups, users = max(1, round(150 * scale)), 5
    prefix_len, question_len, out_len = 6000, 1200, 1000
    stages = (0.4, 0.6, 0.8, 1.0, 1.2)
    mean_s = request_seconds(cost, question_len, prefix_len, out_len)
    requests, start = [], 0.0
    for stage_index, fraction in enumerate(stages):
        pairs = [(g, u) for g in range(num_groups) for u in range(users)]
        rng.shuffle(pairs)
        times = _poisson_times(rng, fraction * load * dp / mean_s, len(pairs), start)
        start = times[-1]
        for (group, user), arrival in zip(pairs, times):
            name = f"s{stage_index}g{group}u{user}"
            segments = [(f"p{group}", prefix_len), (f"{name}q", question_len), (f"{name}o", out_len)]
            keys = chain_keys(segments, cost.page_size)
            prompt_len = prefix_len + question_len
            requests.append(SimRequest(name, arrival, prompt_len, out_len,
                                       tuple(keys[: prompt_len // cost.page_size]), tuple(keys),
                                       segments=tuple(segments)))
    _mark_ideal(requests, cost.page_size)
    prefix_pages = num_groups * (prefix_len // cost.page_size)
    request_pages = math.ceil((prefix_len + question_len + out_len) / cost.page_size)
    # demand (each replica's share of the prefixes + 8 running requests) = 73% of the replica's pages
    pages_per_replica = math.ceil((prefix_pages / dp + 8 * request_pages) / 0.73)
    return Workload("llmd-prefix", requests, pages_per_replica,
                    f"{num_groups} groups x {users} users, 6000+1200 in, 1000 out, stages {stages} x {load} x "
                    f"capacity, {pages_per_replica} pages per replica")


def zipf(dp: int, cost: CostModel, *, seed: int = 0, load: float = 0.8, scale: float = 1.0,
         num_prefixes: int = 32, exponent: float = 1.1) -> Workload:
    rng = random.Random(f"zipf/{seed}")
    prefix_len, question_len, out_len = 2048, 128, 128
    num_requests = max(16, round(1024 * scale))
    weights = [1.0 / (rank + 1) ** exponent for rank in range(num_prefixes)]
    mean_s = request_seconds(cost, question_len, prefix_len, out_len)
    times = _poisson_times(rng, load * dp / mean_s, num_requests)
    choices = rng.choices(range(num_prefixes), weights, k=num_requests)
    requests = []
    for number, (prefix, arrival) in enumerate(zip(choices, times)):
        name = f"z{prefix}q{number}"
        segments = [(f"z{prefix}", prefix_len), (name, question_len), (f"{name}o", out_len)]
        keys = chain_keys(segments, cost.page_size)
        prompt_len = prefix_len + question_len
        requests.append(SimRequest(f"z{prefix}-{number}", arrival, prompt_len, out_len,
                                   tuple(keys[: prompt_len // cost.page_size]), tuple(keys), segments=tuple(segments)))
    _mark_ideal(requests, cost.page_size)
    hot_share = weights[0] / sum(weights)
    return Workload("zipf", requests, 1024,
                    f"{num_prefixes} prefixes Zipf({exponent}), hottest {hot_share:.0%} of traffic = "
                    f"{hot_share * load * dp:.1f} replicas' worth, 2048+128 in, 128 out")


def multi_turn(dp: int, cost: CostModel, *, seed: int = 0, load: float = 0.7, scale: float = 1.0) -> Workload:
    rng = random.Random(f"multi-turn/{seed}")
    num_chats = max(2, round(4 * dp * scale))
    system_len, out_len = 1024, 128
    firsts = []
    all_requests = []
    for chat in range(num_chats):
        num_turns = rng.randint(12, 18)
        user_lens = [rng.randint(64, 256) for _ in range(num_turns)]
        segments = [(f"sys{chat % 8}", system_len)]
        for turn, user_len in enumerate(user_lens):
            segments += [(f"c{chat}u{turn}", user_len), (f"c{chat}a{turn}", out_len)]
        keys = chain_keys(segments, cost.page_size)
        conversation = tuple(segments)
        previous = None
        prompt_len = system_len
        start = rng.uniform(0, 10.0)
        for turn, user_len in enumerate(user_lens):
            prompt_len += user_len
            request = SimRequest(f"c{chat}t{turn}", start if turn == 0 else rng.uniform(0, 4.0), prompt_len, out_len,
                                 tuple(keys[: prompt_len // cost.page_size]),
                                 tuple(keys[: (prompt_len + out_len) // cost.page_size]), first_turn=turn == 0,
                                 segments=conversation)
            if previous is None:
                firsts.append(request)
            else:
                previous.next_turn = request
            previous = request
            all_requests.append(request)
            prompt_len += out_len
    # ideal: each chat's turns in order; chats interleave, system prompts shared (order of first turns)
    seen: set = set()
    for request in sorted(firsts, key=lambda r: r.arrival_s):
        turn = request
        while turn is not None:
            reusable = turn.page_keys[: (turn.prompt_len - 1) // cost.page_size]
            num = 0
            for key in reusable:
                if key not in seen:
                    break
                num += 1
            turn.ideal_cached_pages = num
            seen.update(turn.final_keys)
            turn = turn.next_turn
    return Workload("multi-turn", firsts, 1024, f"{num_chats} chats x 12-18 turns, 8 shared 1024-token system prompts, "
                                               "64-256 user tokens + 128 out per turn, think 0-4 s")


WORKLOADS = {"sglang-gsp": sglang_gsp, "llmd-prefix": llmd_prefix, "zipf": zipf, "multi-turn": multi_turn}
