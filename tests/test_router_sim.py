"""The router simulator (benchmarks/router_sim): the cost model's arithmetic on an idle replica, cache hits and peer
copies as the engine counts them, events reaching the real index, and a tiny comparison run. Pure Python, no Ray."""

from __future__ import annotations

import json

import pytest

from benchmarks.router_sim.__main__ import main
from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.sim import Simulation, simulate
from benchmarks.router_sim.workloads import SimRequest, Workload, chain_keys, segment_partial_key
from router.replication import HotPrefixPlanner, ReplicationConfig

COST = CostModel()


def request(name: str, arrival_s: float, segments: list, out_len: int = 4) -> SimRequest:
    prompt_len = sum(length for _, length in segments)
    keys = chain_keys(segments + [(f"{name}-out", out_len)], COST.page_size)
    return SimRequest(name, arrival_s, prompt_len, out_len, tuple(keys[: prompt_len // COST.page_size]), tuple(keys))


def run(requests: list, router: str = "prefixserve", dp: int = 2, num_pages: int = 64) -> Simulation:
    simulation = Simulation(Workload("test", requests, num_pages), router, dp, COST)
    simulation.result = simulation.run()
    return simulation


def test_chain_keys_equal_for_equal_prefixes_only():
    a = chain_keys([("sys", 300), ("q1", 100)], 128)
    b = chain_keys([("sys", 300), ("q2", 100)], 128)
    assert len(a) == len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]  # page 2 holds tokens 256..383: 44 of sys, then the question
    assert chain_keys([("sys", 256)], 128) == a[:2]


def test_segment_partial_keys_tell_a_chat_s_next_turn_from_another_chat_on_the_same_system_prompt():
    """The simulator's stand-in for partial page keys from token ids: a turn's tail (the tokens after its last full
    page) is keyed as its next turn's first tokens after that page, and differs from another chat's tail."""
    def chat(name: str, user_len: int) -> tuple:
        return (("sys", 256), (f"{name}u0", user_len), (f"{name}a0", 100), (f"{name}u1", 80))

    one, two = chat("c1", 50), chat("c2", 50)
    keys_one, keys_two = chain_keys(one, 128), chain_keys(two, 128)
    assert keys_one[:2] == keys_two[:2] and keys_one[2] != keys_two[2]
    turn = segment_partial_key(one, keys_one[:2], 306, 128, 2, 50)  # the first turn: 2 pages + 50 user tokens
    assert segment_partial_key(one, keys_one[:3], 486, 128, 2, 50) == turn  # its next turn, over the same tokens
    assert segment_partial_key(one, keys_one[:3], 486, 128, 2, 49) != turn
    assert segment_partial_key(two, keys_two[:3], 486, 128, 2, 50) != turn  # another chat's next turn
    assert segment_partial_key(one, keys_one[:2], 306, 128, 2, 51) is None  # past the prompt
    simulation = Simulation(Workload("test", [], 64), "prefixserve", 2, COST)
    assert simulation.router.partial_key_of(request("trace", 0.0, [("p", 300)])) is None  # no segments


def test_a_lone_request_costs_exactly_the_cost_model():
    # 2500 prompt tokens, nothing cached: two prefill steps (2048 + 452 tokens), first token at the end of the second
    lone = request("lone", 1.0, [("p", 2500)], out_len=3)
    simulation = run([lone], dp=1)
    first = COST.step_ms + COST.prefill_chunk_ms(2048, 0)
    second = COST.step_ms + COST.prefill_chunk_ms(452, 2048)
    assert lone.first_token_s - lone.arrival_s == pytest.approx((first + second) / 1000.0)
    # then two decode steps (the first token came with the prefill), each over the KV context before it
    decode = sum(COST.step_ms + COST.decode_ms(1, 2500 + step) for step in range(2))
    assert lone.finished_s - lone.first_token_s == pytest.approx(decode / 1000.0)
    assert simulation.result.hit_rate == 0.0 and simulation.result.num_requests == 1


def test_a_repeat_hits_locally_and_a_hint_copies_from_the_peer():
    first = request("first", 0.0, [("sys", 1024), ("q1", 64)])
    again = request("again", 10.0, [("sys", 1024), ("q2", 64)])
    simulation = run([first, again], dp=2)
    assert (again.replica, again.cached_local, again.cached_peer, again.reason) == (
        first.replica, 1024, 0, "prefix_hit")
    # the index learnt the pages from the replica's stored events
    holder = simulation.replicas[first.replica].replica_id
    assert simulation.view.index.longest_prefix(again.page_keys) == {holder: 8}

    # the same pair with the holder busy: a third request copies the 8 pages from it instead of recomputing
    busy = [request(f"busy{n}", 0.0 + 0.001 * n, [(f"other{n}", 1500)]) for n in range(6)]
    first = request("first", 0.0, [("sys", 1024), ("q1", 64)])
    again = request("again", 3.0, [("sys", 1024), ("q2", 64)])
    simulation = run([first] + busy + [again], dp=2, num_pages=256)
    assert (again.replica, again.reason, again.cached_local, again.cached_peer) == (1 - first.replica, "cost_away", 0,
                                                                                    1024)
    assert simulation.replicas[again.replica].num_copied_pages == 8
    # the copy is on the receiver's critical path: 8 pages at 3.5 ms inside the step that admits the request
    assert again.first_token_s - again.arrival_s >= 8 * COST.peer_copy_page_ms / 1000.0


class Scripted:
    """A router that sends each named request to a fixed replica with a fixed peer hint."""

    name = "scripted"
    uses_index = False
    copy_enabled = True

    def __init__(self, plan: dict) -> None:
        self.plan = plan

    def route(self, request, now):
        number, hint = self.plan[request.request_id]
        return number, hint, "scripted"

    def on_finished(self, request):
        pass


def run_scripted(requests: list, plan: dict) -> Simulation:
    simulation = Simulation(Workload("test", requests, 256), "round-robin", 2, COST)
    simulation.router = Scripted(plan)
    simulation.result = simulation.run()
    return simulation


def test_a_request_hinted_at_a_holder_still_computing_waits_for_its_pages_then_copies():
    first = request("first", 0.0, [("sys", 1536), ("q1", 64)])
    again = request("again", 0.05, [("sys", 1536), ("q2", 64)])
    simulation = run_scripted([first, again], {"first": (0, None), "again": (1, 0)})
    # replica 1 held "again" back until replica 0 committed the 12 system pages, then copied them
    assert (again.cached_local, again.cached_peer) == (0, 1536)
    assert simulation.replicas[1].num_copied_pages == 12
    assert again.first_token_s > first.first_token_s
    alone = COST.step_ms + 12 * COST.peer_copy_page_ms + COST.prefill_chunk_ms(64, 1536)
    assert again.first_token_s == pytest.approx(first.first_token_s + alone / 1000.0)

    # a holder busy for longer than the holder's export waits (2 s): the request stops waiting and computes
    first = request("first", 0.0, [("sys", 6144), ("q1", 64)])
    again = request("again", 0.05, [("sys", 6144), ("q2", 64)])
    simulation = run_scripted([first, again], {"first": (0, None), "again": (1, 0)})
    assert first.first_token_s > 2.05 and again.cached_peer == 0
    assert simulation.replicas[1].num_copied_pages == 0
    assert again.first_token_s > 2.05  # it waited the whole bound first


def test_tiny_comparison_reaches_the_ideal_and_beats_round_robin():
    ours = simulate("sglang-gsp", "prefixserve", 4, scale=4 / 64)
    blind = simulate("sglang-gsp", "round-robin", 4, scale=4 / 64)
    assert ours.num_requests == blind.num_requests == 64 and ours.num_rejected == 0
    assert ours.hit_rate == pytest.approx(ours.ideal_hit_rate)
    assert blind.hit_rate < ours.hit_rate
    assert ours.ttft_p50_s < blind.ttft_p50_s
    assert sum(ours.reasons.values()) == 64 and ours.reasons["no_match"] == 4


@pytest.mark.parametrize("workload", ["llmd-prefix", "zipf", "multi-turn"])
def test_every_workload_runs_with_every_router_kind(workload):
    for router in ("prefixserve", "prefixserve-measured", "sglang-cache-aware", "llmd-scorers", "ray-prefix",
                   "dynamo-cost", "pow2"):
        result = simulate(workload, router, 2, scale=0.02)
        assert result.num_rejected == 0
        assert 0.0 <= result.hit_rate <= result.ideal_hit_rate + 1e-9
        assert result.ttft_p99_s >= result.ttft_p50_s > 0.0


def test_cli_compare_and_scale(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--workloads", "zipf", "--dp", "2", "--routers", "prefixserve,round-robin",
                 "--scale", "0.02", "--out", str(out)]) == 0
    table = out.with_suffix(".md").read_text()
    assert "## zipf, DP=2" in table and "| prefixserve |" in table and "| round-robin |" in table
    several = tmp_path / "seeds"
    assert main(["compare", "--workloads", "zipf", "--dp", "2", "--routers", "prefixserve,round-robin",
                 "--scale", "0.02", "--seeds", "0,1", "--out", str(several)]) == 0
    rows = json.loads(several.with_suffix(".json").read_text())
    assert sorted((row["router"], row["seed"]) for row in rows) == [("prefixserve", 0), ("prefixserve", 1),
                                                                    ("round-robin", 0), ("round-robin", 1)]
    ours = [row for row in rows if row["router"] == "prefixserve"]
    line = next(line for line in several.with_suffix(".md").read_text().splitlines() if line.startswith("| prefixs"))
    mean_hit = sum(row["hit_rate"] for row in ours) / 2
    assert line.startswith(f"| prefixserve | {mean_hit:.4f} ({ours[0]['hit_rate']:.3f} / {ours[1]['hit_rate']:.3f}) |")
    assert main(["scale", "--replicas", "8", "--pages", "2048", "--decisions", "200"]) == 0
    assert "decision wall time" in capsys.readouterr().out


def test_simulated_replicas_measure_their_costs_and_the_measured_router_reads_them():
    from benchmarks.router_sim.costs import COST_MODELS

    slow = COST_MODELS["slow-compute"]
    from benchmarks.router_sim.workloads import WORKLOADS

    simulation = Simulation(WORKLOADS["sglang-gsp"](2, slow, scale=4 / 64), "prefixserve-measured", 2, slow)
    simulation.run()
    replica = simulation.replicas[0]
    measured = replica.measured_costs()
    # prefill steps are priced exactly by the step model: the fit finds the true step, token and attention costs
    # (the decode row absorbs the context term at this workload's contexts)
    assert (measured.step_ms, measured.prefill_token_ms, measured.attention_pair_us) == pytest.approx(
        (slow.step_ms, slow.prefill_token_ms, slow.attention_pair_us), rel=0.1)
    assert measured.decode_row_ms > slow.decode_row_ms
    load = simulation.view.loads[0]
    assert load.costs is not None and simulation.router.policy.costs_of(load).prefill_token_ms == pytest.approx(
        measured.prefill_token_ms, rel=0.05)


def test_a_shared_host_tier_serves_an_evicted_prefix_and_the_router_hears_of_it():
    """With ``host_tier_pages`` the replicas write what they compute to one LRU host tier; a prefix evicted from
    its replica's small pool comes back from the tier (fetched, priced at host_tier_page_ms a page), and the tier's
    events reach our router's ``tier_index``. The same requests without a tier recompute it."""
    def requests() -> list:
        first = request("first", 0.0, [("sys", 1024), ("q1", 64)])
        flood = [request(f"flood{n}", 5.0 + n, [(f"other{n}", 1024)]) for n in range(4)]
        again = request("again", 20.0, [("sys", 1024), ("q2", 64)])
        return [first, *flood, again]

    with_tier = requests()
    simulation = Simulation(Workload("test", with_tier, 24), "prefixserve-tier", 1, COST, host_tier_pages=64)
    simulation.run()
    again = with_tier[-1]
    assert (again.cached_local, again.cached_tier) == (0, 1024)  # evicted by the flood, fetched back whole
    assert simulation.replicas[0].num_tier_pages == 8
    assert simulation.replicas[0].measured_costs().host_page_ms == COST.host_tier_page_ms
    assert simulation.router.policy.tier_runs(again.page_keys) == (8, 0)

    without = requests()
    Simulation(Workload("test", without, 24), "prefixserve-tier", 1, COST).run()
    assert (without[-1].cached_local, without[-1].cached_tier) == (0, 0)
    assert without[-1].first_token_s - without[-1].arrival_s > again.first_token_s - again.arrival_s


def test_with_copy_off_pricing_the_tier_moves_a_request_off_a_busy_holder():
    """Peer copy off (--no-enable-dp-cross-replica-prefix-copy): the holder of a prefix is busy and the shared tier
    holds the prefix. Blind to the tier, the router can only price the other replica as recomputing it and keeps the
    request on the busy holder; pricing the tier's pages (the default with copy off), it sends the request to the idle
    replica, which fetches the prefix from the tier and answers sooner. Neither copies from a peer."""
    def requests() -> list:
        busy = [request(f"busy{n}", 0.001 * n, [(f"other{n}", 1500)]) for n in range(6)]
        return [request("first", 0.0, [("sys", 1024), ("q1", 64)]), *busy,
                request("again", 3.0, [("sys", 1024), ("q2", 64)])]

    outcomes = {}
    for name in ("prefixserve-measured-nocopy", "prefixserve-tier-nocopy"):
        sent = requests()
        Simulation(Workload("test", sent, 256), name, 2, COST, host_tier_pages=256).run()
        first, again = sent[0], sent[-1]
        outcomes[name] = (again.replica == first.replica, again.reason, again.cached_local, again.cached_peer,
                          again.cached_tier, again.first_token_s - again.arrival_s)
    blind, priced = outcomes["prefixserve-measured-nocopy"], outcomes["prefixserve-tier-nocopy"]
    assert blind[:5] == (True, "prefix_hit", 1024, 0, 0)
    assert priced[:5] == (False, "cost_away", 0, 0, 1024)
    assert priced[5] < blind[5] / 2


def test_hot_prefix_replication_copies_ahead_and_later_requests_hit_the_copy():
    """``prefixserve-replicate`` runs the real HotPrefixPlanner beside our policy. Peer hints off here, so the only
    copy is the planner's: a burst on one system prompt makes its holder busy (2 requests: the planner's threshold
    here), the planner copies the 8 pages to the other replica, and the request the policy then balances away finds
    them there instead of recomputing them; the router's index hears of the copied pages. With the default
    threshold (4) the copy is planned for the very request that the policy moves, which starts computing the prefix
    on the target first: the copy lands on pages being computed there, copies nothing and counts as failed."""
    def burst() -> list:
        first = request("first", 0.0, [("sys", 1024), ("q0", 64)])
        return [first] + [request(f"hot{n}", 2.0 + 0.05 * n, [("sys", 1024), (f"q{n + 1}", 64)], out_len=64)
                          for n in range(24)]

    no_hints = {**COST.policy_kwargs(), "enable_peer_hint": False}
    plain = burst()
    result = Simulation(Workload("test", plain, 256), "prefixserve", 2, COST, policy_kwargs=no_hints).run()
    moved = plain[5]
    assert (moved.replica, moved.reason, moved.cached_local) == (1 - plain[0].replica, "balanced_away", 0)
    assert result.replication == {}

    copied = burst()
    simulation = Simulation(Workload("test", copied, 256), "prefixserve-replicate", 2, COST, policy_kwargs=no_hints)
    simulation.planner = HotPrefixPlanner(ReplicationConfig(busy_requests=2), clock=lambda: simulation.now)
    result = simulation.run()
    moved = copied[5]
    assert (moved.replica, moved.reason, moved.cached_local) == (1 - copied[0].replica, "balanced_away", 1024)
    counts = result.replication
    assert (counts["started"], counts["done"], counts["failed"], counts["pages_copied"]) == (1, 1, 0, 8)
    on_target = [r for r in copied if r.replica == moved.replica]
    assert all(r.cached_local == 1024 for r in on_target)
    assert (counts["proactive_hit_requests"], counts["proactive_hit_pages"]) == (len(on_target), 8 * len(on_target))
    target_id = simulation.replicas[moved.replica].replica_id
    assert simulation.view.index.longest_prefix(moved.page_keys)[target_id] == 8
    assert result.ttft_p50_s < Simulation(Workload("test", burst(), 256), "prefixserve", 2, COST,
                                          policy_kwargs=no_hints).run().ttft_p50_s

    raced = burst()
    result = Simulation(Workload("test", raced, 256), "prefixserve-replicate", 2, COST, policy_kwargs=no_hints).run()
    counts = result.replication
    assert (counts["started"], counts["done"], counts["failed"], counts["pages_copied"]) == (1, 0, 1, 0)
    assert raced[5].cached_local == 0


def test_the_simulated_replica_evicts_like_the_engine_s_segmented_lru():
    """SimReplica's pages follow replica/page_pool.py's order (probation, then protected, each least recently released
    first; a bounded protected queue; the ghost list), checked against the real KVCacheManager on one history."""
    from benchmarks.router_sim.replica import SimReplica
    from common.page_keys import compute_page_keys
    from replica.kv_manager import KVCacheManager

    num_pages = 6
    sim = SimReplica(0, "r0", num_pages, CostModel(), protected_fraction=0.34)  # 2 protected pages at most
    kv = KVCacheManager(num_pages, 128, protected_fraction=0.34)
    tokens = {name: list(range(index * 128, index * 128 + 128)) for index, name in enumerate("abcdefghij")}
    keys = {name: compute_page_keys(page, page_size=128, model_fingerprint="sim")[0] for name, page in tokens.items()}
    page_of: dict = {}

    def compute(name):  # a request computes one page and releases it
        sim._evict(max(0, 1 - sim.num_free))
        sim.key_to_refs[name] = 0
        sim._note_cached(name)
        sim._queue(name)
        page_id = kv.allocate(1)[0]
        page_of[name] = kv.commit_page(page_id, keys[name], tokens[name]).page_id
        kv.release([page_of[name]])

    def hit(name):
        sim._pin([name])
        sim._unpin([name])
        kv.acquire([page_of[name]])
        kv.release([page_of[name]])

    def cached():
        real = {name for name in tokens if kv.match_prefix([keys[name]])}
        assert set(sim.key_to_refs) == real
        return "".join(sorted(real))

    for name in "abcdef":
        compute(name)
    hit("a"), hit("b"), hit("c")  # c pushes a, the oldest protected, back to probation
    compute("g"), compute("h")
    assert cached() == "abcfgh"
    compute("d")  # d was evicted lately: computed again it enters protected
    compute("i"), compute("j")
    assert cached() == "bcdhij"  # d protected pushed b back to probation; a, then g went
