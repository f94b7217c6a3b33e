"""Routing-stats wire format and the ReplicaEventLog payload rule, checked end to end into a PrefixIndex."""

from __future__ import annotations

import pickle

import msgpack
import pytest

from common.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from common.types import EngineStats
from common.routing_stats import IndexSnapshot, ReplicaLoad, RoutingStatsError, make_routing_stats, parse_routing_stats
from replica.event_log import ReplicaEventLog
from router.index import PrefixIndex


def key(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def engine_stats(num_running: int = 0, num_waiting: int = 0) -> EngineStats:
    return EngineStats(
        replica_id="r1",
        num_prompt_tokens_queried=0,
        num_prompt_tokens_hit=0,
        num_pages_total=64,
        num_pages_free=40,
        num_pages_cached=20,
        num_pages_in_use=4,
        num_evictions=0,
        num_preemptions=0,
        num_running=num_running,
        num_waiting=num_waiting,
        num_requests_finished=0,
        page_size=128,
    )


class FakeReplica:
    """A replica's cache as a set of keys, emitting consecutive events into its ReplicaEventLog."""

    def __init__(self, **log_kwargs) -> None:
        self.cached: set[bytes] = set()
        self.seq = 0
        self.log = ReplicaEventLog("r1", epoch="e1", **log_kwargs)
        self.num_snapshots_taken = 0

    def store(self, *names: str) -> None:
        keys = tuple(key(n) for n in names)
        self.cached.update(keys)
        self._emit(PagesStored(self._next_seq(), keys))

    def remove(self, *names: str) -> None:
        keys = tuple(key(n) for n in names)
        self.cached.difference_update(keys)
        self._emit(PagesRemoved(self._next_seq(), keys))

    def clear(self) -> None:
        self.cached.clear()
        self._emit(AllPagesCleared(self._next_seq()))

    def payload(self) -> dict:
        return self.log.stats_payload(engine_stats(), self._snapshot_keys)

    def _snapshot_keys(self) -> list[bytes]:
        self.num_snapshots_taken += 1
        return sorted(self.cached)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _emit(self, event: KVEvent) -> None:
        self.log.append([event])


def apply(index: PrefixIndex, payload: dict) -> None:
    report = parse_routing_stats(payload)
    index.sync("r1", epoch=report.epoch, events=report.events, snapshot=report.snapshot)


def indexed_keys(index: PrefixIndex, names: str) -> set[str]:
    return {n for n in names.split() if index.holds("r1", key(n))}


def test_payload_round_trips_through_msgpack_and_pickle():
    events = [PagesStored(1, (key("a"), key("b"))), PagesRemoved(2, (key("a"),)), AllPagesCleared(3)]
    payload = make_routing_stats("r1", engine_stats(2, 1), events, [key("c")], epoch="e1")
    unpacked = msgpack.unpackb(msgpack.packb(payload, use_bin_type=True), raw=False)
    for copy in (unpacked, pickle.loads(pickle.dumps(payload))):
        report = parse_routing_stats(copy)
        assert report.events == tuple(events)
        assert report.snapshot == IndexSnapshot(3, (key("c"),))
        assert (report.replica_id, report.epoch, report.last_seq) == ("r1", "e1", 3)
        assert report.to_load() == ReplicaLoad("r1", num_requests=3, num_pages_free=40, num_pages_total=64)


def test_snapshot_on_first_and_every_kth_payload_only():
    replica = FakeReplica(snapshot_every_n_payloads=3)
    replica.store("a")
    due, has_snapshot = [], []
    for _ in range(7):
        due.append(replica.log.snapshot_due)
        has_snapshot.append(replica.payload()["snapshot"] is not None)
    assert has_snapshot == due == [True, False, False, True, False, False, True]
    assert replica.num_snapshots_taken == 3


def test_idle_replica_payloads_stop_changing():
    replica = FakeReplica(num_payloads_retained=2, snapshot_every_n_payloads=100)
    replica.store("a", "b")
    payloads = [replica.payload() for _ in range(5)]
    assert [len(p["events"]) for p in payloads] == [1, 1, 0, 0, 0]  # each event rides in R payloads
    assert payloads[2] == payloads[3] == payloads[4]


def test_router_missing_up_to_r_minus_1_payloads_catches_up_from_events():
    replica = FakeReplica(num_payloads_retained=3, snapshot_every_n_payloads=100)
    index = PrefixIndex()
    replica.store("a")
    apply(index, replica.payload())  # has the first snapshot
    replica.store("b")
    replica.payload()  # missed
    replica.remove("a")
    replica.payload()  # missed
    replica.store("c")
    apply(index, replica.payload())
    assert indexed_keys(index, "a b c") == {"b", "c"}
    assert not index.needs_snapshot("r1")
    assert index.last_seq("r1") == 4


def test_router_missing_r_payloads_sees_a_gap_then_heals_at_the_next_snapshot():
    replica = FakeReplica(num_payloads_retained=2, snapshot_every_n_payloads=5)
    index = PrefixIndex()
    replica.store("a")
    apply(index, replica.payload())  # payload 0, snapshot
    replica.remove("a")
    replica.payload()  # payload 1, missed
    replica.store("b")
    replica.payload()  # payload 2, missed
    replica.store("c")
    apply(index, replica.payload())  # payload 3: events 3, 4 only (2, which removed "a", is gone)
    assert index.needs_snapshot("r1")
    assert indexed_keys(index, "a b c") == {"a", "b", "c"}  # "a" is stale
    apply(index, replica.payload())  # payload 4, no snapshot yet
    assert index.needs_snapshot("r1")
    apply(index, replica.payload())  # payload 5, snapshot
    assert not index.needs_snapshot("r1")
    assert indexed_keys(index, "a b c") == {"b", "c"}


def test_new_router_joining_late_is_exact_after_a_snapshot():
    replica = FakeReplica(num_payloads_retained=2, snapshot_every_n_payloads=4)
    for number in range(6):
        replica.store(f"k{number}")
        replica.payload()
    index = PrefixIndex()
    replica.clear()
    replica.store("z")
    apply(index, replica.payload())  # payload 6: events only
    assert indexed_keys(index, "k0 k5 z") == {"z"}
    assert index.needs_snapshot("r1")
    replica.store("y")
    apply(index, replica.payload())  # payload 7
    apply(index, replica.payload())  # payload 8: snapshot
    assert not index.needs_snapshot("r1")
    assert index.num_keys("r1") == 2


def test_seq_going_backwards_starts_a_new_epoch_with_a_snapshot():
    replica = FakeReplica(snapshot_every_n_payloads=100)
    index = PrefixIndex()
    replica.store("a", "b")
    apply(index, replica.payload())
    # The engine restarted: its cache is empty and numbering starts again.
    replica.cached.clear()
    replica.seq = 0
    replica.store("c")
    payload = replica.payload()
    assert payload["epoch"] != "e1"
    assert payload["snapshot"] is not None
    apply(index, payload)
    assert indexed_keys(index, "a b c") == {"c"}
    assert not index.needs_snapshot("r1")


def test_seq_skipping_ahead_forces_a_snapshot():
    replica = FakeReplica(snapshot_every_n_payloads=100)
    replica.store("a")
    replica.payload()
    replica.seq += 5
    replica.store("b")
    assert replica.payload()["snapshot"] is not None


def test_overflow_of_unpublished_events_forces_a_snapshot():
    replica = FakeReplica(snapshot_every_n_payloads=100, max_num_buffered_keys=3)
    index = PrefixIndex()
    apply(index, replica.payload())
    for name in ["a", "b", "c", "d", "e"]:
        replica.store(name)
    payload = replica.payload()
    assert [event[1] for event in payload["events"]] == [3, 4, 5]
    assert payload["snapshot"] is not None
    apply(index, payload)
    assert indexed_keys(index, "a b c d e") == {"a", "b", "c", "d", "e"}
    assert not index.needs_snapshot("r1")


def test_request_snapshot():
    replica = FakeReplica(snapshot_every_n_payloads=100)
    replica.payload()
    assert replica.payload()["snapshot"] is None
    replica.log.request_snapshot()
    assert replica.payload()["snapshot"] == {"seq": 0, "keys": b""}


def test_parse_rejects_other_formats_and_broken_payloads():
    assert parse_routing_stats({}) is None
    assert parse_routing_stats(None) is None
    good = make_routing_stats("r1", engine_stats(), [PagesStored(1, (key("a"),))], None, epoch="e1")
    with pytest.raises(RoutingStatsError, match="format"):
        parse_routing_stats({**good, "format": 99})
    with pytest.raises(RoutingStatsError, match="whole number"):
        parse_routing_stats({**good, "events": [["stored", 1, b"short"]]})
    with pytest.raises(RoutingStatsError, match="unknown KV event kind"):
        parse_routing_stats({**good, "events": [["moved", 1, b""]]})
    with pytest.raises(RoutingStatsError, match="malformed"):
        parse_routing_stats({key_: value for key_, value in good.items() if key_ != "load"})


def test_event_log_settings_are_validated():
    with pytest.raises(ValueError, match="must be >= 1"):
        ReplicaEventLog("r1", num_payloads_retained=0)
