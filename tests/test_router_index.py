"""PrefixIndex: leading-prefix matching, event application, gaps and snapshots, replicas joining and leaving."""

from __future__ import annotations

from common.events import AllPagesCleared, PagesRemoved, PagesStored
from common.routing_stats import IndexSnapshot
from router.index import PrefixIndex, SyncResult


def key(name: str) -> bytes:
    """A readable 32-byte stand-in for a page key."""
    return name.encode().ljust(32, b".")


K0, K1, K2, K3 = key("k0"), key("k1"), key("k2"), key("k3")


def make_index() -> PrefixIndex:
    """The picture in router/index.py: a holds k0 k1 k3, b holds k0, c holds k1 k2."""
    index = PrefixIndex()
    index.apply_events("a", [PagesStored(1, (K0, K1)), PagesStored(2, (K3,))])
    index.apply_events("b", [PagesStored(1, (K0,))])
    index.apply_events("c", [PagesStored(1, (K1, K2))])
    index.check_integrity()
    return index


def test_longest_prefix_counts_only_leading_pages():
    index = make_index()
    assert index.longest_prefix([K0, K1, K2, K3]) == {"a": 2, "b": 1}
    assert index.longest_prefix([K1, K2]) == {"a": 1, "c": 2}
    assert index.longest_prefix([K2]) == {"c": 1}
    assert index.longest_prefix([key("other")]) == {}
    assert index.longest_prefix([]) == {}


def test_longest_prefix_restricted_to_given_replicas():
    index = make_index()
    assert index.longest_prefix([K0, K1], replica_ids=["b", "c"]) == {"b": 1}
    assert index.longest_prefix([K0, K1], replica_ids=[]) == {}


def test_removed_pages_stop_counting():
    index = make_index()
    result = index.apply_events("a", [PagesRemoved(3, (K1,))])
    assert result == SyncResult(num_events_applied=1)
    assert index.longest_prefix([K0, K1, K2]) == {"a": 1, "b": 1}
    assert not index.holds("a", K1)
    assert index.holds("c", K1)
    index.apply_events("b", [PagesRemoved(2, (K0,))])
    assert index.longest_prefix([K0, K1]) == {"a": 1}
    index.check_integrity()


def test_all_pages_cleared_drops_every_key_of_that_replica_only():
    index = make_index()
    index.apply_events("a", [AllPagesCleared(3)])
    assert index.num_keys("a") == 0
    assert index.longest_prefix([K0, K1]) == {"b": 1}
    assert index.last_seq("a") == 3
    index.check_integrity()


def test_duplicate_events_are_skipped():
    index = PrefixIndex()
    events = [PagesStored(1, (K0,)), PagesStored(2, (K1,))]
    assert index.apply_events("a", events) == SyncResult(num_events_applied=2)
    assert index.apply_events("a", events) == SyncResult(num_events_skipped=2)
    assert index.apply_events("a", events + [PagesRemoved(3, (K1,))]) == SyncResult(1, 2)
    assert index.longest_prefix([K0, K1]) == {"a": 1}


def test_gap_is_applied_best_effort_and_flags_snapshot():
    index = PrefixIndex()
    index.apply_snapshot("a", IndexSnapshot(seq=1, keys=(K0,)))
    assert not index.needs_snapshot("a")
    # seq 2 (which removed K0) and 3 were missed.
    result = index.apply_events("a", [PagesStored(4, (K2,))])
    assert result == SyncResult(num_events_applied=1, num_gaps=1)
    assert index.needs_snapshot("a")
    assert index.longest_prefix([K0]) == {"a": 1}  # stale: costs only a miss
    index.apply_snapshot("a", IndexSnapshot(seq=4, keys=(K1, K2)))
    assert not index.needs_snapshot("a")
    assert index.longest_prefix([K0]) == {}
    assert index.longest_prefix([K1, K2]) == {"a": 2}
    assert index.last_seq("a") == 4
    index.check_integrity()


