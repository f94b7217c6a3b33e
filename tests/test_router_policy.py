"""PrefixAwarePolicy: the cost model (estimated TTFT per candidate), affinity, load balancing with peer hints,
no-match placement, in-flight accounting. Tests of the load bound and of pure affinity use ``AFFINITY`` (the cost model
off), the rule the policy had before the cost model and still has with ``enable_cost_model=False``."""

from __future__ import annotations

import math
from unittest import mock

import pytest

from common.events import PagesRemoved, PagesStored
from router.index import PrefixIndex
from router.policy import (PolicyConfig, PrefixAwarePolicy, RoutingDecision, RoutingReason, tie_score,
                           token_partial_key)
from common.routing_stats import ReplicaLoad


def key(name: str) -> bytes:
    return name.encode().ljust(32, b".")


PROMPT = [key("p0"), key("p1"), key("p2"), key("p3")]
AFFINITY = PolicyConfig(enable_cost_model=False)


def loads(**replica_id_to_num_requests: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica_id, num_requests) for replica_id, num_requests in replica_id_to_num_requests.items()]


def make_policy(config: PolicyConfig | None = None, **replica_id_to_num_pages: int) -> PrefixAwarePolicy:
    """Each named replica holds that many leading pages of PROMPT."""
    index = PrefixIndex()
    for replica_id, num_pages in replica_id_to_num_pages.items():
        index.apply_events(replica_id, [PagesStored(1, tuple(PROMPT[:num_pages]))])
    return PrefixAwarePolicy(index, config)


def test_longest_match_wins():
    policy = make_policy(a=3, b=1)
    decision = policy.choose(PROMPT, loads(a=2, b=0, c=0))
    assert decision == RoutingDecision("a", 3, None, RoutingReason.PREFIX_HIT)


def test_equal_matches_prefer_lower_load():
    policy = make_policy(a=2, b=2)
    assert policy.choose(PROMPT, loads(a=3, b=1, c=0)) == RoutingDecision("b", 2, None, RoutingReason.PREFIX_HIT)


def test_imbalance_beyond_both_thresholds_moves_request_and_sets_peer_hint():
    policy = make_policy(a=4)
    decision = policy.choose(PROMPT, loads(a=10, b=0, c=1))
    assert decision == RoutingDecision("b", 0, "a", RoutingReason.BALANCED_AWAY, peer_matched_pages=4)


def test_imbalance_within_absolute_threshold_keeps_affinity():
    policy = make_policy(a=4)
    assert PolicyConfig().balance_abs_threshold == 3
    assert policy.choose(PROMPT, loads(a=3, b=0)).replica_id == "a"  # gap 3 is not > 3
    assert policy.choose(PROMPT, loads(a=4, b=0)).replica_id == "b"


def test_imbalance_within_relative_threshold_keeps_affinity():
    policy = make_policy(AFFINITY, a=4)
    assert policy.choose(PROMPT, loads(a=20, b=15)).replica_id == "a"  # gap 5 > 4, but 20 <= 1.5 * 15
    assert policy.choose(PROMPT, loads(a=23, b=15)).replica_id == "b"


def test_overloaded_holder_yields_to_a_shorter_holder_with_hint():
    policy = make_policy(a=4, b=2)
    decision = policy.choose(PROMPT, loads(a=9, b=1, c=0))
    assert decision == RoutingDecision("b", 2, "a", RoutingReason.BALANCED_AWAY, peer_matched_pages=4)


def test_peer_hint_disabled_or_too_small():
    no_hints = make_policy(PolicyConfig(enable_peer_hint=False), a=4)
    assert no_hints.choose(PROMPT, loads(a=9, b=0)) == RoutingDecision("b", 0, None, RoutingReason.BALANCED_AWAY)
    big_minimum = make_policy(PolicyConfig(min_peer_copy_pages=3), a=4, b=2)
    assert big_minimum.choose(PROMPT, loads(a=9, b=0)) == RoutingDecision(
        "b", 2, None, RoutingReason.BALANCED_AWAY
    )


def test_cost_model_places_a_new_prefix_on_the_fastest_replica_then_the_emptiest_cache():
    policy = make_policy(a=4)  # a caches 4 pages, b and c none
    other_prompt = [key("q0"), key("q1")]
    # loads differ: the idle replica computes it soonest, though its cache is the fullest
    assert policy.choose(other_prompt, loads(a=0, b=2, c=1), now=0.0) == RoutingDecision(
        "a", 0, None, RoutingReason.NO_MATCH)
    # loads tie (and a is now busy with q): b and c are equally fast and empty; later, with c holding a prefix, b
    fresh = make_policy(a=4)
    first = fresh.choose([key("t0"), key("t1")], loads(a=1, b=1, c=1), now=0.0).replica_id
    assert first in "bc"
    second = fresh.choose([key("f0"), key("f1")], loads(a=1, b=1, c=1), now=10.0).replica_id
    assert second == ("c" if first == "b" else "b")


def test_affinity_mode_places_a_new_prefix_on_the_emptiest_cache_then_the_least_loaded():
    policy = make_policy(AFFINITY, a=4)  # a caches 4 pages, b and c none
    other_prompt = [key("q0"), key("q1")]
    assert policy.choose(other_prompt, loads(a=0, b=2, c=1)) == RoutingDecision("c", 0, None, RoutingReason.NO_MATCH)
    # now c is expected to hold 2 pages: the next new prefix goes to b, the only empty cache, though busier
    third_prompt = [key("t0"), key("t1")]
    assert policy.choose(third_prompt, loads(a=0, b=2, c=1)).replica_id == "b"
    # an overloaded replica is never chosen for a new prefix, however empty its cache
    fourth_prompt = [key("f0")]
    assert policy.choose(fourth_prompt, loads(a=0, b=9, c=9)).replica_id == "a"


def test_a_new_prefix_sticks_to_its_replica_before_any_event_arrives():
    # the first request of a new prefix is still prefilling (no stored event yet) when the second one is routed
    policy = make_policy()
    new_prompt = [key("n0"), key("n1"), key("n2")]
    first = policy.choose(new_prompt, loads(a=0, b=0, c=0))
    assert first.reason is RoutingReason.NO_MATCH
    loads_now = {"a": 0, "b": 0, "c": 0}
    loads_now[first.replica_id] = 1
    second = policy.choose(new_prompt[:2] + [key("other")], loads(**loads_now))
    assert (second.replica_id, second.matched_pages, second.reason) == (first.replica_id, 2, RoutingReason.PREFIX_HIT)


def test_no_match_ties_follow_the_first_page_key():
    candidates = loads(a=0, b=0, c=0)
    expected = max("abc", key=lambda replica_id: tie_score(key("q0"), replica_id))
    for suffix in ["q1", "x1", "y1"]:  # each in a fresh policy: as in three router processes
        assert make_policy().choose([key("q0"), key(suffix)], candidates, now=0.0).replica_id == expected
    policy = make_policy()
    policy.choose([key("q0"), key("q1")], candidates, now=0.0)
    # another first page: the replicas left with no cached page tie, and r0's own tie scores pick among them
    others = [replica_id for replica_id in "abc" if replica_id != expected]
    assert policy.choose([key("r0")], candidates, now=0.0).replica_id == max(
        others, key=lambda replica_id: tie_score(key("r0"), replica_id))
    # no full page: the bare replica id decides (on a fresh policy: cache sizes tie)
    assert make_policy().choose([], candidates).replica_id == max("abc", key=lambda r: tie_score(b"", r))
    # the same in every process: the score depends on the key and the id only
    assert tie_score(key("q0"), "a") == tie_score(key("q0"), "a") != tie_score(key("q1"), "a")


def test_new_prefixes_spread_over_the_replicas_caches():
    # loads tie: each new prefix goes to the replica expected to hold the fewest pages, so 8 prefixes split 4 / 4
    policy = make_policy()
    candidates = loads(a=0, b=0)
    chosen = [policy.choose([key(f"p{n}-0"), key(f"p{n}-1")], candidates).replica_id for n in range(8)]
    assert sorted(chosen) == ["a"] * 4 + ["b"] * 4


def test_burst_is_spread_by_inflight_counts():
    policy = make_policy()
    chosen = []
    for number in range(6):
        decision = policy.choose([key(f"u{number}")], loads(a=0, b=0, c=0))
        policy.note_routed(f"req-{number}", decision.replica_id)
        chosen.append(decision.replica_id)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]
    assert [policy.num_inflight(r) for r in "abc"] == [2, 2, 2]


def test_burst_on_one_prefix_spills_once_the_holder_is_busy():
    policy = make_policy(AFFINITY, a=4)
    chosen = []
    for number in range(7):
        decision = policy.choose(PROMPT, loads(a=0, b=0))
        policy.note_routed(f"req-{number}", decision.replica_id)
        chosen.append((decision.replica_id, decision.peer_hint))
    # a takes 4 (gap 4 > 3 and 4 > 1.5 * 0), then b takes one (copying from a); from then on b is expected to hold the
    # prefix too, so the next requests go to the less loaded of the two holders: b again (1, then 2 against a's 4)
    assert chosen == [("a", None)] * 4 + [("b", "a"), ("b", None), ("b", None)]


def test_cost_model_burst_on_one_prefix_copies_once_queueing_costs_more_than_the_copy():
    # a holds the 4-page prompt; every routed request adds its prefill to a's queue (the fluid wait) and its decode row
    policy = make_policy(a=4)
    chosen = []
    for number in range(6):
        decision = policy.choose(PROMPT, loads(a=0, b=0), now=0.0)
        policy.note_routed(f"req-{number}", decision.replica_id)
        chosen.append((decision.replica_id, decision.peer_hint, decision.reason))
    # a: 16.6 ms, then 39.2 ms (behind the first); b copying the 4 pages: 30.6 ms -> b, by copy; then both hold it
    hit, away = RoutingReason.PREFIX_HIT, RoutingReason.COST_AWAY
    assert chosen == [("a", None, hit), ("a", None, hit), ("b", "a", away), ("b", None, hit), ("a", None, hit),
                      ("b", None, hit)]
    assert policy.num_decisions_by_reason == {hit: 5, away: 1, RoutingReason.BALANCED_AWAY: 0,
                                              RoutingReason.NO_MATCH: 0, RoutingReason.SESSION_MOVE: 0}


