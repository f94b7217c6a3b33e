"""vLLM-schema KV events over ZMQ (replica/kv_event_publisher.py), without Ray.

A real engine (tiny random Llama, a small page pool so pages get evicted) serves requests; its KV events go both
the way our router gets them (ReplicaEventLog -> routing-stats payload -> PrefixIndex) and to the ZMQ publisher. A
plain pyzmq subscriber (msgpack, no prefixserve code) joins late, misses batches and later loses one on purpose,
replays both gaps from the ROUTER socket, and rebuilds an index that must equal the router's, block for block; every
``BlockStored`` must re-hash (parent + token ids) to the page key it names.

The shared tiers publish too (replica/tiers/events.py): after stores into a real redis-server bounded by maxmemory
(Redis evicts silently), a DEL, an expiry and a FLUSHALL, and after another "process" evicts from a shared disk tier,
the subscriber's index for medium "CPU" / "DISK" equals what the tier holds of the pages this replica stored. The
engine's vLLM-style timings (one inter-token interval per token, queue / prefill / decode per request) are checked on
a real engine at the end.
"""

from __future__ import annotations

import dataclasses

import os
import time

import msgpack
import pytest
import redis
import zmq

from common.events import AllPagesCleared, PagesRemoved, PagesStored, StoredPageInfo
from common.page_keys import hash_page
from common.routing_stats import parse_routing_stats
from common.types import EngineRequest
from replica.event_log import ReplicaEventLog
from replica.config import KVEventsConfig
from tests.conftest import find_free_port
from replica.kv_event_publisher import (
    NullKVEventPublisher,
    ZmqKVEventPublisher,
    build_publisher,
    encode_batch,
    external_hash,
    offset_endpoint,
    to_vllm_events,
)
from router.index import PrefixIndex
from tests.engine_utils import TinyModel, greedy, random_prompt

PAGE = 128
KEY = lambda name: name.encode().ljust(32, b".")  # noqa: E731


# ---- pure conversion --------------------------------------------------------------------------------------------
def test_config_follows_vllm_shape_and_rejects_unknown_keys():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.buffer_steps, config.enabled) == (
        "zmq", "tcp://*:5557", None, 10_000, True)
    assert KVEventsConfig.parse({"enable_kv_cache_events": False}).publisher == "null"
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    for bad, message in [('{"enable": true}', "unknown keys enable"), ("[1]", "JSON object"), ("{", "JSON object"),
                         ('{"buffer_steps": 0}', "buffer_steps"), ('{"publisher": "kafka"}', "publisher"),
                         ('{"enable_kv_cache_events": true, "endpoint": "http://x"}', "endpoint"),
                         ('{"block_hash_format": "hex"}', "block_hash_format")]:
        with pytest.raises(ValueError, match=message):
            KVEventsConfig.parse(bad)


def test_the_flag_reaches_every_replicas_engine_config():
    from cluster.cli import build_parser, config_from_args
    from cluster.config import ServeConfig

    args = build_parser().parse_args(["serve", "--devices", "cpu", "--kv-events-config",
                                      '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}'])
    config = config_from_args(args)
    assert config.engine_config("r1").kv_events_config == KVEventsConfig(enable_kv_cache_events=True,
                                                                         replay_endpoint="tcp://*:5558")
    from_yaml = ServeConfig.from_mapping({"kv-events-config": {"enable_kv_cache_events": True}, "devices": "cpu"})
    assert from_yaml.kv_events_config.enabled
    assert ServeConfig(devices="cpu").engine_config("r").kv_events_config is None
    with pytest.raises(ValueError, match="--kv-events-config"):
        ServeConfig(devices="cpu", kv_events_config='{"endpoint": 5}')