def test_sync_uses_snapshot_after_gap_and_replays_newer_events():
    index = PrefixIndex()
    index.sync("a", epoch="e1", events=[PagesStored(1, (K0,))], snapshot=IndexSnapshot(0, ()))
    assert not index.needs_snapshot("a")
    # Missed 2..5; this report carries 6 and 7 and a snapshot labelled 6.
    result = index.sync(
        "a",
        epoch="e1",
        events=[PagesStored(6, (K2,)), PagesRemoved(7, (K2,))],
        snapshot=IndexSnapshot(6, (K1, K2)),
    )
    assert result == SyncResult(num_events_applied=3, num_gaps=1, applied_snapshot=True)
    assert index.longest_prefix([K1, K2]) == {"a": 1}
    assert index.longest_prefix([K0]) == {}
    assert index.last_seq("a") == 7
    assert not index.needs_snapshot("a")
    index.check_integrity()


def test_sync_ignores_snapshot_when_in_sync():
    index = PrefixIndex()
    index.sync("a", epoch="e1", snapshot=IndexSnapshot(2, (K0,)))
    result = index.sync("a", epoch="e1", events=[PagesStored(3, (K1,))], snapshot=IndexSnapshot(3, (K0, K1)))
    assert result == SyncResult(num_events_applied=1)
    assert index.longest_prefix([K0, K1]) == {"a": 2}


def test_wrong_guess_is_dropped_by_a_snapshot_with_the_same_label():
    """An idle replica publishes no new events, so its periodic snapshots keep one label; a routing-time guess about it
    must still be replaced by the next one (a held guess would keep pulling its prefix to the wrong replica)."""
    index = PrefixIndex()
    index.sync("a", epoch="e1", events=[PagesStored(1, (K0,))], snapshot=IndexSnapshot(1, (K0,)))
    index.expect_keys("a", [K0])  # already held: not a guess
    assert index.sync("a", epoch="e1", snapshot=IndexSnapshot(1, (K0,))) == SyncResult()
    index.expect_keys("a", [K0, K1, K2])
    assert index.longest_prefix([K0, K1, K2]) == {"a": 3}
    result = index.sync("a", epoch="e1", snapshot=IndexSnapshot(1, (K0,)))
    assert result == SyncResult(applied_snapshot=True)
    assert index.longest_prefix([K0, K1, K2]) == {"a": 1}
    # Guesses gone: the next snapshot with the same label is skipped again; an older one never replaces newer state.
    assert index.sync("a", epoch="e1", snapshot=IndexSnapshot(1, (K0,))) == SyncResult()
    index.sync("a", epoch="e1", events=[PagesStored(2, (K3,))])
    index.expect_keys("a", [K1])
    assert index.sync("a", epoch="e1", snapshot=IndexSnapshot(1, (K0,))) == SyncResult()
    assert index.longest_prefix([K0, K1]) == {"a": 2}
    index.check_integrity()


def test_new_router_applies_events_before_its_first_snapshot():
    index = PrefixIndex()
    result = index.sync("a", epoch="e1", events=[PagesStored(10, (K0,))])
    assert result == SyncResult(num_events_applied=1, reset_epoch=True)
    assert index.needs_snapshot("a")
    assert index.longest_prefix([K0]) == {"a": 1}


def test_new_epoch_drops_what_was_known():
    index = PrefixIndex()
    index.sync("a", epoch="e1", events=[PagesStored(1, (K0, K1))], snapshot=IndexSnapshot(0, ()))
    result = index.sync("a", epoch="e2", events=[PagesStored(1, (K2,))])
    assert result.reset_epoch
    assert index.longest_prefix([K0]) == {}
    assert index.longest_prefix([K2]) == {"a": 1}
    assert index.needs_snapshot("a")
    index.check_integrity()


def test_replicas_joining_and_leaving():
    index = make_index()
    index.add_replica("d")
    assert index.replica_ids() == ["a", "b", "c", "d"]
    assert index.needs_snapshot("d")
    assert index.num_keys("d") == 0
    index.apply_events("d", [PagesStored(1, (K0, K1, K2))])
    assert index.longest_prefix([K0, K1, K2]) == {"a": 2, "b": 1, "d": 3}
    index.remove_replica("a")
    index.remove_replica("unknown")
    assert index.replica_ids() == ["b", "c", "d"]
    assert index.longest_prefix([K0, K1, K2]) == {"b": 1, "d": 3}
    assert not index.holds("a", K0)
    index.check_integrity()
    for replica_id in ["b", "c", "d"]:
        index.remove_replica(replica_id)
    index.check_integrity()
    assert index.longest_prefix([K0]) == {}


# ---- residency ahead: retained pages stay, the others age by the replica's LRU horizon ---------------------------------
import math  # noqa: E402

