"""Hot-prefix replication planner (router/replication.py), no Ray: exact decisions, budget, cancellation and timeouts
under a fake clock."""

import pytest

from router.replication import (CancelCopy, HotPrefixPlanner, ReplicationConfig, StartCopy, planner_for,
                                register_planner)

PREFIX = [b"p0", b"p1", b"p2"]
OTHER = [b"o0", b"o1", b"o2"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys_of(prefix, index):
    """A request's page keys: the shared prefix, then a page of its own."""
    return list(prefix) + [prefix[0] + b"-tail-%d" % index]


def make(**overrides):
    clock = Clock()
    settings = dict(window_s=5.0, min_requests=3, busy_requests=2, max_replicas=3, budget_pages=100, interval_s=10.0,
                    max_inflight=2, settle_s=1.0, copy_timeout_s=4.0)
    settings.update(overrides)
    return HotPrefixPlanner(ReplicationConfig(**settings), clock=clock), clock


def hammer(planner, prefix=PREFIX, *, num=3, matched=None, loads=None, start=0, tokens=None, salt=None):
    """``num`` requests of ``prefix`` with the index and loads given; returns how many planned a copy."""
    matched = {"a": len(prefix) + 1} if matched is None else matched
    loads = {"a": 5, "b": 0, "c": 1} if loads is None else loads
    tokens = tokens if tokens is not None else list(range(4 * 128))
    return sum(planner.observe(keys_of(prefix, start + i), tokens, salt, matched, loads) for i in range(num))


def test_a_hot_prefix_with_a_busy_holder_is_copied_to_the_least_loaded_other_replica():
    planner, _ = make()
    tokens = list(range(500))
    assert hammer(planner, num=2, tokens=tokens) == 0  # below min_requests: not hot yet
    assert planner.copies() == []
    assert hammer(planner, num=1, start=2, tokens=tokens, salt="tenant") == 1
    # the three requests share 3 pages (their 4th differs): the hot prefix is p0..p2, from a (holder) to b (load 0)
    assert planner.copies() == [("copy-1", "pending", "b", "a", 3)]
    actions = planner.tick()
    assert actions == [StartCopy("copy-1", "b", "a", tokens, 3, "tenant")]
    assert planner.copies() == [("copy-1", "running", "b", "a", 3)]
    # more requests while it runs plan nothing more (one copy of a prefix at a time)
    assert hammer(planner, num=3, start=3) == 0
    stats = planner.snapshot()
    assert (stats.num_planned, stats.num_started, stats.num_pages_started) == (1, 1, 3)


def test_no_copy_while_a_holder_has_room_or_no_replica_is_less_loaded():
    planner, _ = make()
    assert hammer(planner, num=5, loads={"a": 1, "b": 0, "c": 0}) == 0  # holder below busy_requests
    assert hammer(planner, num=5, start=5, loads={"a": 3, "b": 3, "c": 4}) == 0  # nowhere less busy
    assert hammer(planner, num=5, start=10, matched={}) == 0  # nobody holds it yet: nothing to copy from
    assert planner.copies() == []


def test_the_rate_trigger_copies_without_busy_holders():
    planner, _ = make(requests_per_replica_s=0.5)  # one replica serves 0.5 request/s of a prefix: 2.5 per window
    assert hammer(planner, num=2, loads={"a": 0, "b": 0}) == 0
    assert hammer(planner, num=1, start=2, loads={"a": 0, "b": 0}) == 1  # 3 in 5 s = 0.6/s > 0.5 * 1 holder
    assert planner.copies() == [("copy-1", "pending", "b", "a", 3)]


def test_the_source_is_the_fullest_holder_and_a_partial_target_copies_only_what_it_lacks():
    planner, _ = make()
    matched = {"a": 4, "d": 4, "c": 2}  # c holds the first two pages of the prefix
    hammer(planner, num=3, matched=matched, loads={"a": 6, "d": 4, "c": 1, "b": 1})
    # source: a and d hold all 4 leading pages, d is less loaded; target: b and c tie on load, c holds more
    assert planner.copies() == [("copy-1", "pending", "c", "d", 1)]
    assert planner.tick() == [StartCopy("copy-1", "c", "d", list(range(512)), 3, None)]


def test_a_third_replica_only_after_the_second_copy_settles_and_demand_still_exceeds_two():
    planner, clock = make()
    hammer(planner, num=3)
    planner.tick()
    clock.now += 0.5
    planner.report_done("copy-1", 3)
    assert planner.copies() == [("copy-1", "done", "b", "a", 3)]
    # within settle_s: nothing new, even with both busy
    assert hammer(planner, num=1, start=3, matched={"a": 4, "b": 4}, loads={"a": 5, "b": 5, "c": 1}) == 0
    clock.now += 1.0
    # the index confirms b: the done copy is dropped; a and b are both busy, c is less loaded: a third copy, from
    # the less loaded of the two full holders
    assert hammer(planner, num=1, start=4, matched={"a": 4, "b": 4}, loads={"a": 5, "b": 3, "c": 1}) == 1
    assert planner.copies() == [("copy-2", "pending", "c", "b", 3)]
    planner.tick()
    planner.report_done("copy-2", 3)
    clock.now += 2.0
    # max_replicas = 3 reached
    assert hammer(planner, num=3, start=5, matched={"a": 4, "b": 4, "c": 4}, loads={"a": 9, "b": 9, "c": 9, "d": 0}) == 0
    stats = planner.snapshot()
    assert (stats.num_done, stats.num_pages_copied) == (2, 6)


def test_the_budget_per_interval_holds_copies_back_until_the_next_interval():
    planner, clock = make(budget_pages=4, window_s=60.0)
    clock.now = 100.0  # interval [100, 110)
    hammer(planner, PREFIX, num=3)
    hammer(planner, OTHER, num=3, matched={"c": 4}, loads={"a": 0, "b": 1, "c": 5})
    assert planner.copies() == [("copy-1", "pending", "b", "a", 3), ("copy-2", "pending", "a", "c", 3)]
    assert [a.copy_id for a in planner.tick()] == ["copy-1"]  # 3 of 4 pages used: copy-2 (3 pages) must wait
    planner.report_done("copy-1", 3)
    clock.now = 109.0
    hammer(planner, OTHER, num=1, start=3, matched={"c": 4}, loads={"a": 0, "b": 1, "c": 5})  # keep it hot
    assert planner.tick() == []
    clock.now = 110.0
    hammer(planner, OTHER, num=1, start=4, matched={"c": 4}, loads={"a": 0, "b": 1, "c": 5})
    assert [a.copy_id for a in planner.tick()] == ["copy-2"]
    assert planner.snapshot().num_pages_started == 6


def test_a_prefix_longer_than_the_budget_is_trimmed_to_it():
    planner, _ = make(budget_pages=2)
    hammer(planner, num=3)
    assert planner.copies() == [("copy-1", "pending", "b", "a", 2)]
    assert planner.tick() == [StartCopy("copy-1", "b", "a", list(range(512)), 2, None)]


def test_at_most_max_inflight_copies_run():
    planner, _ = make(max_inflight=1)
    hammer(planner, PREFIX, num=3)
    hammer(planner, OTHER, num=3, matched={"c": 4}, loads={"a": 0, "b": 1, "c": 5})
    assert [a.copy_id for a in planner.tick()] == ["copy-1"]
    assert planner.tick() == []
    planner.report_failed("copy-1")
    hammer(planner, OTHER, num=1, start=3, matched={"c": 4}, loads={"a": 0, "b": 1, "c": 5})
    assert [a.copy_id for a in planner.tick()] == ["copy-2"]
    assert planner.snapshot().num_failed == 1


def test_copies_are_cancelled_when_demand_drops():
    planner, clock = make(max_inflight=1)
    clock.now = 100.0
    hammer(planner, PREFIX, num=3)
    clock.now = 101.0
    hammer(planner, OTHER, num=3, matched={"c": 4}, loads={"a": 0, "b": 1, "c": 5})
    assert [a.copy_id for a in planner.tick()] == ["copy-1"]  # copy-2 pending behind max_inflight
    clock.now = 105.0  # PREFIX's requests (t=100) left the 5 s window; OTHER's (t=101) not yet
    assert planner.tick() == [CancelCopy("copy-1", "demand dropped"), StartCopy("copy-2", "a", "c",
                                                                                 list(range(512)), 3, None)]
    clock.now = 106.0
    assert planner.tick() == [CancelCopy("copy-2", "demand dropped")]
    assert planner.copies() == []
    planner.report_done("copy-1", 3)  # a late answer of a cancelled copy is ignored
    stats = planner.snapshot()
    assert (stats.num_started, stats.num_cancelled, stats.num_done) == (2, 2, 0)


def test_a_pending_copy_is_cancelled_without_an_action():
    planner, clock = make(budget_pages=1)
    hammer(planner, PREFIX, num=3)  # 3 pages trimmed to the budget of 1
    hammer(planner, OTHER, num=3, matched={"c": 4}, loads={"a": 0, "b": 1, "c": 5})
    assert [a.copy_id for a in planner.tick()] == ["copy-1"]
    clock.now += 5.0
    assert planner.tick() == [CancelCopy("copy-1", "demand dropped")]  # copy-2 was pending: dropped silently
    assert planner.copies() == [] and planner.snapshot().num_cancelled == 2


def test_a_copy_running_too_long_is_cancelled_and_counted_failed():
    planner, clock = make(window_s=60.0)
    hammer(planner, num=3)
    planner.tick()
    clock.now += 4.0
    assert planner.tick() == [CancelCopy("copy-1", "timed out")]
    stats = planner.snapshot()
    assert (stats.num_failed, stats.num_cancelled) == (1, 0)
    # after settle_s the prefix may be planned again
    assert hammer(planner, num=1, start=3) == 0
    clock.now += 1.0
    assert hammer(planner, num=1, start=4) == 1


def test_a_replica_that_leaves_is_forgotten():
    planner, _ = make()
    hammer(planner, num=3)
    planner.tick()
    planner.forget_replica("b")
    assert planner.copies() == []
    assert planner.tick() == [CancelCopy("copy-1", "replica b left")]
    assert planner.snapshot().num_cancelled == 1
    planner.forget_replica("zzz")
    assert planner.tick() == []


def test_the_hot_prefix_is_the_leading_run_counted_enough():
    planner, _ = make()
    # two requests also share a 4th page: still only 3 pages are hot with min_requests = 3
    planner.observe(PREFIX + [b"x"], [], None, {"a": 4}, {"a": 5, "b": 0})
    planner.observe(PREFIX + [b"x"], [], None, {"a": 4}, {"a": 5, "b": 0})
    assert planner.num_requests(b"x") == 2
    planner.observe(PREFIX + [b"y"], [], None, {"a": 4}, {"a": 5, "b": 0})
    assert planner.copies() == [("copy-1", "pending", "b", "a", 3)]


def test_config_is_validated_and_the_registry_finds_the_planner():
    with pytest.raises(ValueError, match="min_requests"):
        ReplicationConfig(min_requests=0)
    with pytest.raises(ValueError, match="max_replicas"):
        ReplicationConfig(max_replicas=1)
    with pytest.raises(ValueError, match="window_s"):
        ReplicationConfig(window_s=0)
    planner = HotPrefixPlanner()
    register_planner("app", "Replica", planner)
    assert planner_for("app", "Replica") is planner and planner_for("app", "Other") is None
    register_planner("app", "Replica", None)
    assert planner_for("app", "Replica") is None


# ---- the flags and the metrics (no Ray) --------------------------------------------------------------------------------
def test_the_flag_is_off_by_default_and_needs_peer_copy():
    from cluster.cli import build_parser, config_from_args
    from cluster.config import ServeConfig

    base = dict(devices="cpu", num_cpus_per_replica=1.0)
    assert ServeConfig(data_parallel_degree=2, **base).enable_hot_prefix_replication is False
    assert ServeConfig(data_parallel_degree=2, enable_hot_prefix_replication=True,
                       **base).enable_hot_prefix_replication is True
    with pytest.raises(ValueError, match="needs --enable-dp-cross-replica-prefix-copy"):
        ServeConfig(data_parallel_degree=2, enable_dp_cross_replica_prefix_copy=False,
                    enable_hot_prefix_replication=True, **base)
    with pytest.raises(ValueError, match="--hot-prefix-min-requests"):
        ServeConfig(data_parallel_degree=2, hot_prefix_min_requests=0, **base)
    args = build_parser().parse_args(["serve", "--devices", "cpu", "--data-parallel-degree", "2",
                                      "--enable-hot-prefix-replication", "--hot-prefix-busy-requests", "6",
                                      "--hot-prefix-copy-budget", "32"])
    config = config_from_args(args)
    assert config.enable_hot_prefix_replication is True
    assert config_from_args(build_parser().parse_args(["serve", "--devices", "cpu"])).enable_hot_prefix_replication \
        is False
    assert (config.replication_config().busy_requests, config.replication_config().budget_pages) == (6, 32)


def test_metrics_show_the_planner_and_the_replicas_counters():
    from cluster.metrics import IngressMetrics
    from common.types import EngineStats, ProactiveCopyStats
    from router.replication import ReplicationStats

    stats = EngineStats("r1", 0, 0, 8, 8, 0, 0, 0, 0, 0, 0, 0, 128,
                        proactive=ProactiveCopyStats(num_prefetches=3, num_failed=1, num_pages_copied=8,
                                                     num_pages_present=2, num_hit_pages=16, num_hit_requests=2))
    planner = ReplicationStats(num_planned=4, num_started=3, num_done=2, num_cancelled=1, num_failed=0,
                               num_pages_started=12, num_pages_copied=8)
    text = IngressMetrics().render([stats], (), planner).decode()
    for line in ('prefixserve_hot_prefix_copies_total{outcome="planned"} 4.0',
                 'prefixserve_hot_prefix_copies_total{outcome="cancelled"} 1.0',
                 'prefixserve_hot_prefix_copy_pages_total{stage="started"} 12.0',
                 'prefixserve_hot_prefix_prefetches_total{outcome="ok",replica="r1"} 2.0',
                 'prefixserve_hot_prefix_pages_total{kind="copied",replica="r1"} 8.0',
                 'prefixserve_hot_prefix_hit_pages_total{replica="r1"} 16.0',
                 'prefixserve_hot_prefix_hit_requests_total{replica="r1"} 2.0'):
        assert line in text
    assert "hot_prefix_copies_total{" not in IngressMetrics().render([], ()).decode()  # off: no samples