def test_a_taken_endpoint_leaves_the_replica_serving_without_events(tmp_path):
    for _ in range(5):  # a port found free can be taken by another process before the publisher binds it: another
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{find_free_port()}")
        first = build_publisher(config, page_size=PAGE, rank=0)
        if isinstance(first, ZmqKVEventPublisher):
            break
    try:
        assert isinstance(first, ZmqKVEventPublisher)
        second = build_publisher(config, page_size=PAGE, rank=0)  # the same port: cannot bind
        assert isinstance(second, NullKVEventPublisher)
        second.publish([AllPagesCleared(1)])  # a no-op, not an error
        assert isinstance(build_publisher(None, page_size=PAGE), NullKVEventPublisher)
    finally:
        first.close()


def test_ports_offset_by_rank_like_vllm_data_parallel_ranks():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint(None, 3) is None


def test_stored_pages_become_one_block_stored_per_chain_run():
    a0, a1, a2, b0, b1 = KEY("a0"), KEY("a1"), KEY("a2"), KEY("b0"), KEY("b1")
    tokens = lambda start: tuple(range(start, start + 4))  # noqa: E731
    event = PagesStored(7, (a1, a2, b0, b1), (StoredPageInfo(a0, tokens(4)), StoredPageInfo(a1, tokens(8)),
                                              StoredPageInfo(None, tokens(100), salted=True),
                                              StoredPageInfo(b0, tokens(104), salted=True)))
    stored_a, stored_b = to_vllm_events([event], page_size=4, block_hash_format="bytes")
    assert stored_a == {"type": "BlockStored", "block_hashes": [a1, a2], "parent_block_hash": a0,
                        "token_ids": list(range(4, 12)), "block_size": 4, "lora_id": None, "medium": "GPU",
                        "lora_name": None}
    assert stored_b["block_hashes"] == [b0, b1] and stored_b["parent_block_hash"] is None
    assert stored_b["token_ids"] == list(range(100, 108))
    assert stored_b["extra_keys"] == [("salted",), None]  # the salt's presence on page 0, never the salt
    removed, cleared = to_vllm_events([PagesRemoved(8, (a2,)), AllPagesCleared(9)], page_size=4)
    assert removed == {"type": "BlockRemoved", "block_hashes": [int.from_bytes(a2[-8:], "big")], "medium": "GPU"}
    assert cleared == {"type": "AllBlocksCleared"}
    # vLLM's EventBatch is array_like: [ts, events, data_parallel_rank]
    assert msgpack.unpackb(encode_batch(1.5, [cleared], 3)) == [1.5, [{"type": "AllBlocksCleared"}], 3]


# ---- a real engine, a real ZMQ subscriber ------------------------------------------------------------------------
class Subscriber:
    """What an outside router does with vLLM's KV events: SUB for live batches, ROUTER replay for gaps, and an
    index of block hash -> (parent hash, token ids). Uses only pyzmq and msgpack."""

    def __init__(self, context: zmq.Context, pub: str, replay: str, topic: bytes, rank: int = 0) -> None:
        self.rank = rank
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(pub)
        self.replay = context.socket(zmq.DEALER)  # one request, many replies: a REQ socket takes only one
        self.replay.connect(replay)
        self.next_seq = 0
        self.by_medium: dict[str, dict] = {"GPU": {}}
        """medium -> block hash -> (parent, token ids, salted): "GPU" the replica's pool, "CPU" / "DISK" its tiers."""
        self.num_replayed = 0
        self.num_gaps = 0
        self.num_removed = 0
        self.num_salted = 0
        self.payloads: list[bytes] = []
        self.drop_seqs: set[int] = set()
        """Live batches to throw away as if the network lost them."""

    @property
    def blocks(self) -> dict:
        """The replica's own pool (medium "GPU")."""
        return self.by_medium["GPU"]

    def close(self) -> None:
        self.sub.close(0)
        self.replay.close(0)

    def poll(self, timeout_s: float) -> int:
        """Receive live batches for up to ``timeout_s``; returns the number applied."""
        applied = 0
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not self.sub.poll(int(remaining * 1000)):
                break
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq in self.drop_seqs:
                self.drop_seqs.discard(seq)
                continue
            if seq > self.next_seq:  # a gap: fetch what was missed first
                self.num_gaps += 1
                self.fetch_replay(self.next_seq)
            if seq == self.next_seq:
                self.apply(payload)
                self.next_seq = seq + 1
                applied += 1
        return applied

    def fetch_replay(self, start_seq: int) -> None:
        self.replay.send_multipart([b"", start_seq.to_bytes(8, "big")])  # the empty frame a REQ socket would add
        while True:
            _empty, seq_bytes, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return
            if seq == self.next_seq:
                self.apply(payload)
                self.next_seq = seq + 1
                self.num_replayed += 1

    def apply(self, payload: bytes) -> None:
        self.payloads.append(payload)
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == self.rank
        for event in events:
            if event["type"] == "AllBlocksCleared":
                self.blocks.clear()  # vLLM's engine reset: its own pool
                continue
            blocks = self.by_medium.setdefault(event["medium"], {})
            if event["type"] == "BlockStored":
                size = event["block_size"]
                parent = event["parent_block_hash"]
                for i, block_hash in enumerate(event["block_hashes"]):
                    salted = bool(event.get("extra_keys") and event["extra_keys"][i])
                    self.num_salted += salted
                    blocks[block_hash] = (parent, tuple(event["token_ids"][i * size:(i + 1) * size]), salted)
                    parent = block_hash
            else:
                assert event["type"] == "BlockRemoved"
                for block_hash in event["block_hashes"]:
                    blocks.pop(block_hash, None)
                    self.num_removed += 1


