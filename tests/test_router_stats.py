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


# ---- measured costs and retained pages (issue 12) --------------------------------------------------------------------
from common.routing_stats import MeasuredCosts, RetainedPages  # noqa: E402


def test_costs_and_retained_pages_round_trip_and_older_payloads_still_parse():
    costs = MeasuredCosts(step_ms=12.5, prefill_token_ms=0.3, peer_copy_page_ms=2.25)
    retained = [RetainedPages(100, None, (key("s0"), key("s1"))), RetainedPages(20, 1_700_000_060.0, (key("t0"),))]
    payload = make_routing_stats("r1", engine_stats(), [PagesStored(1, (key("s0"),))], None, costs=costs,
                                 retained=retained)
    for wire in (msgpack.unpackb(msgpack.packb(payload, use_bin_type=True), raw=False), pickle.loads(
            pickle.dumps(payload))):
        report = parse_routing_stats(wire)
        assert report.costs == costs and report.to_load().costs == costs
        assert report.retained == tuple(retained)
        assert (report.num_evictions, report.num_pages_retained) == (0, None)
    assert payload["costs"] == {"step_ms": 12.5, "prefill_token_ms": 0.3, "peer_copy_page_ms": 2.25}
    # a payload of an older replica: no costs, no retention, no evictions
    old = make_routing_stats("r1", engine_stats(), [], None)
    del old["load"]["num_evictions"]
    report = parse_routing_stats(old)
    assert (report.costs, report.retained, report.num_evictions, report.to_load().costs) == (None, None, None, None)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_cost_that_is_not_a_measurement_is_refused(bad):
    payload = make_routing_stats("r1", engine_stats(), [], None)
    payload["costs"] = {"prefill_token_ms": bad}
    with pytest.raises(RoutingStatsError, match="prefill_token_ms"):
        parse_routing_stats(payload)


def test_idle_replica_payloads_stop_changing_with_costs_and_retention():
    replica = FakeReplica()
    replica.store("a0")
    costs = MeasuredCosts(step_ms=10.0)
    retained = [RetainedPages(50, 1_700_000_000.0, (key("a0"),))]
    payloads = [replica.log.stats_payload(engine_stats(), replica._snapshot_keys, costs=costs, retained=retained)
                for _ in range(3)]
    assert payloads[1] == payloads[2]


def test_step_cost_fit_recovers_the_step_model_and_keeps_the_prior_for_what_it_cannot_tell_apart():
    from replica.cost_meter import DEFAULT_STEP_COSTS, StepCostFit

    truth = (20.0, 0.25, 0.5, 3.0)  # step_ms, prefill_token_ms, attention_pair_us, decode_row_ms
    fit = StepCostFit(decay=1.0, prior_steps=1e-6)
    for prefill, context, rows in [(0, 0, 1), (0, 0, 4), (512, 0, 0), (256, 512, 2), (1024, 1024, 1), (64, 2048, 8),
                                   (128, 128, 3)]:
        pairs = prefill * (context + prefill / 2)
        milliseconds = truth[0] + truth[1] * prefill + truth[2] * 1e-3 * pairs + truth[3] * rows
        fit.observe(milliseconds / 1000.0, prefill, pairs, rows)
    assert fit.coefficients() == pytest.approx(truth, rel=1e-3)
    # decode steps only: the step and row costs are measured, prefill and attention stay at the defaults
    decodes = StepCostFit(decay=1.0)
    for rows in (1, 2, 4, 8) * 50:
        decodes.observe((truth[0] + truth[3] * rows) / 1000.0, 0, 0.0, rows)
    step_ms, prefill_ms, pair_us, row_ms = decodes.coefficients()
    assert (step_ms, row_ms) == pytest.approx((truth[0], truth[3]), rel=0.01)
    assert (prefill_ms, pair_us) == pytest.approx(DEFAULT_STEP_COSTS[1:3], rel=1e-3)