def test_a_holder_with_nothing_in_flight_is_idle_whatever_the_forecast_said():
    # sequential requests on one prefix: each finishes (in flight back to 0) long before the cost model's forecast
    # of its work would have run out; the holder must not look busy to the next one
    policy = make_policy(a=4)
    for number in range(5):
        decision = policy.choose(PROMPT, loads(a=0, b=0), now=0.001 * number)
        policy.note_routed(f"req-{number}", decision.replica_id)
        policy.note_finished(f"req-{number}")
        assert (decision.replica_id, decision.reason) == ("a", RoutingReason.PREFIX_HIT)


def test_estimate_is_the_documented_formula():
    policy = make_policy()
    # 512-token prompt, 1 page local + 1 copied: 256 tokens computed in one step at load 2, after 0.1 s of queue
    work = 1 * 3.5 + 256 * 0.417 + 0.35e-3 * 256 * (256 + 128)
    busy = work + 16.0 + 2 * 6.0
    assert policy.estimate_ttft_ms(2, 1, 1, 512, wait_s=0.1) == pytest.approx((100.0 + busy, busy, work))
    # a full hit still computes the last token; a 5000-token prompt takes 3 steps of the 2048-token budget
    assert policy.estimate_ttft_ms(0, 4, 0, 512)[2] == pytest.approx(0.417 + 0.35e-3 * 1 * (511 + 0.5))
    assert policy.estimate_ttft_ms(1, 0, 0, 5000)[1] - policy.estimate_ttft_ms(1, 0, 0, 5000)[2] == pytest.approx(
        3 * (16.0 + 6.0))


def test_cost_model_moves_away_from_a_busy_holder_by_copy_and_says_why():
    policy = make_policy(a=4)
    long_prompt = [key(f"l{n}") for n in range(16)]
    for number in range(3):  # three long new prompts queued on a
        policy.index.expect_keys("b", long_prompt[:1])  # keep b's cache non-empty so new prompts prefer a... and c
        decision = policy.choose([key(f"n{number}")] + long_prompt[1:], loads(a=0, b=9, c=9), now=0.0,
                                 num_prompt_tokens=16 * 128)
        assert decision.replica_id == "a"
    decision = policy.choose(PROMPT, loads(a=3, b=3, c=3), now=0.0)
    assert (decision.replica_id in "bc", decision.peer_hint, decision.reason, decision.peer_matched_pages) == (
        True, "a", RoutingReason.COST_AWAY, 4)
    assert decision.estimated_ttft_ms < policy.estimate_ttft_ms(3, 4, 0, 512, wait_s=1.0)[0]


def test_without_copy_a_long_cached_prefix_keeps_its_holder_despite_a_queue():
    no_copy = make_policy(PolicyConfig(enable_peer_hint=False))
    long_prompt = [key(f"l{n}") for n in range(32)]
    no_copy.index.apply_events("a", [PagesStored(1, tuple(long_prompt))])
    decisions = [no_copy.choose(long_prompt + [key(f"s{n}")], loads(a=2, b=0), now=0.0) for n in range(3)]
    # recomputing 32 pages on b (~3.5 s) costs far more than waiting behind a's short suffix prefills
    assert [d.replica_id for d in decisions] == ["a", "a", "a"]
    assert all(d.peer_hint is None for d in decisions)


def test_a_copy_is_not_planned_from_a_holder_still_computing_the_pages():
    policy = make_policy()
    long_prompt = [key(f"l{n}") for n in range(16)]
    first = policy.choose(long_prompt + [key("u1")], loads(a=0, b=0), now=0.0)
    assert first.reason is RoutingReason.NO_MATCH
    # 10 ms later the pages exist only as the first request's pending prefill: copying is impossible, recomputing on
    # the idle replica costs as much as waiting, and the duplicate work tips it: same replica
    second = policy.choose(long_prompt + [key("u2")], loads(a=0, b=0), now=0.01)
    assert (second.replica_id, second.reason, second.peer_hint) == (first.replica_id, RoutingReason.PREFIX_HIT, None)


def test_a_replica_starting_before_the_holder_is_done_waits_for_it_and_copies_when_that_is_sooner():
    def busy_holder(config: PolicyConfig | None = None):
        policy = make_policy(config)
        long_prompt = [key(f"l{n}") for n in range(12)]
        assert policy.choose(long_prompt + [key("u1")], loads(a=0, b=9), now=0.0).replica_id == "a"
        for number in range(3):  # a then queues three more long new prompts
            other = [key(f"q{number}-{n}") for n in range(13)]
            assert policy.choose(other, loads(a=0, b=9), now=0.0).replica_id == "a"
        return policy, long_prompt + [key("u2")]

    policy, prompt = busy_holder()
    ready_s = policy._key_to_ready_s[("a", prompt[11])]
    decision = policy.choose(prompt, loads(a=3, b=0), now=0.01)
    # a: ~4.8 s of queue; b computing the 12 pages: ~1.2 s plus as much duplicate work; b waiting for a's pages
    # (due at ready_s, counted 1.5x: within holder_wait_s) and copying them: no duplicate work -> b, copying from a
    assert (decision.replica_id, decision.reason, decision.peer_hint) == ("b", RoutingReason.COST_AWAY, "a")
    copy_then_suffix = policy.estimate_ttft_ms(0, 0, 12, 13 * 128)[0]
    assert decision.estimated_ttft_ms == pytest.approx((ready_s - 0.01) * 1.5 * 1000.0 + copy_then_suffix)
    recompute = policy.estimate_ttft_ms(0, 0, 0, 13 * 128)[0]
    assert decision.estimated_ttft_ms > recompute  # a later first token, but no second prefill of the prefix

    # without the wait (holder_wait_s 0) b may only recompute the prefix, and gets no hint: a replica with a hint
    # waits for pages the holder is still computing
    policy, prompt = busy_holder(PolicyConfig(holder_wait_s=0.0))
    decision = policy.choose(prompt, loads(a=3, b=0), now=0.01)
    assert (decision.replica_id, decision.reason, decision.peer_hint) == ("b", RoutingReason.COST_AWAY, None)
    assert decision.estimated_ttft_ms == pytest.approx(recompute)

    # a holder further out than holder_wait_s: recompute
    policy, prompt = busy_holder(PolicyConfig(holder_wait_s=0.5))
    assert policy.choose(prompt, loads(a=3, b=0), now=0.01).estimated_ttft_ms == pytest.approx(recompute)


def test_the_holder_to_copy_from_is_the_one_with_the_pages_soonest_not_one_still_waiting_to_copy_them():
    policy = make_policy()
    long_prompt = [key(f"l{n}") for n in range(12)]
    policy.choose(long_prompt + [key("u1")], loads(a=0, b=9, c=9), now=0.0)
    for number in range(3):
        policy.choose([key(f"q{number}-{n}") for n in range(13)], loads(a=0, b=9, c=9), now=0.0)
    second = policy.choose(long_prompt + [key("u2")], loads(a=4, b=0, c=9), now=0.01)
    assert (second.replica_id, second.peer_hint) == ("b", "a")  # b waits for a's pages, then copies them
    # b holds the pages only once it has copied them: at its expected first token, after a's
    ready_s = policy._key_to_ready_s
    assert ready_s[("b", long_prompt[-1])] == pytest.approx(0.01 + second.estimated_ttft_ms / 1000.0)
    assert ready_s[("b", long_prompt[-1])] > ready_s[("a", long_prompt[-1])]
    # a third request, a and b both over the load bound: both count as holders (b by expectation, with the lower
    # load); c copies from a, which has the pages first, not from b, which is itself still waiting for them
    third = policy.choose(long_prompt + [key("u3")], loads(a=9, b=5, c=0), now=0.02)
    assert (third.replica_id, third.peer_hint) == ("c", "a")
    # b, when eligible, is priced as waiting for its own pages, not as holding them now
    fourth = policy.choose(long_prompt + [key("u4")], loads(a=9, b=1, c=9), now=0.03)
    assert fourth.replica_id == "b"
    assert fourth.estimated_ttft_ms >= (ready_s[("b", long_prompt[-1])] - 0.03) * 1000.0


def test_an_overloaded_holder_stays_when_every_other_replica_would_evict():
    policy = make_policy(a=4)
    for replica_id in "bc":
        policy.index.apply_events(replica_id, [PagesStored(1, tuple(key(f"{replica_id}{n}") for n in range(100)))])
    holder = ReplicaLoad("a", 9, 50, 100)  # over the load bound (9 - 0 > 4 and 9 > 1.5 * 0)
    full_b, full_c = ReplicaLoad("b", 0, 100, 100), ReplicaLoad("c", 0, 100, 100)
    decision = policy.choose(PROMPT, [holder, full_b, full_c], now=0.0)
    assert (decision.replica_id, decision.reason) == ("a", RoutingReason.PREFIX_HIT)
    # one replica with empty pages: the load bound holds again
    roomy = ReplicaLoad("d", 0, 200, 200)
    decision = policy.choose(PROMPT, [holder, full_b, roomy], now=0.0)
    assert (decision.replica_id, decision.reason, decision.peer_hint) == ("d", RoutingReason.BALANCED_AWAY, "a")
    # and with the exception off, the bound always holds
    strict = make_policy(PolicyConfig(enable_overload_exception=False), a=4)
    strict.index.apply_events("b", [PagesStored(1, tuple(key(f"b{n}") for n in range(100)))])
    assert strict.choose(PROMPT, [holder, full_b], now=0.0).replica_id == "b"


def test_eviction_cost_prefers_a_replica_with_empty_pages():
    policy = make_policy(a=4)
    policy.index.apply_events("b", [PagesStored(1, tuple(key(f"b{n}") for n in range(100)))])
    busy_holder = ReplicaLoad("a", 12, 0, 100)
    full = ReplicaLoad("b", 0, 100, 100)  # 100 cached pages, none in use: every new page evicts one
    empty = ReplicaLoad("c", 0, 100, 100)
    assert policy.choose(PROMPT, [busy_holder, full, empty], now=0.0).replica_id == "c"


def test_reported_load_and_inflight_use_the_larger():
    policy = make_policy()
    policy.note_routed("r1", "a")
    policy.note_routed("r2", "a")
    assert policy.effective_load(ReplicaLoad("a", 1)) == 2
    assert policy.effective_load(ReplicaLoad("a", 7)) == 7


