"""PrefixAwarePolicy: affinity, load balancing with peer hints, no-match placement, in-flight accounting."""

from __future__ import annotations

import pytest

from common.events import PagesRemoved, PagesStored
from router.index import PrefixIndex
from router.policy import PolicyConfig, PrefixAwarePolicy, RoutingDecision, RoutingReason, tie_score
from common.routing_stats import ReplicaLoad


def key(name: str) -> bytes:
    return name.encode().ljust(32, b".")


PROMPT = [key("p0"), key("p1"), key("p2"), key("p3")]


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
    assert policy.choose(PROMPT, loads(a=4, b=0)).replica_id == "a"  # gap 4 is not > 4
    assert policy.choose(PROMPT, loads(a=5, b=0)).replica_id == "b"


def test_imbalance_within_relative_threshold_keeps_affinity():
    policy = make_policy(a=4)
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


def test_no_match_goes_to_the_emptiest_cache_then_the_least_loaded():
    policy = make_policy(a=4)  # a caches 4 pages, b and c none
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
    policy = make_policy()
    candidates = loads(a=0, b=0, c=0)
    expected = max("abc", key=lambda replica_id: tie_score(key("q0"), replica_id))
    assert expected == "b"
    for suffix in ["q1", "x1", "y1"]:
        assert policy.choose([key("q0"), key(suffix)], candidates).replica_id == "b"
    assert policy.choose([key("r0")], candidates).replica_id == "a"
    # no full page: the bare replica id decides (on a fresh policy: cache sizes tie)
    assert make_policy().choose([], candidates).replica_id == "b"


def test_new_prefixes_spread_over_the_replicas_caches():
    # loads tie: each new prefix goes to the replica expected to hold the fewest pages, so 8 prefixes split 4 / 4
    policy = make_policy()
    candidates = loads(a=0, b=0)
    chosen = [policy.choose([key(f"p{n}-0"), key(f"p{n}-1")], candidates).replica_id for n in range(8)]
    assert sorted(chosen) == ["a"] * 4 + ["b"] * 4
    assert tie_score(b"", "b") > max(tie_score(b"", "a"), tie_score(b"", "c"))


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
    policy = make_policy(a=4)
    chosen = []
    for number in range(7):
        decision = policy.choose(PROMPT, loads(a=0, b=0))
        policy.note_routed(f"req-{number}", decision.replica_id)
        chosen.append((decision.replica_id, decision.peer_hint))
    # a takes 5 (gap 5 > 4 and 5 > 1.5 * 0), then b takes one (copying from a); from then on b is expected to hold the
    # prefix too, so the next request goes to the less loaded of the two holders: b again.
    assert chosen == [("a", None)] * 5 + [("b", "a"), ("b", None)]


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