def test_source_meter_is_an_ewma_of_seconds_per_page_between_periods():
    from common.types import CacheSource, SourceStats
    from replica.cost_meter import ReplicaCostMeter

    meter = ReplicaCostMeter(min_steps=2)
    assert meter.costs() is None
    stats = {CacheSource.PEER: SourceStats(pages=10, seconds=0.04), CacheSource.HOST: SourceStats()}
    meter.observe_sources(stats)  # 4 ms per page
    stats[CacheSource.PEER] = SourceStats(pages=20, seconds=0.04 + 0.02)  # 2 ms per page over the period
    meter.observe_sources(stats)
    meter.observe_sources(stats)  # nothing new: unchanged
    costs = meter.costs()
    assert costs.peer_copy_page_ms == pytest.approx(4.0 + 0.3 * (2.0 - 4.0))
    assert (costs.host_page_ms, costs.disk_page_ms, costs.step_ms) == (None, None, None)  # never used, no steps


def test_engine_steps_feed_the_meter_and_retained_keys_reach_the_payload():
    """A real engine (tiny random Llama): its step observer sees every step, and the KV manager lists the pages of a
    retained prompt with their priority and TTL."""
    from common.types import EngineRequest, Retention, SamplingParams
    from replica.cost_meter import ReplicaCostMeter, retained_groups
    from tests.engine_utils import TinyModel

    engine = TinyModel("llama").engine(page_size=128, enforce_eager=True)
    meter = ReplicaCostMeter(min_steps=1)
    seen = []
    engine.step_observer = lambda seconds, chunks: (seen.append(len(chunks)), meter.observe_step(seconds, chunks))
    prompt = list(range(1, 300))
    engine.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                     retention=Retention(priority=40, ttl_s=60.0)))
    while engine.has_work():
        engine.step()
    assert len(seen) == 3 and meter.costs().step_ms is not None
    retained = engine.kv.retained_keys()
    assert [priority for _, priority, _ in retained] == [40, 40] and all(55 < left <= 60 for _, _, left in retained)
    same_left = [(key, priority, 59.5) for key, priority, _ in retained]
    [group] = retained_groups(same_left, now_wall=1000.2)  # 1059.7, rounded up to the second
    assert (group.priority, group.expires_at, set(group.keys)) == (40, 1060.0, set(engine.page_keys(prompt)))


def test_a_stall_is_left_out_of_the_step_fit():
    from replica.cost_meter import StepCostFit

    fit = StepCostFit(decay=1.0)
    for rows in (1, 2, 4, 8) * 10:
        fit.observe((20.0 + 3.0 * rows) / 1000.0, 0, 0.0, rows)
    fit.observe(2.0, 0, 0.0, 1)  # a 2 s compile
    assert fit.num_outliers == 1
    assert fit.coefficients()[0] == pytest.approx(20.0, rel=0.01)


def test_a_replica_s_page_stream_round_trips_and_a_malformed_one_is_refused_without_showing_its_token(caplog):
    from common.routing_stats import encode_stream, parse_stream
    from common.types import StreamLocation

    log = ReplicaEventLog("r1", epoch="e1")
    location = StreamLocation("10.0.0.7", 41235, bytes(range(32)), "host-a/node-1")
    payload = log.stats_payload(engine_stats(2, 1), lambda: [])
    assert parse_routing_stats(payload).stream is None  # a replica without a stream (or an older one)
    payload["stream"] = encode_stream(location)
    for wire in (msgpack.unpackb(msgpack.packb(payload, use_bin_type=True), raw=False),
                 pickle.loads(pickle.dumps(payload))):
        assert parse_routing_stats(wire).stream == location
    assert parse_stream(encode_stream(StreamLocation("::1", 1, b"t" * 32))) == StreamLocation("::1", 1, b"t" * 32)
    secret = b"s" * 32
    for bad in (["10.0.0.7", 41235, secret], ["", 41235, secret, None], ["h", 0, secret, None],
                ["h", 70000, secret, None], ["h", "41235", secret, None], ["h", 41235, secret[:31], None],
                ["h", 41235, "s" * 32, None], ["h", 41235, secret, 7], "h:41235", 5):
        with pytest.raises(RoutingStatsError) as error:
            parse_stream(bad)
        assert "sss" not in str(error.value) and "115, 115" not in str(error.value)
        # in a payload it only costs the page stream: the events and load of the report still count
        caplog.clear()
        with caplog.at_level("WARNING"):
            report = parse_routing_stats({**payload, "stream": bad})
        assert report.stream is None and report.replica_id == "r1" and report.num_pages_total == 64
        assert "peers copy through Ray" in caplog.text and "sss" not in caplog.text