def test_inflight_bookkeeping():
    policy = make_policy()
    policy.note_routed("r1", "a")
    policy.note_routed("r2", "a")
    policy.note_routed("r2", "a")  # same request again: counted once
    assert policy.num_inflight("a") == 2
    policy.note_routed("r2", "b")  # re-routed: moves
    assert (policy.num_inflight("a"), policy.num_inflight("b")) == (1, 1)
    policy.note_finished("r2", "a")  # wrong replica: ignored
    assert policy.num_inflight("b") == 1
    policy.note_finished("r2")
    policy.note_finished("r2")
    assert (policy.num_inflight("a"), policy.num_inflight("b")) == (1, 0)
    policy.forget_replica("a")
    assert policy.num_inflight("a") == 0
    policy.note_finished("r1")  # already forgotten: no-op
    assert policy.num_inflight("a") == 0


def test_replica_leaving_and_pages_removed_stop_attracting_requests():
    policy = make_policy(a=4, b=2)
    assert policy.choose(PROMPT, loads(a=0, b=0, c=0)).replica_id == "a"
    policy.index.remove_replica("a")
    assert policy.choose(PROMPT, loads(b=0, c=0)) == RoutingDecision("b", 2, None, RoutingReason.PREFIX_HIT)
    policy.index.apply_events("b", [PagesRemoved(2, (PROMPT[0],))])
    assert policy.choose(PROMPT, loads(b=0, c=0)).reason is RoutingReason.NO_MATCH


def test_replica_joining_with_pages_wins():
    policy = make_policy(a=1)
    policy.index.add_replica("d")
    policy.index.apply_events("d", [PagesStored(1, tuple(PROMPT))])
    assert policy.choose(PROMPT, loads(a=0, d=0)) == RoutingDecision("d", 4, None, RoutingReason.PREFIX_HIT)


def test_only_candidates_are_considered():
    policy = make_policy(a=4, b=1)
    assert policy.choose(PROMPT, loads(b=0, c=0)) == RoutingDecision("b", 1, None, RoutingReason.PREFIX_HIT)



def test_no_candidates_is_an_error():
    with pytest.raises(ValueError, match="no candidate"):
        make_policy().choose(PROMPT, [])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"min_peer_copy_pages": 0}, "min_peer_copy_pages"),
        ({"page_size": 0}, "page_size"),
        ({"peer_copy_page_ms": -1.0}, "peer_copy_page_ms"),
        ({"eviction_weight": -0.5}, "eviction_weight"),
        ({"holder_wait_s": -1.0}, "holder_wait_s"),
        ({"session_start_growth": -1.0}, "session_start_growth"),
        ({"session_start_growth": float("inf")}, "session_start_growth"),
        ({"session_move_fill": -1.0}, "session_move_fill"),
        ({"session_move_fill": float("inf")}, "session_move_fill"),
        ({"session_idle_factor": -1.0}, "session_idle_factor"),
        ({"session_idle_factor": float("nan")}, "session_idle_factor"),
    ],
)
def test_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**kwargs)


def test_pinned_request_names_the_replica_holding_more_and_is_expected_on_its_target():
    policy = make_policy(a=4, b=2)
    assert policy.hint_for_pinned(PROMPT, "b") == "a"
    assert policy.hint_for_pinned(PROMPT, "a") is None  # the target itself holds the most
    assert policy.hint_for_pinned(PROMPT, "c") == "a"
    # each target is expected to hold the whole prompt from then on
    assert policy.index.longest_prefix(PROMPT) == {"a": 4, "b": 4, "c": 4}
    assert policy.hint_for_pinned([key("new")], "b") is None


# ---- measured costs, residency ahead, decisions by replica (issue 12) --------------------------------------------------
from common.routing_stats import MeasuredCosts, RetainedPages  # noqa: E402


def test_measured_costs_replace_the_defaults_for_their_replica_only():
    policy = make_policy()
    fast = MeasuredCosts(step_ms=4.0, prefill_token_ms=0.1)  # the rest not measured: defaults
    slow = MeasuredCosts(step_ms=20.0, prefill_token_ms=0.5)
    b, c = ReplicaLoad("b", 1, costs=fast), ReplicaLoad("c", 1, costs=slow)
    decision = policy.choose(PROMPT, [c, b], now=0.0)
    # 512 new tokens in one step at load 1: the measured step and token costs, the default attention and decode row
    assert decision.replica_id == "b"
    assert decision.estimated_ttft_ms == pytest.approx(512 * 0.1 + 0.35e-3 * 512 * 256 + 4.0 + 1 * 6.0)
    assert policy.costs_of(ReplicaLoad("c", 1)) == policy.costs_of(ReplicaLoad("x"))  # no report: PolicyConfig's
    assert policy.costs_of(b).prefill_token_ms == 0.1 and policy.costs_of(b).peer_copy_page_ms == 3.5


def test_a_compute_cost_not_every_candidate_measured_is_compared_at_the_default():
    """One replica's measured step against another's default favours the lower number, not the faster replica: a
    replica that has served requests would draw every new prefix from one that has not measured yet."""
    policy = make_policy()
    measured = ReplicaLoad("b", 1, costs=MeasuredCosts(step_ms=4.0, prefill_token_ms=0.1, peer_copy_page_ms=0.5))
    unmeasured = ReplicaLoad("c", 1)
    both = policy.comparable_costs([measured, unmeasured])
    assert both[0] == both[1]._replace(peer_copy_page_ms=0.5)  # compute costs: the defaults for both
    assert both[1] == policy.costs_of(unmeasured)
    assert policy.comparable_costs([measured, ReplicaLoad("d", 1, costs=MeasuredCosts(step_ms=8.0,
                                                                                         prefill_token_ms=0.2))]
                                   )[0].prefill_token_ms == 0.1  # measured by both: each its own


def test_the_measured_peer_copy_cost_decides_between_copying_and_waiting():
    def route(peer_copy_page_ms: float) -> RoutingDecision:
        policy = make_policy()
        long_prompt = [key(f"l{n}") for n in range(16)]
        policy.index.apply_events("a", [PagesStored(1, tuple(long_prompt))])
        for number in range(2):  # queue two long new prompts on a (its cache is the only one that is not empty)
            policy.index.expect_keys("b", [key("b-filler")])
            policy.choose([key(f"n{number}-{page}") for page in range(16)], [ReplicaLoad("a", 0), ReplicaLoad("b", 9)],
                          now=0.0, num_prompt_tokens=16 * 128)
        receiver = ReplicaLoad("b", 2, costs=MeasuredCosts(peer_copy_page_ms=peer_copy_page_ms))
        return policy.choose(long_prompt + [key("tail")], [ReplicaLoad("a", 2), receiver], now=0.0,
                             num_prompt_tokens=17 * 128)

    cheap, dear = route(0.5), route(400.0)
    assert (cheap.replica_id, cheap.reason, cheap.peer_hint) == ("b", RoutingReason.COST_AWAY, "a")
    assert (dear.replica_id, dear.reason) == ("a", RoutingReason.PREFIX_HIT)


def test_a_measured_host_tier_caps_the_price_of_an_eviction():
    def route(host_page_ms: float | None) -> str:
        policy = make_policy()
        policy.index.apply_events("full", [PagesStored(1, tuple(key(f"f{n}") for n in range(100)))])
        full = ReplicaLoad("full", 0, 100, 100, costs=MeasuredCosts(host_page_ms=host_page_ms))
        busy = ReplicaLoad("busy", 2, 100, 100)
        return policy.choose([key("new")] * 4, [full, busy], now=0.0).replica_id

    assert route(None) == "busy"  # recomputing 4 evicted pages later costs more than two decode rows now
    assert route(0.01) == "full"  # the shared tier gives them back for next to nothing