from common.routing_stats import RetainedPages  # noqa: E402


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def churning_index(clock: FakeClock) -> PrefixIndex:
    """The docstring's example: a has evicted 9_600 pages when it stores k0 k1, then 10_000 one second later, with
    400 pages in its LRU queue (alpha 1: the rate is the last period's, 400/s)."""
    index = PrefixIndex(clock=clock)
    clock.now = 9.0
    index.note_residency("a", num_evictions=9_600, num_lru_pages=400)
    index.apply_events("a", [PagesStored(1, (K0, K1))])
    clock.now = 10.0
    index.note_residency("a", num_evictions=10_000, num_lru_pages=400, alpha=1.0)
    return index


def test_pages_age_by_the_evictions_since_their_touch_and_only_the_wait_is_extrapolated():
    clock = FakeClock()
    index = churning_index(clock)
    assert index.eviction_rate("a") == 400.0
    assert index.expected_resident("a", [K0, K1], 2) == 2  # 400 evicted since the touch: not more than the queue
    assert index.expected_resident("a", [K0, K1], 2, wait_s=0.01) == 0  # 4 more by the admission: gone
    # idle for an hour: no report changes, nothing ages (no wait on an idle replica)
    clock.now = 3600.0
    assert index.expected_resident("a", [K0, K1], 2) == 2
    # a request routed there touches the pages: fresh again
    index.expect_keys("a", [K0, K1])
    assert index.expected_resident("a", [K0, K1], 2, wait_s=0.5) == 2
    assert index.expected_resident("a", [K0, K1], 2, wait_s=1.01) == 0


def test_retained_pages_stay_until_their_retention_ends_and_the_others_age():
    clock = FakeClock()
    index = churning_index(clock)
    index.note_residency("a", wall_now=1000.0, retained=[RetainedPages(100, 1000.0 + 10.0, (K0,))])  # until 20
    # admitted in 1 s (at 11): k0 retained until 20 stays; k1 is past the 400 pages of the queue
    assert index.expected_resident("a", [K0, K1], 2, wait_s=1.0) == 1
    assert index.is_retained("a", K0, 11.0) and not index.is_retained("a", K1, 11.0)
    # admitted after the retention ends: k0 ages like any page
    assert index.expected_resident("a", [K0, K1], 2, wait_s=11.0) == 0


def test_without_reports_nothing_ages_and_a_new_epoch_forgets_retention():
    clock = FakeClock()
    index = PrefixIndex(clock=clock)
    index.sync("a", epoch="e1", events=[PagesStored(1, (K0, K1))])
    assert index.expected_resident("a", [K0, K1], 2, wait_s=1e6) == 2
    index.note_residency("a", num_evictions=0, num_lru_pages=10, retained=[RetainedPages(5, None, (K0,))])
    assert index.is_retained("a", K0, 2e6)  # pinned: no expiry
    index.sync("a", epoch="e2")
    assert not index.is_retained("a", K0, 0.0) and index.eviction_rate("a") == 0.0


def test_pages_in_use_stay_and_age_from_their_release():
    clock = FakeClock()
    index = churning_index(clock)  # k0 k1 touched at 9_600; 10_000 evicted now; queue 400; 400/s
    index.hold("a", [K0])
    index.hold("a", [K0, K1])  # two requests use k0, one uses k1
    # in use: the replica cannot evict them, however long the wait; k1 needs only its own holder
    assert index.expected_resident("a", [K0, K1], 2, wait_s=100.0) == 2
    index.release("a", [K0, K1])  # the second request ends at 10_000 evictions: k1 joins the LRU tail then
    assert index.num_in_use("a") == 1
    assert index.expected_resident("a", [K0, K1], 2, wait_s=0.9) == 2  # 360 more evictions: k1 still queued
    assert index.expected_resident("a", [K0, K1], 2, wait_s=1.01) == 1  # 404 more: k1 gone, k0 still in use
    index.release("a", [K0])
    assert index.num_in_use("a") == 0
    index.note_residency("a", num_evictions=10_300)
    assert index.expected_resident("a", [K0, K1], 2) == 2  # released at 10_000: 300 < 400 since
    index.note_residency("a", num_evictions=10_401)
    assert index.expected_resident("a", [K0, K1], 2) == 0
    # releases of keys never held (a replica that restarted or left) are ignored, a new epoch forgets uses
    index.release("a", [K0, K1])
    index.release("gone", [K0])
    index.hold("a", [K0])
    index.sync("a", epoch="e2")
    assert index.num_in_use("a") == 0