@pytest.fixture(scope="module")
def tiny_llama():
    return TinyModel("llama")


def test_subscriber_replays_gaps_and_rebuilds_the_router_index(tiny_llama, tmp_path):
    engine = tiny_llama.engine(num_pages=12, max_num_batched_tokens=512, enforce_eager=True)
    fingerprint = engine.model_fingerprint
    pub, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"  # no port to race other tests for
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub, replay_endpoint=replay, topic="kv",
                            block_hash_format="bytes")
    publisher = ZmqKVEventPublisher(config, page_size=PAGE, rank=0)
    log = ReplicaEventLog("r0")
    index = PrefixIndex()
    context = zmq.Context()
    subscriber = None
    shared = random_prompt(2 * PAGE, seed=1)

    def serve(prompts: dict[str, tuple[list[int], str | None]]) -> None:
        """Run requests to completion, then do what the Serve replica does each stats period."""
        for request_id, (prompt, salt) in prompts.items():
            engine.add_request(EngineRequest(request_id, prompt, greedy(2), cache_salt=salt))
        while engine.has_work():
            engine.step()
        events = engine.kv.drain_events()
        publisher.publish(events)
        log.append(events)
        payload = log.stats_payload(engine.stats(), engine.kv.cached_keys)
        report = parse_routing_stats(payload)  # what the router's adapter does with it (router/ray_router.py)
        index.sync(report.replica_id, epoch=report.epoch, events=report.events, snapshot=report.snapshot)

    def wait_for(seq: int) -> None:
        deadline = time.monotonic() + 10
        while subscriber.next_seq <= seq and time.monotonic() < deadline:
            subscriber.poll(0.2)
        assert subscriber.next_seq > seq, f"batch {seq} never arrived"

    try:
        # batches 0 and 1 are published before anyone listens (a late joiner)
        serve({"a": (shared + random_prompt(PAGE + 10, seed=2), None)})
        serve({"b": (shared + random_prompt(PAGE + 10, seed=3), "tenant-1")})
        subscriber = Subscriber(context, pub, replay, b"kv")
        time.sleep(1.0)  # let the subscription reach the publisher (ZMQ drops what is published before it does)
        subscriber.drop_seqs = {3}  # batch 3 is "lost" on the way
        serve({"c": (shared + random_prompt(PAGE + 10, seed=4), None)})   # batch 2: prefix hit, one new page
        wait_for(2)  # the subscriber sees 2 first: replays 0..2
        serve({f"d{i}": (random_prompt(3 * PAGE, seed=10 + i), None) for i in range(3)})  # batch 3: evictions
        serve({"e": (shared + random_prompt(2 * PAGE, seed=5), None)})     # batch 4
        wait_for(4)
        assert subscriber.num_gaps == 2  # the late join (0, 1) and the lost batch 3
        assert subscriber.num_replayed == 5  # 0..2 at the first gap, 3..4 at the second
        assert publisher.num_published == 5

        # the subscriber's index is the router's: same keys for this replica, nothing more
        cached = set(engine.kv.cached_keys())
        assert set(subscriber.blocks) == cached
        assert index.num_keys("r0") == len(cached) and all(index.holds("r0", key) for key in cached)
        # every block re-hashes from its parent and token ids: the events carry the chain, not just names
        for block_hash, (parent, token_ids, salted) in subscriber.blocks.items():
            salt = "tenant-1" if salted else None
            assert hash_page(parent, token_ids, page_size=PAGE, model_fingerprint=fingerprint, salt=salt) == block_hash
        assert subscriber.num_removed > 0  # the small pool evicted pages: removals travelled too
        assert subscriber.num_salted == 1  # request b's page 0; the salt itself is never published
        assert not any(b"tenant-1" in payload for payload in subscriber.payloads)

        # reset: AllBlocksCleared empties both
        assert engine.reset_prefix_cache()
        serve({})
        wait_for(5)
        assert subscriber.blocks == {} and index.num_keys("r0") == 0
    finally:
        publisher.close()
        if subscriber is not None:
            subscriber.close()
        context.term()