def churn(policy: PrefixAwarePolicy, clock, replica_id: str) -> None:
    """``replica_id`` evicted 1000 pages in the last second out of an LRU queue of 100 pages since it stored PROMPT."""
    index = policy.index
    index.note_residency(replica_id, num_evictions=1000, num_lru_pages=100, alpha=1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_retained_prefix_stays_a_hit_on_a_churning_replica_and_an_unretained_one_does_not():
    def route(retained: bool, cost_model: bool = True) -> RoutingDecision:
        clock = Clock()
        index = PrefixIndex(clock=clock)
        index.note_residency("a", num_evictions=0, num_lru_pages=100)
        index.apply_events("a", [PagesStored(1, tuple(PROMPT))])
        policy = PrefixAwarePolicy(index, PolicyConfig(enable_cost_model=cost_model, enable_residency_aging=True))
        clock.now += 1.0
        churn(policy, clock, "a")  # 1000 pages evicted since the prompt was stored, past the queue of 100
        if retained:  # the replica reports the prompt's pages retained for another 60 s
            index.note_residency("a", retained=[RetainedPages(50, 2000.0 + 60.0, tuple(PROMPT))], wall_now=2000.0)
        return policy.choose(PROMPT, loads(a=1, b=0), now=clock.now)

    kept, aged = route(retained=True), route(retained=False)
    assert (kept.replica_id, kept.reason, kept.matched_pages) == ("a", RoutingReason.PREFIX_HIT, 4)
    assert (aged.replica_id, aged.reason, aged.peer_hint) == ("b", RoutingReason.NO_MATCH, None)
    # pure affinity believes the index as it is, and so does the cost model without residency aging (the default)
    assert route(retained=False, cost_model=False).reason is RoutingReason.PREFIX_HIT
    index = PrefixIndex()
    index.apply_events("a", [PagesStored(1, tuple(PROMPT))])
    index.note_residency("a", num_evictions=0, num_lru_pages=1)
    index.note_residency("a", num_evictions=10**6, num_lru_pages=1)
    assert PrefixAwarePolicy(index).choose(PROMPT, loads(a=1, b=0), now=0.0).reason is RoutingReason.PREFIX_HIT


def test_a_prefix_running_requests_use_stays_a_hit_until_they_finish_and_ages_from_then():
    """Residency aging with long-running requests: their pages are out of the replica's LRU queue while they run, so
    however many pages the replica evicts meanwhile, the prefix stays on it; once the last of them finishes, the
    pages age from that moment."""
    clock = Clock()
    index = PrefixIndex(clock=clock)
    index.note_residency("a", num_evictions=0, num_lru_pages=100)
    index.apply_events("a", [PagesStored(1, tuple(PROMPT))])
    policy = PrefixAwarePolicy(index, PolicyConfig(enable_residency_aging=True))
    policy.note_routed("long", "a", PROMPT)  # a request with a long decode uses the prompt's pages on a
    clock.now += 1.0
    churn(policy, clock, "a")  # 1000 pages evicted since the store, past the queue of 100
    decision = policy.choose(PROMPT, loads(a=1, b=0), now=clock.now)
    assert (decision.replica_id, decision.reason, decision.matched_pages) == ("a", RoutingReason.PREFIX_HIT, 4)
    policy.note_finished("long", "a")  # released at 1000 evictions: the pages join the LRU tail now
    clock.now += 1.0  # the routed request's expected work is done: no queue to wait behind on a
    assert policy.choose(PROMPT, loads(a=1, b=0), now=clock.now).reason is RoutingReason.PREFIX_HIT
    clock.now += 1.0
    index.note_residency("a", num_evictions=1101)  # the queue of 100 has turned over since the release
    aged = policy.choose(PROMPT, loads(a=1, b=0), now=clock.now)
    assert (aged.replica_id, aged.reason) == ("b", RoutingReason.NO_MATCH)
    # a request moved to another replica before it was sent holds its pages there instead; a replica that leaves
    # takes its requests' holds with it
    policy.note_routed("moved", "a", PROMPT)
    policy.note_routed("moved", "b")
    assert index.num_in_use("a") == 0 and index.num_in_use("b") == len(PROMPT)
    policy.forget_replica("b")
    policy.note_finished("moved")
    assert policy.num_inflight("b") == 0
    # a request routed without keys holds nothing, and moving it releases nothing another request holds
    policy.note_routed("holder", "a", PROMPT)
    policy.note_routed("keyless", "a")
    policy.note_routed("keyless", "c", PROMPT)
    assert index.num_in_use("a") == len(PROMPT) and index.num_in_use("c") == len(PROMPT)
    policy.note_finished("holder")
    # without residency aging nothing is held
    plain = PrefixAwarePolicy(index)
    plain.note_routed("r", "a", PROMPT)
    assert index.num_in_use("a") == 0


def test_decisions_are_counted_by_replica_and_reason():
    policy = make_policy(a=4)
    policy.choose(PROMPT, loads(a=0, b=0), now=0.0)
    policy.choose([key("x")], loads(a=0, b=0), now=0.0)
    counts = policy.num_decisions_by_replica_reason
    assert sum(counts.values()) == 2 and counts[("a", RoutingReason.PREFIX_HIT)] == 1
    assert sum(policy.num_decisions_by_reason.values()) == 2


# ---- shared tiers (routing stats ``tiers``) --------------------------------------------------------------------------
def test_without_copy_a_prefix_the_host_tier_holds_moves_off_its_busy_holder():
    """The counterpart of ``test_without_copy_a_long_cached_prefix_keeps_its_holder_despite_a_queue``: the same 32
    pages, also reported in the host tier, cost the idle replica a fetch (4 ms a page) instead of a recomputation,
    so once the holder has work queued the router moves requests there; without peer copy nobody is hinted."""
    policy = make_policy(PolicyConfig(enable_peer_hint=False, enable_tier_routing=True))
    long_prompt = [key(f"l{n}") for n in range(32)]
    policy.index.apply_events("a", [PagesStored(1, tuple(long_prompt))])
    policy.tier_index.apply_events("a@CPU", [PagesStored(1, tuple(long_prompt))])
    assert policy.tier_runs(long_prompt + [key("s")]) == (32, 0)
    decisions = [policy.choose(long_prompt + [key(f"s{n}")], loads(a=2, b=0), now=0.0) for n in range(3)]
    assert "b" in [d.replica_id for d in decisions]
    moved = next(d for d in decisions if d.replica_id == "b")
    assert moved.reason is RoutingReason.COST_AWAY and moved.peer_hint is None
    # the fetch is priced, not free: b's estimate is the fetch plus the suffix, far below recomputing 32 pages
    recompute_ms = policy.estimate_ttft_ms(0, 0, 0, 33 * 128)[0]
    assert moved.estimated_ttft_ms < recompute_ms / 3


def test_tier_runs_follow_the_fetch_order_and_forget_a_replica_that_left():
    """Host pages continue a replica's own and copied pages, disk pages continue the host's; the tier's pages may
    come from several replicas' reports (their union counts); a replica that left takes its reports with it."""
    policy = make_policy(PolicyConfig(enable_peer_hint=False, enable_tier_routing=True))
    prompt = [key(f"t{n}") for n in range(8)]
    policy.tier_index.apply_events("a@CPU", [PagesStored(1, tuple(prompt[:2]))])
    policy.tier_index.apply_events("b@CPU", [PagesStored(1, tuple(prompt[2:4]))])
    policy.tier_index.apply_events("b@DISK", [PagesStored(1, tuple(prompt[:6]))])
    assert policy.tier_runs(prompt) == (4, 6)
    policy.index.apply_events("c", [PagesStored(1, tuple(prompt[:1]))])
    config = policy.config
    decision = policy.choose(prompt, loads(c=0), now=0.0, num_prompt_tokens=8 * 128)
    work_ms, steps = policy._work_ms(1, 0, 8 * 128, None, 3, 2)  # 1 own, 3 from the host, 2 from the disk, 2 computed
    assert work_ms == pytest.approx(3 * config.host_page_ms + 2 * config.disk_page_ms + 256 * config.prefill_token_ms
                                    + config.attention_pair_us / 1000 * 256 * (6 * 128 + 128))
    assert decision.estimated_ttft_ms == pytest.approx(work_ms + steps * config.step_ms)
    policy.forget_replica("b")
    assert policy.tier_runs(prompt) == (2, 0)
    assert policy.tier_index.replica_ids() == ["a@CPU"]
    assert make_policy().tier_runs(prompt) == (0, 0)  # off by default


def test_a_follow_up_sent_before_the_answer_is_reported_expects_the_answer_page_where_the_turn_finished():
    """A chat's next turn sent within one routing-stats period of the previous answer: every replica holding the
    system prompt matches as much, and the page the previous prompt's tail and answer filled, stored when it ended,
    is not reported yet; the replica that finished the previous turn is expected to hold that one more page."""
    def route(at: float, finished_on: tuple = ("a",)) -> RoutingDecision:
        clock = Clock()
        index = PrefixIndex(clock=clock)
        for replica_id in ("a", "b"):  # both hold the system prompt (two pages) for other chats
            index.apply_events(replica_id, [PagesStored(1, tuple(PROMPT[:2]))])
        policy = PrefixAwarePolicy(index, PolicyConfig(enable_peer_hint=False))
        clock.now = 0.0
        for replica_id in finished_on:  # a turn whose prompt's full pages were the system prompt ends there
            policy.note_routed(f"turn-on-{replica_id}", replica_id, PROMPT[:2])
            policy.note_finished(f"turn-on-{replica_id}")
        clock.now = at
        return policy.choose(PROMPT, loads(a=1, b=0), num_prompt_tokens=4 * 128, now=at)

    follow_up = route(at=0.3)
    assert (follow_up.replica_id, follow_up.reason, follow_up.matched_pages) == ("a", RoutingReason.PREFIX_HIT, 3)
    # one stats period later the answer would be in the index: nothing is expected beyond it; and where both
    # replicas just finished such a turn, neither is told apart (the lower load decides, as without the rule)
    for late_or_ambiguous in (route(at=0.6), route(at=0.3, finished_on=("a", "b"))):
        assert late_or_ambiguous.replica_id == "b"
    assert route(at=0.3, finished_on=("a", "b")).matched_pages == 3
    assert route(at=0.6).matched_pages == 2


def test_a_follow_up_goes_where_its_own_chat_finished_not_where_another_chat_ended_at_the_same_page():
    """Two chats on one system prompt (two pages); each one's turn, the system prompt and a user message, finished on
    its own replica within one stats period of the follow-ups. Both replicas match the system prompt and both just
    finished a turn ending at its last page; only the replica whose finished tail (the user message after that page)
    the follow-up continues holds the next page, whichever is less loaded. Without partial keys both replicas are
    credited, as before (the lower load decides)."""
    system = list(range(256))
    user = {"a": [1000 + i for i in range(50)], "b": [2000 + i for i in range(70)], "c": [5000 + i for i in range(50)]}

    def follow_up(chat: str, busier: str, *, with_partial_keys: bool = True, at: float = 0.3) -> RoutingDecision:
        clock = Clock()
        index = PrefixIndex(clock=clock)
        for replica_id in ("a", "b"):
            index.apply_events(replica_id, [PagesStored(1, tuple(PROMPT[:2]))])
        policy = PrefixAwarePolicy(index, PolicyConfig(enable_peer_hint=False))
        clock.now = 0.0
        for finished in ("a", "b"):  # chat a's turn finishes on replica a, chat b's on replica b
            tokens = system + user[finished]
            policy.note_routed(f"{finished}-turn-0", finished, PROMPT[:2], num_prompt_tokens=len(tokens),
                               partial_key=token_partial_key(PROMPT[:2], tokens, 128))
            policy.note_finished(f"{finished}-turn-0")
        clock.now = at
        tokens = system + user[chat] + [3000 + i for i in range(100)] + [4000 + i for i in range(80)]  # answer, next
        keys = PROMPT[:2] + [key(f"{chat}-turn-1-page-2")]
        partial_key = token_partial_key(keys, tokens, 128) if with_partial_keys else None
        return policy.choose(keys, loads(**{"a": 0, "b": 0, busier: 1}), num_prompt_tokens=len(tokens),
                             now=at, partial_key=partial_key)

    for chat in ("a", "b"):  # each chat's follow-up, its own replica the busier one
        decision = follow_up(chat, busier=chat)
        assert (decision.replica_id, decision.reason, decision.matched_pages) == (chat, RoutingReason.PREFIX_HIT, 3)
    assert follow_up("a", "a", with_partial_keys=False).replica_id == "b"
    assert follow_up("a", "a", at=0.6).matched_pages == 2  # reported by then: the finished tails are forgotten too
    # a third chat's follow-up continues neither tail: the system prompt alone is matched, the lower load decides
    third = follow_up("c", "a")
    assert (third.replica_id, third.matched_pages) == ("b", 2)


# ---- sessions: a chat's next turn and caches its chats would outgrow (module docstring, "Sessions") ------------------
def _route(policy: PrefixAwarePolicy, keys: list, candidates: list, now: float, *, tail: list | None = None,
           partial_keys: bool = True, request_id: str | None = None) -> RoutingDecision:
    """``choose`` for a prompt of ``keys``' full pages and ``tail`` tokens after them, with its partial keys (token
    ids: 0 on the full pages, ``tail`` after them)."""
    tokens = [0] * (len(keys) * 128) + list(tail or [])
    partial_key = token_partial_key(keys, tokens, 128) if partial_keys else None
    return policy.choose(keys, candidates, num_prompt_tokens=len(tokens), now=now, partial_key=partial_key,
                         request_id=request_id)


def _chats_on_b(policy: PrefixAwarePolicy, count: int, num_pages: int) -> None:
    """``count`` chats of two turns on b (``num_pages`` pages, then one more), a the busy one, at t = 0 and 1 s."""
    for number in range(count):
        other = [key(f"b{number}-{n}") for n in range(num_pages)]
        for turn in range(2):
            assert _route(policy, other + [key(f"b{number}-next")] * turn, loads(a=9, b=0), float(turn),
                          tail=[1]).replica_id == "b"


def _chat_scenario(config: PolicyConfig, *, sessions_on_b: int, pages_total: int):
    """b served ``sessions_on_b`` other prompts 10 s ago (idle now); then chat X's first turn and three long prompts
    queue on a. X's next turn (its first turn's pages and two more) arrives 10 ms later, a the busier: the cost
    model would copy X's history to b. Every replica reports ``pages_total`` pages."""
    policy = PrefixAwarePolicy(PrefixIndex(), config)
    busy_a = loads(a=0, b=9)
    for number in range(sessions_on_b):
        other = [key(f"b{number}-{n}") for n in range(6)]
        assert _route(policy, other, loads(a=9, b=0), 100.0).replica_id == "b"
    turn_1 = [key(f"x{n}") for n in range(12)]
    assert _route(policy, turn_1, busy_a, 110.0).replica_id == "a"
    for number in range(3):
        assert _route(policy, [key(f"q{number}-{n}") for n in range(13)], busy_a, 110.0).replica_id == "a"
    candidates = [ReplicaLoad("a", 3, 0, pages_total), ReplicaLoad("b", 0, pages_total, pages_total)]
    return _route(policy, turn_1 + [key("x12"), key("x13")], candidates, 110.01)


def test_a_chats_next_turn_stays_home_when_the_other_replica_would_outgrow_its_cache():
    # a has 4 sessions, b 3; 40 pages each: 40 / (3 + 1) pages per session on b, against 4x the mean session (~10
    # pages): b is tight and the move would leave b with 4 sessions and a with 3 -> X stays on a
    stays = _chat_scenario(PolicyConfig(), sessions_on_b=3, pages_total=40)
    assert (stays.replica_id, stays.reason) == ("a", RoutingReason.PREFIX_HIT)
    # the rule off (session_growth 0), or caches with room for the sessions to grow: the cost model's move to b
    for config, pages_total in ((PolicyConfig(session_growth=0.0), 40), (PolicyConfig(), 10_000)):
        moved = _chat_scenario(config, sessions_on_b=3, pages_total=pages_total)
        assert (moved.replica_id, moved.reason, moved.peer_hint) == ("b", RoutingReason.COST_AWAY, "a")


def test_a_chat_moves_to_a_tight_replica_when_that_evens_the_sessions_out():
    # b has 1 or 2 sessions against a's 4: fewer than 4 - 1, so the move (to 2 / 3, or 3 / 3) is allowed however
    # tight b is; with 3 (the test above) it would only swap 4 / 3 for 3 / 4. a's prompts (51 pages) also outgrow its
    # 40, and X fits on b (6 or 12 pages and X's 12): by default that rule sends it (session_move), without it the
    # estimate does (cost_away)
    for sessions_on_b in (1, 2):
        for config, reason in ((PolicyConfig(), RoutingReason.SESSION_MOVE),
                               (PolicyConfig(session_move_fill=0.0), RoutingReason.COST_AWAY)):
            moved = _chat_scenario(config, sessions_on_b=sessions_on_b, pages_total=40)
            assert (moved.replica_id, moved.reason) == ("b", reason)


def _new_chat_scenario(config: PolicyConfig, *, pages_total: int, num_tail_pages: int = 1,
                       chats_on_b: int = 2) -> RoutingDecision:
    """Chat A (its own 8-page history) lives on a and ``chats_on_b`` chats on b; a also ran chat X on an 8-page
    system prompt, and a long prompt queues there. Chat Y starts on X's system prompt (and ``num_tail_pages`` more
    pages) with a the busier: the cost model would copy the system prompt to b. Every replica reports ``pages_total``
    pages."""
    policy = PrefixAwarePolicy(PrefixIndex(), config)
    system = [key(f"sys{n}") for n in range(8)]
    for replica_id, other, number in [("a", "b", 0)] + [("b", "a", n) for n in range(chats_on_b)]:
        history = [key(f"{replica_id}{number}-chat-{n}") for n in range(8)]
        for turn in range(2):  # continued: a chat
            assert _route(policy, history + [key(f"{replica_id}{number}-chat-8")] * turn,
                          loads(**{replica_id: 0, other: 9}), 100.0 + turn, tail=[1]).replica_id == replica_id
    assert _route(policy, system, loads(a=0, b=9), 102.0, tail=[2]).replica_id == "a"
    assert _route(policy, [key(f"q{n}") for n in range(13)], loads(a=0, b=9), 102.0).replica_id == "a"
    tail_keys = [key(f"y{n}") for n in range(num_tail_pages)]
    candidates = [ReplicaLoad("a", 2, 0, pages_total), ReplicaLoad("b", 0, pages_total, pages_total)]
    return _route(policy, system + tail_keys, candidates, 102.01, tail=[3])


def test_a_new_chat_stays_with_its_system_prompt_where_chats_would_outgrow_the_caches():
    # 40 pages a replica; a has 3 sessions (A, X and the long prompt), b 2: 40 / 4 pages per session against 8x the
    # mean (~9 pages): the holder is tight and has fewer sessions than the mean (2.5) plus one, so Y joins the chat on
    # its system prompt instead of storing the prompt on b too
    stays = _new_chat_scenario(PolicyConfig(), pages_total=40)
    assert (stays.replica_id, stays.matched_pages) == ("a", 8)
    # 200 pages: tight for a chat starting now (8x), not by the sessions' own factor (4x)
    assert _new_chat_scenario(PolicyConfig(), pages_total=200).replica_id == "a"
    assert _new_chat_scenario(PolicyConfig(session_start_growth=4.0), pages_total=200).replica_id == "b"
    # the rule off, roomy caches, a holder with less than half the prompt (a copy stores little twice), or a holder
    # that has its share of the chats already (3 sessions against b's 1: the mean plus one): the cost model's move
    for config, pages_total, num_tail_pages, chats_on_b in ((PolicyConfig(session_start_growth=0.0), 40, 1, 2),
                                                            (PolicyConfig(), 10_000, 1, 2), (PolicyConfig(), 40, 9, 2),
                                                            (PolicyConfig(), 40, 1, 1)):
        moved = _new_chat_scenario(config, pages_total=pages_total, num_tail_pages=num_tail_pages,
                                   chats_on_b=chats_on_b)
        assert (moved.replica_id, moved.reason, moved.peer_hint) == ("b", RoutingReason.COST_AWAY, "a")


def test_a_new_chat_goes_to_the_holder_of_its_system_prompt_with_fewer_chats():
    """a and b both hold the system prompt; a has 4 sessions, b 1 and c 3 (the mean: 2.7), 100 pages each (b is
    tight for a chat starting now: 100 / 2 pages against 8x the mean 8-page session). A new chat on that prompt, with
    b the busier, would go to a by the estimate; a has more than 2 sessions beyond b's, so b takes it. With every
    holder a candidate (``_HOLDER_SESSION_SLACK`` large) it goes to a."""
    def new_chat(slack: int) -> RoutingDecision:
        policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
        for replica_id, number_of_sessions in (("a", 4), ("b", 1), ("c", 3)):
            others = {name: 9 for name in "abc" if name != replica_id}
            for number in range(number_of_sessions):
                prompt = [key(f"{replica_id}{number}-chat-{n}") for n in range(8)]
                assert _route(policy, prompt, loads(**{replica_id: 0, **others}), 100.0,
                              tail=[1]).replica_id == replica_id
        system = [key(f"sys{n}") for n in range(8)]
        for replica_id in ("a", "b"):
            policy.index.apply_events(replica_id, [PagesStored(1, tuple(system))])
        candidates = [ReplicaLoad("a", 0, 100, 100), ReplicaLoad("b", 2, 100, 100), ReplicaLoad("c", 0, 100, 100)]
        with mock.patch("router.policy._HOLDER_SESSION_SLACK", slack):
            return _route(policy, system + [key("y0")], candidates, 110.0, tail=[3])

    assert (new_chat(2).replica_id, new_chat(2).matched_pages) == ("b", 8)
    assert new_chat(100).replica_id == "a"


def test_a_chats_busy_home_stays_a_candidate_where_chats_would_outgrow_the_caches():
    """X's 24-page history lives on a, which has more requests in flight than the load bound allows (6 against b's
    0) but is working through none of this router's (its forecast queue is empty): staying costs the next turn a few
    decode rows per step, moving copies the history. In tight caches the estimate decides (a); in roomy ones, or with
    the rule off, the load bound drops a as before (b, copying from a)."""
    def next_turn(config: PolicyConfig, pages_total: int, *, one_off: bool = False) -> RoutingDecision:
        policy = PrefixAwarePolicy(PrefixIndex(), config)
        _chats_on_b(policy, 2, 20)
        history = [key(f"x{n}") for n in range(24)]
        for turn in range(2):
            assert _route(policy, history[:23 + turn], loads(a=0, b=9), 10.0 + turn).replica_id == "a"
        policy.index.apply_events("a", [PagesStored(1, tuple(history))])
        candidates = [ReplicaLoad("a", 6, 0, pages_total), ReplicaLoad("b", 0, pages_total, pages_total)]
        if one_off:  # 23 of X's pages (not its last) and its own: it continues no session
            return _route(policy, history[:23] + [key("other")], candidates, 40.0, tail=[1])
        return _route(policy, history + [key("x24")], candidates, 40.0, tail=[1])

    stays = next_turn(PolicyConfig(), 120)
    assert (stays.replica_id, stays.matched_pages) == ("a", 24)
    for config, pages_total in ((PolicyConfig(session_growth=0.0), 120), (PolicyConfig(), 10_000)):
        moved = next_turn(config, pages_total)
        assert (moved.replica_id, moved.peer_hint) == ("b", "a")
    # a request that is not a's session's turn is bound by the load as before, however tight a is
    one_off = next_turn(PolicyConfig(), 120, one_off=True)
    assert (one_off.replica_id, one_off.peer_hint) == ("b", "a")


def _outgrown_home_scenario(config: PolicyConfig, *, chats_on_a: int, pages_on_b: int, load_on_a: int = 0,
                            pages_total_a: int = 50) -> RoutingDecision:
    """Chat X (20 pages, then 21) and ``chats_on_a`` other chats of 20 / 21 pages live on a; b has one chat of
    ``pages_on_b`` pages, then one more (0: none). b reports 50 pages and no request in flight, a ``pages_total_a``
    pages and ``load_on_a`` requests; X's history is on a. X's next turn (22 pages): staying costs nothing, moving
    copies its history, so the estimate alone keeps it on a while a is within the load bound."""
    policy = PrefixAwarePolicy(PrefixIndex(), config)
    chats = [("a", f"a{number}", 20) for number in range(chats_on_a)] + [("b", "b0", pages_on_b)] * bool(pages_on_b)
    for replica_id, name, num_pages in chats + [("a", "x", 20)]:
        history = [key(f"{name}-{n}") for n in range(num_pages + 1)]
        others = {other: 9 for other in "ab" if other != replica_id}
        for turn in range(2):  # continued: a chat
            assert _route(policy, history[:num_pages + turn], loads(**{replica_id: 0, **others}),
                          float(turn)).replica_id == replica_id
    history = [key(f"x-{n}") for n in range(22)]
    policy.index.apply_events("a", [PagesStored(1, tuple(history[:21]))])
    candidates = [ReplicaLoad("a", load_on_a, pages_total_a, pages_total_a), ReplicaLoad("b", 0, 50, 50)]
    return _route(policy, history, candidates, 20.0, tail=[1])


def test_a_chat_leaves_a_home_its_chats_have_outgrown_for_a_replica_where_it_fits():
    """a's three chats (63 pages of latest prompts) outgrow its 50 pages: X's 22-page turn goes to b, where it fits
    (22 pages, or 22 + 28 = 50 beside b's chat), copying its history from a, instead of recomputing it there turn
    after turn; also when a is over the load bound (4 requests against b's 0), where the busy-home rule would keep it.
    It stays on a with the rule off (either rule), while a's chats still fit (two: 42 pages), where it would not fit
    on b either (22 + 29 pages), or when a has not reported its page count yet (no stats: 0 pages)."""
    for pages_on_b, load_on_a in ((0, 0), (27, 0), (0, 4)):
        moved = _outgrown_home_scenario(PolicyConfig(), chats_on_a=2, pages_on_b=pages_on_b, load_on_a=load_on_a)
        assert (moved.replica_id, moved.reason, moved.peer_hint) == ("b", RoutingReason.SESSION_MOVE, "a")
    assert _outgrown_home_scenario(PolicyConfig(session_move_fill=0.0), chats_on_a=2, pages_on_b=0,
                                   load_on_a=4).reason != RoutingReason.SESSION_MOVE
    for config, chats_on_a, pages_on_b, pages_total_a in (
            (PolicyConfig(session_move_fill=0.0), 2, 0, 50), (PolicyConfig(), 1, 0, 50), (PolicyConfig(), 2, 28, 50),
            (PolicyConfig(session_growth=0.0), 2, 0, 50), (PolicyConfig(), 2, 0, 0)):
        stays = _outgrown_home_scenario(config, chats_on_a=chats_on_a, pages_on_b=pages_on_b,
                                        pages_total_a=pages_total_a)
        assert (stays.replica_id, stays.matched_pages) == ("a", 21)
    # a fill above 1 lets the chats overfill a replica's cache by that much before one leaves: 63 <= 1.3 * 50
    assert _outgrown_home_scenario(PolicyConfig(session_move_fill=1.3), chats_on_a=2, pages_on_b=0).replica_id == "a"


def test_a_replica_holding_more_of_the_prompt_than_the_home_stays_a_candidate():
    """The rule removes move targets, never the replica holding the most leading pages: a chat whose home no longer
    holds its history (evicted there) goes where the history is, as the cost model says."""
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
    for number in range(3):  # b: 3 sessions, a: X's
        _route(policy, [key(f"b{number}-{n}") for n in range(6)], loads(a=9, b=0), 0.0)
    turn_1 = [key(f"x{n}") for n in range(8)]
    assert _route(policy, turn_1, loads(a=0, b=9), 0.0).replica_id == "a"
    policy.index.apply_events("b", [PagesStored(1, tuple(turn_1))])  # b holds X's history (a copy); a no longer does
    policy.index.apply_events("a", [PagesRemoved(2, tuple(turn_1))])
    tight = [ReplicaLoad("a", 0, 40, 40), ReplicaLoad("b", 0, 40, 40)]
    decision = _route(policy, turn_1 + [key("x8")], tight, 5.0)
    assert (decision.replica_id, decision.matched_pages) == ("b", 8)


def test_a_retried_request_is_not_taken_for_a_turn_of_its_own_session():
    """Serve asks the router again for a request its replicas refused. The retry (the same request id) finds the
    session its first choice recorded, but does not continue it: a one-off prompt stays a one-off (not a chat), and a
    chat's turn keeps going by the session it continues. The same prompt sent again as a new request does continue
    it (a repeat)."""
    prompt = [key(f"p{n}") for n in range(4)]
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
    first = _route(policy, prompt, loads(a=0, b=9), 0.0, tail=[1], request_id="r")
    assert first.replica_id == "a"
    for _ in range(2):  # retries
        _route(policy, prompt, loads(a=0, b=9), 0.1, tail=[1], request_id="r")
    assert not policy._replica_id_to_num_sessions and policy._replica_id_to_num_new_sessions == {"a": 1}
    assert policy.session_continue_rate == 1.0  # no outcome noted
    _route(policy, prompt, loads(a=0, b=9), 0.2, tail=[1], request_id="s")  # a new request with the same prompt
    assert policy._replica_id_to_num_sessions == {"a": 1}
    # a chat's turn: its retry is routed by the chat's session (kept home on tight a) and records nothing again
    chat = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
    _chats_on_b(chat, 3, 6)  # three chats on b, one on a: b is tight and the move would not even them out
    turn_1 = [key(f"x{n}") for n in range(12)]
    for turn in range(2):
        assert _route(chat, turn_1[:11 + turn], loads(a=0, b=9), 2.0 + turn).replica_id == "a"
    tight = [ReplicaLoad("a", 3, 0, 40), ReplicaLoad("b", 0, 40, 40)]
    booked = dict(chat._replica_id_to_num_sessions)
    for attempt in range(2):
        decision = _route(chat, turn_1 + [key("x12")], tight, 4.0 + attempt, request_id="t")
        assert decision.replica_id == "a"
    assert chat._replica_id_to_num_sessions == booked
    recorded = [session for tails in chat._sessions.values() for session in tails.values() if session.request_id == "t"]
    assert [(session.routed_s, session.continues.replica_id) for session in recorded] == [(4.0, "a")]

def _clocked_policy(config: PolicyConfig) -> tuple[PrefixAwarePolicy, list]:
    """A policy whose index clock (what ``note_finished`` stamps) reads ``now[0]``, the time the test sets."""
    now = [0.0]
    return PrefixAwarePolicy(PrefixIndex(clock=lambda: now[0]), config), now


def _turn(policy: PrefixAwarePolicy, now: list, request_id: str, keys: list, candidates: list,
          at: float) -> RoutingDecision:
    """A request routed at ``at`` as the Ray adapter does (``choose``, then ``note_routed``); its prompt is full pages
    (any prompt holding its last page continues it)."""
    now[0] = at
    tokens = [0] * (len(keys) * 128)
    partial_key = token_partial_key(keys, tokens, 128)
    decision = policy.choose(keys, candidates, num_prompt_tokens=len(tokens), now=at, partial_key=partial_key,
                             request_id=request_id)
    policy.note_routed(request_id, decision.replica_id, keys, num_prompt_tokens=len(tokens), partial_key=partial_key)
    return decision


def _finish(policy: PrefixAwarePolicy, now: list, request_id: str, at: float) -> None:
    now[0] = at
    policy.note_finished(request_id)


def _learn_gaps(policy: PrefixAwarePolicy, now: list, *, count: int = 16, gap: float = 2.0,
                gaps: list | None = None, name: str = "g") -> None:
    """Two-turn chats on replica c, from ``now[0]`` on: all first turns at once, finished 1 s later, each second turn
    sent ``gap`` s (or each of ``gaps``) after that and finished 1 s after it sent (in time order)."""
    start = now[0]
    events = []  # (time, order, action)
    for number, gap in enumerate(gaps if gaps is not None else [gap] * count):
        history = [key(f"{name}{number}-{n}") for n in range(3)]
        events += [(start, 0, number, "route", f"{name}{number}t0", history[:2]),
                   (start + 1.0, 1, number, "finish", f"{name}{number}t0", None),
                   (start + 1.0 + gap, 2, number, "route", f"{name}{number}t1", history),
                   (start + 2.0 + gap, 3, number, "finish", f"{name}{number}t1", None)]
    for at, _, _, action, request_id, keys in sorted(events, key=lambda event: event[:3]):
        if action == "route":
            _turn(policy, now, request_id, keys, loads(c=0), at)
        else:
            _finish(policy, now, request_id, at)


def test_the_idle_time_is_the_factor_times_the_99th_percentile_of_the_latest_gaps():
    """Gaps of 0-4 s: twice the longest (the 99th percentile of 16), 8 s; only the last 256 gaps count (2 s once 256
    of 1 s followed those); recomputed every 16 new gaps (15 of 1.9 s change nothing until the 16th: 3.8 s), and at
    once when a chat taken for ended goes on (a 5 s gap after 16 of 1 s: 10 s); one pause of 30 s among 200 gaps of
    1 s is above the 99th percentile (2 s); at least 1 s (0.5 x 1 s)."""
    policy, now = _clocked_policy(PolicyConfig(session_idle_factor=2.0))
    _learn_gaps(policy, now, gaps=[0.25 * n for n in range(15)])
    assert policy._idle_s() == math.inf  # 15 gaps: none is idle yet
    _learn_gaps(policy, now, gaps=[4.0], name="h")
    assert policy._idle_s() == 8.0
    _learn_gaps(policy, now, gaps=[1.0] * 256, name="i")
    assert policy._idle_s() == 2.0
    _learn_gaps(policy, now, gaps=[1.9] * 15, name="j")
    assert policy._idle_s() == 2.0  # 15 new gaps: not recomputed yet
    _learn_gaps(policy, now, gaps=[1.9], name="k")
    assert policy._idle_s() == pytest.approx(3.8)
    resumed, now = _clocked_policy(PolicyConfig(session_idle_factor=2.0))
    _learn_gaps(resumed, now, gaps=[1.0] * 16)
    assert resumed._idle_s() == 2.0
    _learn_gaps(resumed, now, gaps=[5.0], name="l")  # idle after 2 s, goes on after 5 s
    assert resumed.drain_session_events()[("c", "resumed")] == 1
    assert resumed._idle_s() == pytest.approx(10.0)
    outlier, now = _clocked_policy(PolicyConfig(session_idle_factor=2.0))
    _learn_gaps(outlier, now, gaps=[1.0] * 100 + [30.0] + [1.0] * 99)
    assert outlier._idle_s() == 2.0
    floor, now = _clocked_policy(PolicyConfig(session_idle_factor=0.5))
    _learn_gaps(floor, now, gaps=[1.0] * 16)
    assert floor._idle_s() == 1.0


def _chat_on_a(policy: PrefixAwarePolicy, now: list, name: str, num_pages: int, start: float) -> list:
    """Chat ``name``: two turns on a (``num_pages`` pages, then one more), each finished 0.5 s after it was sent;
    returns its history (``num_pages`` + 2 page keys)."""
    history = [key(f"{name}-{n}") for n in range(num_pages + 2)]
    for turn in range(2):
        sent = start + turn
        assert _turn(policy, now, f"{name}t{turn}", history[:num_pages + turn], loads(a=0), sent).replica_id == "a"
        _finish(policy, now, f"{name}t{turn}", sent + 0.5)
    return history


def test_a_chat_whose_answer_finished_long_ago_stops_counting_until_its_next_turn():
    """Chats' next turns came 2 s after their answers (16 gaps seen, then X's own 0.5 s): 1.5 x 2 s after its answer
    finished, a chat that sent nothing since is idle (an "idle" event). It counts in neither a's sessions nor a's
    pages until its next turn, which still continues it (at home), counts again and is a "resumed" event. Fewer than
    16 gaps seen (14 and X's), or the factor 0: it counts until its window ends."""
    for config, num_gaps, idles in ((PolicyConfig(), 16, True), (PolicyConfig(), 14, False),
                                    (PolicyConfig(session_idle_factor=0.0), 16, False)):
        policy, now = _clocked_policy(config)
        _learn_gaps(policy, now, count=num_gaps)
        history = _chat_on_a(policy, now, "x", 8, 10.0)  # its second turn (9 pages) finished at 11.5
        policy._forget_sessions(14.4)
        assert (policy._num_sessions("a"), policy._session_demand("a")) == (1, 9)
        policy._forget_sessions(14.6)
        assert (policy._num_sessions("a"), policy._session_demand("a")) == ((0, 0) if idles else (1, 9))
        events = policy.drain_session_events()
        assert {replica_event: n for replica_event, n in events.items() if replica_event[0] == "a"} == (
            {("a", "idle"): 1} if idles else {})
        decision = _turn(policy, now, "xt2", history, loads(a=0, b=0), 20.0)  # the chat goes on
        assert (decision.replica_id, decision.matched_pages) == ("a", 9)  # home, where its history is expected
        assert (policy._num_sessions("a"), policy._session_demand("a")) == (1, 10)
        assert policy.drain_session_events().get(("a", "resumed"), 0) == idles
        _check_session_books(policy)


def test_a_home_whose_other_chats_ended_keeps_its_chat():
    """a holds chat X and two chats that ended (their answers finished 9.5 s ago, well past 1.5 x the 2 s gap after
    which chats' turns come): their 40 pages no longer count, so X's 20 fit a's 50 and its next turn stays home. With
    the factor 0 they still count until their window ends, a looks outgrown (60 pages) and X moves to b."""
    for config, moves in ((PolicyConfig(), False), (PolicyConfig(session_idle_factor=0.0), True)):
        policy, now = _clocked_policy(config)
        _learn_gaps(policy, now)
        _chat_on_a(policy, now, "a0", 19, 5.0)
        _chat_on_a(policy, now, "a1", 19, 5.0)
        history = _chat_on_a(policy, now, "x", 19, 14.0)
        policy.index.apply_events("a", [PagesStored(1, tuple(history[:21]))])
        candidates = [ReplicaLoad("a", 0, 50, 50), ReplicaLoad("b", 0, 50, 50)]
        decision = _turn(policy, now, "xt2", history[:22] + [key("x-22")], candidates, 16.0)
        if moves:
            assert (decision.replica_id, decision.reason) == ("b", RoutingReason.SESSION_MOVE)
        else:
            assert (decision.replica_id, decision.matched_pages) == ("a", 21)


def test_a_refused_and_retried_turn_keeps_its_chat_counted_while_it_runs():
    """Serve records a refusal like a finish; the retry (the same request id) makes the chat live again, so it still
    counts while the retry runs past the idle time, and goes idle only after the retry's own finish. A retry that
    comes after the refused turn's chat went idle books it again."""
    for retried_at in (13.2, 17.0):
        policy, now = _clocked_policy(PolicyConfig())
        _learn_gaps(policy, now)  # idle after 3 s
        history = _chat_on_a(policy, now, "x", 8, 10.0)
        _turn(policy, now, "xt2", history + [key("x-10")], loads(a=0), 13.0)
        _finish(policy, now, "xt2", 13.1)  # a refused it
        policy._forget_sessions(retried_at - 0.1)
        assert (policy._num_sessions("a"), policy._session_demand("a")) == ((1, 11) if retried_at < 16.1 else (0, 0))
        _turn(policy, now, "xt2", history + [key("x-10")], loads(a=0), retried_at)  # Serve asks again: a takes it
        assert (policy._num_sessions("a"), policy._session_demand("a")) == (1, 11)
        policy._forget_sessions(24.0)
        assert policy._num_sessions("a") == 1
        _finish(policy, now, "xt2", 25.0)
        policy._forget_sessions(27.9)
        assert policy._num_sessions("a") == 1
        policy._forget_sessions(28.1)
        assert policy._num_sessions("a") == 0
        _check_session_books(policy)


def test_another_request_with_the_same_prompt_finishing_does_not_end_the_chat():
    """R2 sends R1's prompt again while R1 runs (a resend under a new id): R2 continues R1's session. R1 finishing is
    not the session's end: the chat stays counted while R2 runs past the idle time, and goes idle after R2's finish."""
    policy, now = _clocked_policy(PolicyConfig())
    _learn_gaps(policy, now)  # idle after 3 s
    prompt = [key(f"r-{n}") for n in range(6)]
    for request_id in ("r1", "r2"):
        assert _turn(policy, now, request_id, prompt, loads(a=0), 10.0).replica_id == "a"
    _finish(policy, now, "r1", 11.0)
    policy._forget_sessions(20.0)
    assert policy._num_sessions("a") == 1
    _finish(policy, now, "r2", 21.0)
    policy._forget_sessions(24.1)
    assert policy._num_sessions("a") == 0
    _check_session_books(policy)


def test_a_session_ends_after_its_window():
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig(session_window_s=5.0))
    _route(policy, PROMPT, loads(a=0, b=9), 0.0)
    tokens = [0] * (5 * 128)
    later = PROMPT + [key("p4")]
    assert policy._session_of(later, token_partial_key(later, tokens, 128), now=4.9) is not None
    assert policy._session_of(later, token_partial_key(later, tokens, 128), now=5.0) is None
    assert not policy._sessions and not policy._session_tail_lengths
    assert sum(policy._replica_id_to_new_session_pages.values()) == 0