def test_a_residency_report_of_a_new_epoch_drops_the_old_lifetime_first():
    index = PrefixIndex(clock=FakeClock())
    index.sync("a", epoch="e1", events=[PagesStored(1, (K0,))])
    index.note_residency("a", epoch="e1", num_evictions=50, num_lru_pages=10, retained=[RetainedPages(5, None, (K0,))])
    assert index.holds("a", K0) and index.is_retained("a", K0, 0.0)
    index.note_residency("a", epoch="e2", num_evictions=3, num_lru_pages=10, retained=[])
    assert not index.holds("a", K0) and index.needs_snapshot("a")
    index.sync("a", epoch="e2", events=[PagesStored(1, (K1,))])  # the same epoch: kept
    assert index.holds("a", K1) and index.expected_resident("a", [K1], 1) == 1


def test_random_reports_with_lost_and_repeated_events_match_the_replicas_after_each_snapshot():
    """Model-based, seeded: three replicas store, remove and clear keys from a small set (so keys overlap); their
    reports to the router lose events, repeat old ones, come with or without a snapshot of the replica's keys as of
    its latest event, and now and then a replica restarts (a new epoch, numbering from 1). After every report that
    carries a snapshot the index must hold exactly each replica's true keys, and ``longest_prefix`` must agree with a
    brute-force count over the true sets; the index's own integrity check holds after every report."""
    import random

    rng = random.Random(11)
    universe = [key(f"u{i}") for i in range(40)]
    truth = {name: set() for name in "abc"}
    log: dict[str, list] = {name: [] for name in "abc"}  # every event of the replica's current epoch
    delivered = dict.fromkeys("abc", 0)  # seq up to which the router was sent events
    epoch = dict.fromkeys("abc", 0)
    index = PrefixIndex()
    num_snapshots = num_gaps = num_matches = 0

    def brute_force(page_keys):
        counts = {}
        for name, keys in truth.items():
            count = 0
            while count < len(page_keys) and page_keys[count] in keys:
                count += 1
            if count:
                counts[name] = count
        return counts

    for step in range(3000):
        name = rng.choice("abc")
        draw = rng.random()
        if draw < 0.003:  # the replica restarts: empty cache, a new epoch, seq from 1
            truth[name], log[name], delivered[name] = set(), [], 0
            epoch[name] += 1
        elif draw < 0.02:
            truth[name].clear()
            log[name].append(AllPagesCleared(len(log[name]) + 1))
        elif draw < 0.55:
            stored = tuple(rng.sample(universe, rng.randint(1, 4)))
            truth[name].update(stored)
            log[name].append(PagesStored(len(log[name]) + 1, stored))
        elif truth[name]:
            removed = tuple(rng.sample(sorted(truth[name]), min(len(truth[name]), rng.randint(1, 3))))
            truth[name].difference_update(removed)
            log[name].append(PagesRemoved(len(log[name]) + 1, removed))
        if rng.random() < 0.3:  # a routing-stats report of one replica
            reporter = rng.choice("abc")
            fresh = [event for event in log[reporter][delivered[reporter]:] if rng.random() > 0.1]  # some lost
            repeated = log[reporter][max(0, delivered[reporter] - 3):delivered[reporter]] if rng.random() < 0.2 else []
            delivered[reporter] = len(log[reporter])
            with_snapshot = rng.random() < 0.25
            snapshot = IndexSnapshot(len(log[reporter]), tuple(sorted(truth[reporter]))) if with_snapshot else None
            result = index.sync(reporter, epoch=f"{reporter}-{epoch[reporter]}", events=repeated + fresh,
                                snapshot=snapshot)
            num_gaps += result.num_gaps
            index.check_integrity()
            if with_snapshot:
                num_snapshots += 1
                assert {k for k in universe if index.holds(reporter, k)} == truth[reporter], (step, reporter)
        if all({k for k in universe if index.holds(n, k)} == truth[n] for n in "abc"):  # all in step right now
            for _ in range(5):
                page_keys = rng.sample(universe, rng.randint(1, 6))
                assert index.longest_prefix(page_keys) == brute_force(page_keys), (step, page_keys)
                num_matches += 1
    assert num_snapshots > 50 and num_gaps > 10 and num_matches > 50  # the paths were exercised
