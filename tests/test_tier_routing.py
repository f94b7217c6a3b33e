"""The shared tiers' contents reach the router: a replica's ``TierEventRelay`` (replica/event_log.py) carries the
pages it stored in a real disk tier, and their eviction by another process sharing the folder, in routing-stats
payloads; the router's parser and ``PrefixAwarePolicy.tier_index`` (router/policy.py) turn them into tier runs."""

from __future__ import annotations

import time

import pytest

from common.routing_stats import RoutingStatsError, parse_routing_stats
from common.types import EngineStats
from replica.event_log import ReplicaEventLog, TierEventRelay
from replica.tiers.disk_tier import DiskTier
from replica.tiers.seal import TierKey
from router.index import PrefixIndex
from router.policy import PolicyConfig, PrefixAwarePolicy
from tests.test_tiers import make_format, make_pages


IDLE = EngineStats("r1", 0, 0, 8, 8, 0, 0, 0, 0, 0, 0, 0, 16)


def routing_payload(relay: TierEventRelay, log: ReplicaEventLog) -> dict:
    """What ``ServeReplica.record_routing_stats`` returns: the replica's own payload plus the relay's entries."""
    payload = log.stats_payload(IDLE, lambda: [])
    entries = relay.payloads()
    if entries:
        payload["tiers"] = entries
    return payload


def sync(policy: PrefixAwarePolicy, payload: dict) -> None:
    """What the Ray router does with a payload (router/ray_router.py ``_sync_stats``), for the tier part."""
    report = parse_routing_stats(payload)
    for tier in report.tiers:
        policy.tier_index.sync(f"{report.replica_id}@{tier.medium}", epoch=tier.epoch, events=tier.events,
                               snapshot=tier.snapshot)


def until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_disk_tier_pages_and_their_eviction_reach_the_router(tmp_path):
    page_format = make_format()
    tier_key = TierKey.generate()
    page_bytes = 17_000
    ours = DiskTier(tmp_path / "disk", page_format, budget_bytes=12 * page_bytes, tier_key=tier_key)
    other = DiskTier(tmp_path / "disk", page_format, budget_bytes=12 * page_bytes, tier_key=tier_key)
    relay, log = TierEventRelay("r1"), ReplicaEventLog("r1")
    relay.watch([ours])
    policy = PrefixAwarePolicy(PrefixIndex(), PolicyConfig(enable_tier_routing=True))
    first = routing_payload(relay, log)  # before any page: an empty DISK entry with its snapshot
    assert [entry["medium"] for entry in first["tiers"]] == ["DISK"] and first["tiers"][0]["snapshot"]["keys"] == b""
    pages = make_pages(page_format, 6, seed=1)
    keys = [page.key for page in pages]
    try:
        ours.store(pages)
        ours.flush(timeout=10)
        assert ours.event_tracker.wait_idle(10)
        payload = routing_payload(relay, log)
        entry = payload["tiers"][0]
        assert [event[:2] for event in entry["events"]] == [["stored", 1]] and entry["last_seq"] == 1
        sync(policy, payload)
        assert policy.tier_runs(keys) == (0, 6)
        assert policy.tier_index.replica_ids() == ["r1@DISK"]

        # another process's writes evict our oldest pages (the leading ones): the shared index's removal log tells
        # our tracker, the next payload removes them, the run shrinks to nothing (page 0 is gone)
        other.store(make_pages(page_format, 10, seed=50))
        other.flush(timeout=10)

        def shrunk() -> bool:
            sync(policy, routing_payload(relay, log))
            return policy.tier_runs(keys)[1] == 0

        assert until(shrunk)
        assert policy.tier_index.num_keys("r1@DISK") < 6
    finally:
        ours.close()
        other.close()


def test_a_tier_entry_with_a_bad_medium_is_refused():
    payload = ReplicaEventLog("r1").stats_payload(IDLE, lambda: [])
    payload["tiers"] = [{"medium": "CPU@x", "epoch": "e", "last_seq": 0, "events": [], "snapshot": None}]
    with pytest.raises(RoutingStatsError, match="medium"):
        parse_routing_stats(payload)
    payload["tiers"] = [{"medium": "CPU"}]
    with pytest.raises(RoutingStatsError, match="malformed"):
        parse_routing_stats(payload)