def test_a_session_is_continued_only_by_a_prompt_that_continues_its_tail():
    system = list(range(256))
    first = system + [1000 + i for i in range(50)]  # two full pages and a 50-token tail
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
    policy.choose(PROMPT[:2], loads(a=0, b=9), num_prompt_tokens=len(first), now=0.0,
                  partial_key=token_partial_key(PROMPT[:2], first, 128))
    for user, continues in (([1000 + i for i in range(50)], True), ([7000 + i for i in range(50)], False)):
        tokens = system + user + [3000 + i for i in range(200)]
        keys = PROMPT[:2] + [key(f"next-{continues}")]
        session = policy._session_of(keys, token_partial_key(keys, tokens, 128), now=1.0)
        assert (session is not None) is continues
        if continues:
            assert (session.replica_id, session.num_pages) == ("a", 2)
    # routing the continuation ends the first request's session and starts the next one's: one continued session
    tokens = first + [3000 + i for i in range(200)]
    keys = PROMPT[:2] + [key("next-True")]
    policy.choose(keys, loads(a=0, b=0), num_prompt_tokens=len(tokens), now=1.0,
                  partial_key=token_partial_key(keys, tokens, 128))
    assert sum(policy._replica_id_to_num_sessions.values()) == 1
    assert sum(policy._replica_id_to_session_pages.values()) == 3
    assert not any(policy._replica_id_to_num_new_sessions.values())
    assert sum(policy._replica_id_to_new_session_pages.values()) == 0