def test_int_block_hashes_are_the_page_keys_low_64_bits():
    key = bytes(range(32))
    assert external_hash(key, "int") == int.from_bytes(bytes(range(24, 32)), "big")
    assert external_hash(key, "bytes") == key


# ---- the shared tiers' events (replica/tiers/events.py) -----------------------------------------------------------
class MediumSubscriber(Subscriber):
    """Also checks that a removal names a block the subscriber was told about (per medium)."""

    def apply(self, payload: bytes) -> None:
        _, events, _ = msgpack.unpackb(payload)
        for event in events:
            if event["type"] == "BlockRemoved":
                known = self.by_medium.get(event["medium"], {})
                assert all(h in known for h in event["block_hashes"]), "a removal of a block never announced"
        super().apply(payload)

    def blocks_on(self, medium: str) -> dict:
        return self.by_medium.get(medium, {})


def wait_until(condition, subscriber: Subscriber, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        subscriber.poll(0.1)
        if condition():
            return True
    return False


@pytest.fixture
def tier_events(tmp_path):
    """A publisher with a replay socket and a subscriber to it (``block_hash_format: bytes``: hashes are page keys)."""
    pub, replay = f"ipc://{tmp_path}/tier-events", f"ipc://{tmp_path}/tier-replay"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub, replay_endpoint=replay, topic="kv",
                            block_hash_format="bytes")
    publisher = ZmqKVEventPublisher(config, page_size=128, rank=0)
    context = zmq.Context()
    subscriber = MediumSubscriber(context, pub, replay, b"kv")
    time.sleep(1.0)  # let the subscription reach the publisher (ZMQ drops what is published before it does)
    yield publisher, subscriber
    publisher.close()
    subscriber.close()
    context.term()