def test_a_known_tail_is_matched_before_a_prompt_that_ended_at_the_same_page():
    """A prompt ending exactly at a page (no tail) is continued by every prompt holding that page; a session whose
    known tail this prompt continues is the better match and wins."""
    system = list(range(256))
    chat = system + [1000 + i for i in range(50)]
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
    policy.choose(PROMPT[:2], loads(a=9, b=0), num_prompt_tokens=len(chat), now=0.0,
                  partial_key=token_partial_key(PROMPT[:2], chat, 128))  # chat X -> b
    policy.choose(PROMPT[:2], loads(a=0, b=9), num_prompt_tokens=256, now=0.1,
                  partial_key=token_partial_key(PROMPT[:2], system, 128))  # the bare system prompt -> a
    tokens = chat + [3000 + i for i in range(200)]
    keys = PROMPT[:2] + [key("x-next")]
    assert policy._session_of(keys, token_partial_key(keys, tokens, 128), now=1.0).replica_id == "b"
    other = system + [7000 + i for i in range(250)]  # another chat: only the bare system prompt matches
    assert policy._session_of(keys, token_partial_key(keys, other, 128), now=1.0).replica_id == "a"


def test_requests_without_partial_keys_start_no_session():
    """Without partial keys a request's continuations cannot be told from other prompts on its pages (chats on one
    system prompt would all continue the first one): no session, no count."""
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
    for user in range(4):
        _route(policy, PROMPT[:2] + [key(f"user-{user}")], loads(a=0, b=0), 0.0, partial_keys=False)
    assert not policy._sessions and not policy._replica_id_to_num_new_sessions


def test_one_off_requests_stop_counting_as_chats_once_they_are_seldom_continued():
    """A flood of one-off prompts would otherwise count as many sessions and make roomy replicas tight (a chat then
    kept on its busy home). Each first request that expires uncontinued moves the continuation rate towards 0; the
    new sessions count only at that rate."""
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig(session_window_s=1.0))
    assert policy.session_continue_rate == 1.0
    for number in range(100):  # 10 one-offs a second for 10 s
        _route(policy, [key(f"one-off-{number}-{n}") for n in range(4)], loads(a=0, b=0, c=0), number / 10)
    assert policy.session_continue_rate < 0.01
    # a chat's turns move the rate back up
    chat = [key(f"chat-{n}") for n in range(4)]
    rate = policy.session_continue_rate
    _route(policy, chat, loads(a=0, b=0, c=0), 11.0)
    _route(policy, chat + [key("chat-4")], loads(a=0, b=0, c=0), 11.5)
    assert policy.session_continue_rate > rate
    assert sum(policy._replica_id_to_num_sessions.values()) == 1


def test_a_request_serve_sends_elsewhere_takes_its_session_there():
    """Serve falls back to another replica when the chosen one is full (the adapter's ``_on_assigned`` calls
    ``note_routed`` with the replica used): the session's home follows the request."""
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
    turn_1 = [key(f"x{n}") for n in range(4)]
    tokens = [0] * 512
    decision = policy.choose(turn_1, loads(a=0, b=9), num_prompt_tokens=512, now=0.0,
                             partial_key=token_partial_key(turn_1, tokens, 128))
    assert decision.replica_id == "a"
    policy.note_routed("x-1", "a", turn_1, num_prompt_tokens=512, partial_key=token_partial_key(turn_1, tokens, 128))
    policy.note_routed("x-1", "b")  # Serve sent it to b
    later = turn_1 + [key("x4")]
    assert policy._session_of(later, token_partial_key(later, [0] * 640, 128), now=1.0).replica_id == "b"
    assert policy._replica_id_to_num_new_sessions == {"a": 0, "b": 1}