def test_redis_tier_events_follow_redis_evictions_deletes_and_expiry(tier_events, redis_process_factory):
    """Redis evicts under maxmemory without telling its clients: the tier's events still end equal to what it holds."""
    from common.events import MEDIUM_HOST
    from replica.tiers.redis_tier import RedisTier
    from tests.test_tiers import make_format, make_pages

    publisher, subscriber = tier_events
    server = redis_process_factory()
    admin = redis.Redis.from_url(server.url)
    assert admin.config_get("notify-keyspace-events")["notify-keyspace-events"] == ""  # off, as Redis ships
    page_format = make_format()
    tier = RedisTier(server.url, page_format)
    tier.enable_events(publisher.publish_tier, resync_interval_s=3600)
    pages = [page for seed in range(6) for page in make_pages(page_format, 8, seed=seed)]  # 48 chained pages
    try:
        assert wait_until(lambda: set(admin.config_get("notify-keyspace-events")["notify-keyspace-events"])
                          >= set("Egxe"), subscriber, 5)  # the tier enabled the notifications it needs
        # room for ~20 of the 48 pages (each ~17 KB sealed): Redis evicts the rest as they arrive
        used = admin.info("memory")["used_memory"]
        admin.config_set("maxmemory", used + 20 * 17_000)

        def held() -> set[bytes]:
            return {page.key for page in pages if admin.exists(tier.redis_key(page.key))}

        def in_sync() -> bool:
            return set(subscriber.blocks_on(MEDIUM_HOST)) == held()

        for start in range(0, len(pages), 8):  # later stores evict pages announced earlier
            assert tier.store(pages[start:start + 8]) == 8
            tier.flush(timeout=10)
            assert wait_until(in_sync, subscriber), (start, len(subscriber.blocks_on(MEDIUM_HOST)), len(held()))
        assert 0 < len(held()) < len(pages) and subscriber.num_removed > 0  # evictions happened and were published
        # stored blocks carry the chain: parent key and token ids, as the tier stored them
        by_key = {page.key: page for page in pages}
        for block_hash, (parent, token_ids, _) in subscriber.blocks_on(MEDIUM_HOST).items():
            assert token_ids == by_key[block_hash].token_ids
        # a DEL by someone else, and an expiry
        survivors = sorted(held())
        admin.delete(tier.redis_key(survivors[0]))
        admin.pexpire(tier.redis_key(survivors[1]), 1)
        gone = set(survivors[:2])  # (Redis may evict another page meanwhile: its memory use moves)
        assert wait_until(lambda: in_sync() and not gone & held(), subscriber), (
            len(survivors), len(held()), len(subscriber.blocks_on(MEDIUM_HOST)), len(tier.event_tracker.announced),
            admin.config_get("notify-keyspace-events"), admin.exists(tier.redis_key(survivors[1])))
        assert publisher.num_dropped == 0
    finally:
        tier.close()
    assert tier.event_tracker._thread.is_alive() is False


def test_redis_tier_events_are_repaired_by_the_full_check_when_notifications_are_missed(tier_events,
                                                                                          redis_process_factory):
    """FLUSHALL makes no per-key notification: the periodic full check publishes the removals. Page 0 of a salted
    chain is announced with the salt's presence, as device blocks are."""
    from common.events import MEDIUM_HOST
    from replica.tiers.redis_tier import RedisTier
    from tests.test_tiers import make_format, make_pages

    publisher, subscriber = tier_events
    server = redis_process_factory()
    admin = redis.Redis.from_url(server.url)
    page_format = make_format()
    tier = RedisTier(server.url, page_format)
    tier.enable_events(publisher.publish_tier, resync_interval_s=0.5)
    pages = make_pages(page_format, 4, seed=1)
    pages[0] = dataclasses.replace(pages[0], salted=True)
    try:
        tier.store(pages)
        tier.flush(timeout=10)
        assert wait_until(lambda: len(subscriber.blocks_on(MEDIUM_HOST)) == 4, subscriber)
        assert [subscriber.blocks_on(MEDIUM_HOST)[page.key][2] for page in pages] == [True, False, False, False]
        admin.flushall()
        assert wait_until(lambda: len(subscriber.blocks_on(MEDIUM_HOST)) == 0, subscriber)
    finally:
        tier.close()