def test_many_sessions_ending_at_one_page_cost_one_partial_key_per_tail_length():
    """One-off prompts of a shared system prompt plus a short question all end at the system prompt's last page: a
    request holding that page computes its partial key once per distinct tail length, not once per session."""
    system = [0] * 256
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
    for number in range(300):
        tokens = system + [10_000 + number] * (10 + number % 3)  # three tail lengths
        policy.choose(PROMPT[:2], loads(a=0, b=0), num_prompt_tokens=len(tokens), now=0.0,
                      partial_key=token_partial_key(PROMPT[:2], tokens, 128))
    calls = []
    tokens = system + [20_000] * 200
    keys = PROMPT[:2] + [key("q")]
    inner = token_partial_key(keys, tokens, 128)
    assert policy._session_of(keys, lambda pages, num: calls.append(num) or inner(pages, num), now=1.0) is None
    assert sorted(calls) == [10, 11, 12]


def test_a_replica_that_leaves_takes_its_sessions_with_it():
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig())
    _route(policy, PROMPT, loads(a=0, b=9), 0.0)
    _route(policy, [key("other")], loads(a=9, b=0), 0.0)
    policy.forget_replica("a")
    assert policy._replica_id_to_num_new_sessions == {"b": 1}
    assert sum(policy._replica_id_to_new_session_pages.values()) == 1
    later = PROMPT + [key("p4")]
    assert policy._session_of(later, token_partial_key(later, [0] * 640, 128), now=1.0) is None


def _check_session_books(policy: PrefixAwarePolicy) -> None:
    """The session counters equal what ``_sessions`` holds: sessions and pages by home (continued and new), and the
    tail lengths per page."""
    by_home: dict[str, int] = {}
    pages_by_home: dict[tuple[str, bool], int] = {}
    pages = 0
    lengths: dict[bytes, dict[int, int]] = {}
    for page, tails in policy._sessions.items():
        assert tails
        for tail, session in tails.items():
            assert (session.key, session.tail) == (page, tail)
            if tail is not None:
                lengths.setdefault(page, {})
                lengths[page][tail.num_tokens] = lengths[page].get(tail.num_tokens, 0) + 1
            if session.idle:  # in no book
                assert session.finished_s is not None
                continue
            by_home[session.replica_id] = by_home.get(session.replica_id, 0) + 1
            home = (session.replica_id, session.counted)
            pages_by_home[home] = pages_by_home.get(home, 0) + session.num_pages
            pages += session.num_pages
    counted: dict[str, int] = {}
    for counts in (policy._replica_id_to_num_sessions, policy._replica_id_to_num_new_sessions):
        assert all(count >= 0 for count in counts.values())
        for replica_id, count in counts.items():
            if count:
                counted[replica_id] = counted.get(replica_id, 0) + count
    assert counted == by_home
    assert pages == (sum(policy._replica_id_to_session_pages.values())
                     + sum(policy._replica_id_to_new_session_pages.values()))
    for counted_, pages_of in ((True, policy._replica_id_to_session_pages),
                               (False, policy._replica_id_to_new_session_pages)):
        expected = {r: n for (r, c), n in pages_by_home.items() if c == counted_}
        assert {r: n for r, n in pages_of.items() if n} == expected
    assert lengths == policy._session_tail_lengths
    assert 0.0 <= policy.session_continue_rate <= 1.0


@pytest.mark.parametrize("seed", range(12))
def test_the_session_books_stay_consistent_under_random_traffic(seed, monkeypatch):
    """Random prompts over a 3-token alphabet and 4-token pages (so they share and continue each other's pages and
    tails; half of them a chat's next turn), many at the same instant, with and without partial keys, on replicas of
    0-40 pages (chats outgrow their homes and move: 24 session moves over the 12 seeds); requests moved by Serve,
    retried by Serve (the same request id asked again, half of the time after its replica refused it, which completes
    it), finished, replicas leaving; windows of 0-10 s; idle factors 0, 0.5 and 1.5 after 2 gaps seen (68 sessions
    turn idle in 5 seeds, and 5 of them go on after all, in 2). After every step the counters match the live
    sessions, and a session recorded by a request still in flight is homed where that request is counted; at the end
    all expire."""
    import random

    rng = random.Random(seed)
    page_size = 4
    clock = [0.0]
    policy = PrefixAwarePolicy(PrefixIndex(clock=lambda: clock[0]),
                               PolicyConfig(page_size=page_size, session_window_s=rng.choice([0.0, 1.0, 3.0, 10.0]),
                                            session_growth=rng.choice([0.5, 4.0, 100.0]),
                                            session_idle_factor=rng.choice([0.0, 0.5, 1.5])))
    monkeypatch.setattr("router.policy._SESSION_MIN_GAPS", 2)  # sessions turn idle within the test's 200 steps
    replicas = ["a", "b", "c"]
    now = 0.0
    unfinished: list[tuple] = []
    chats: list[list[int]] = [[rng.randint(0, 2) for _ in range(8)] for _ in range(4)]
    for step in range(200):
        if rng.random() < 0.05:
            policy.forget_replica(rng.choice(replicas))
            _check_session_books(policy)
            continue
        if rng.random() < 0.5:
            now += rng.choice([0.0, 0.0, 0.5, 1.0, 2.0])
            clock[0] = now
        # page counts from none (no stats yet) to a few pages, where chats outgrow their homes and move
        candidates = [ReplicaLoad(r, rng.randint(0, 4), rng.randint(0, 40), rng.choice([0, 3, 6, 20, 40]))
                      for r in replicas]
        if unfinished and rng.random() < 0.3:  # Serve asks again for a request
            request_id, keys, tokens, partial_key = rng.choice(unfinished)
            if rng.random() < 0.5:
                policy.note_finished(request_id)  # its replica refused it
        else:
            tokens = [rng.randint(0, 2) for _ in range(rng.randint(1, 30))]
            if rng.random() < 0.5:  # a chat's next turn: its last prompt and more (chats outgrow their homes, move)
                chat = rng.randrange(len(chats))
                tokens = chats[chat] = chats[chat] + tokens[:rng.randint(1, 8)]
            keys = [key("k" + ",".join(map(str, tokens[:(n + 1) * page_size])))
                    for n in range(len(tokens) // page_size)]
            partial_key = token_partial_key(keys, tokens, page_size) if keys and rng.random() < 0.8 else None
            request_id = f"r{step}"
            unfinished.append((request_id, keys, tokens, partial_key))
        decision = policy.choose(keys, candidates, num_prompt_tokens=len(tokens), now=now, partial_key=partial_key,
                                 request_id=request_id)
        policy.note_routed(request_id, decision.replica_id, keys, num_prompt_tokens=len(tokens),
                           partial_key=partial_key)
        if rng.random() < 0.2:
            policy.note_routed(request_id, rng.choice(replicas))  # Serve sent it elsewhere
        _check_session_books(policy)
        for tails in policy._sessions.values():
            for session in tails.values():
                assert session.continues is None or session.continues.continues is None  # no chain of turns
                if session.request_id in policy._request_id_to_replica_id:
                    assert session.replica_id == policy._request_id_to_replica_id[session.request_id]
        if rng.random() < 0.5:
            policy.note_finished(unfinished.pop(rng.randrange(len(unfinished)))[0])
        if keys and rng.random() < 0.5:
            policy.index.apply_events(rng.choice(replicas), [PagesStored(1, tuple(keys))])
        _check_session_books(policy)
    policy._forget_sessions(now + 1e9)
    _check_session_books(policy)
    assert not policy._sessions and not policy._session_order and not policy._session_tail_lengths
    assert not policy._finished_order  # finishes are forgotten with their windows, idle factor or not
    assert sum(policy._replica_id_to_session_pages.values()) == 0
    assert sum(policy._replica_id_to_new_session_pages.values()) == 0