def test_disk_tier_events_follow_evictions_by_any_process_sharing_the_folder(tier_events, tmp_path):
    from replica.tiers.disk_tier import DiskTier
    from common.events import MEDIUM_DISK
    from replica.tiers.seal import TierKey
    from tests.test_tiers import make_format, make_pages

    publisher, subscriber = tier_events
    page_format = make_format()
    tier_key = TierKey.generate()
    root = tmp_path / "disk"
    page_bytes = 17_000
    ours = DiskTier(root, page_format, budget_bytes=12 * page_bytes, tier_key=tier_key)
    other = DiskTier(root, page_format, budget_bytes=12 * page_bytes, tier_key=tier_key)  # "another process"
    ours.enable_events(publisher.publish_tier, resync_interval_s=3600)
    mine = [page for seed in range(3) for page in make_pages(page_format, 4, seed=seed)]
    theirs = make_pages(page_format, 8, seed=50)
    try:
        def held() -> set[bytes]:
            return {page.key for page in mine if os.path.exists(ours.page_path(page.key))}

        def in_sync() -> bool:
            return set(subscriber.blocks_on(MEDIUM_DISK)) == held()

        ours.store(mine)
        ours.flush(timeout=10)
        assert wait_until(lambda: in_sync() and len(held()) > 0, subscriber)
        num_before = len(held())
        other.store(theirs)  # its writes evict our pages: only the shared index's removal log tells us
        other.flush(timeout=10)
        assert wait_until(lambda: in_sync() and len(held()) < num_before, subscriber), (
            len(subscriber.blocks_on(MEDIUM_DISK)), len(held()))
        assert subscriber.num_removed > 0 and not subscriber.blocks_on("CPU")
        assert publisher.num_dropped == 0
    finally:
        ours.close()
        other.close()


def test_engine_marks_page_0_of_a_salted_chain_for_the_tiers(tiny_llama):
    """The pages the engine hands to the tiers say whether their chain folds in a cache salt (page 0 only), so the
    tiers' events carry ("salted",) like the device events; the salt itself never leaves the engine."""
    engine = tiny_llama.engine(num_pages=12, max_num_batched_tokens=512, enforce_eager=True)
    records = []
    engine.page_sink = records.extend
    engine.add_request(EngineRequest("salted", random_prompt(2 * PAGE + 3, seed=7), greedy(1), cache_salt="t-1"))
    engine.add_request(EngineRequest("plain", random_prompt(2 * PAGE + 3, seed=8), greedy(1)))
    while engine.has_work():
        engine.step()
    salted_keys = engine.kv.cached_keys()
    assert len(records) == 4 and sum(record.salted for record in records) == 1
    first_salted = next(record for record in records if record.salted)
    assert first_salted.key in salted_keys and first_salted.token_ids == tuple(random_prompt(2 * PAGE + 3, seed=7)[:PAGE])


# ---- vLLM's engine-side timings (common/types.py RequestLatencyStats, rendered by cluster/vllm_metrics.py) ----------
def test_engine_observes_one_inter_token_interval_per_token_and_each_phase_per_request(tiny_llama):
    engine = tiny_llama.engine(num_pages=16, max_num_batched_tokens=512, enforce_eager=True, max_num_seqs=2)
    num_tokens = {"a": 5, "b": 3, "c": 1, "d": 4}  # max_num_seqs=2: c and d wait in the queue for a and b
    for index, (request_id, max_tokens) in enumerate(num_tokens.items()):
        engine.add_request(EngineRequest(request_id, random_prompt(PAGE + 20, seed=60 + index), greedy(max_tokens)))
    while engine.has_work():
        engine.step()
    latency = engine.stats().latency
    assert latency.inter_token.count == sum(n - 1 for n in num_tokens.values())  # per token, not per request
    assert latency.queue.count == latency.prefill.count == latency.decode.count == len(num_tokens)
    assert latency.time_per_output_token.count == sum(1 for n in num_tokens.values() if n > 1)
    assert latency.decode.total == pytest.approx(latency.inter_token.total)  # decode = the sum of the intervals
    assert latency.queue.total > 0  # c and d waited for a free slot
    stats_copy = engine.stats().latency
    stats_copy.inter_token.observe(1.0)
    assert engine.stats().latency.inter_token.count == latency.inter_token.count  # a snapshot, not the live one
