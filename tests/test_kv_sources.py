"""Cross-replica prefix reuse at the engine level (no Ray): the same greedy tokens and bit-identical KV whether a
prefix came from local pages, a peer replica, the Redis host tier, the Arrow disk tier or recompute; and every fault
(Redis down, a corrupt file, a stale entry, a dying peer) degrades to recompute with the output unchanged."""

import asyncio
import copy
import os
import time

import pytest
import torch

from engine_utils import TinyModel, greedy, random_prompt
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from common.types import CacheSource, EngineRequest
from replica.tiers.seal import TierKey


PREFIX_PAGES = 3
NUM_OUT = 5


@pytest.fixture(scope="module")
def tiny():
    return TinyModel("llama", seed=5)


class LocalPeerClient:
    """Peer copy between two engines in one process: the same export/import path the Serve replica uses, with the
    transport replaced by a direct call (the Ray transport is tested end to end in test_e2e_cross_replica)."""

    def __init__(self, peers: dict, fail: bool = False) -> None:
        self.peers = peers
        self.fail = fail
        self.num_calls = 0

    async def fetch(self, peer_id, keys):
        self.num_calls += 1
        if self.fail:
            raise ConnectionError(f"replica {peer_id} died")
        return await self.peers[peer_id].export_pages(list(keys))


TIER_KEY = TierKey.generate()  # the "cluster key" every engine of this module shares


def make_async_engine(tiny, replica_id, *, redis_url=None, disk_dir=None, peer_client=None, write_policy="all",
                      **engine_config):
    """An engine with the given sources (``engine_config``: EngineConfig fields, 32 pages unless given).
    ``write_policy="all"`` (every computed page written) keeps the fault tests independent of the write policy, which
    ``test_only_reused_pages_are_written`` checks."""
    engine = LLMEngine(EngineConfig(**{"num_pages": 32, **engine_config}, replica_id=replica_id),
                       copy.deepcopy(tiny.served))
    page_format = page_format_of(engine)
    tiers = build_tiers(page_format, redis_url=redis_url, disk_cache_dir=disk_dir, disk_budget_bytes=1 << 30,
                        tier_key=TIER_KEY, redis_timeout_s=10.0)  # a stalled box is not an outage (a stopped one is)
    fetcher = PrefixFetcher(page_format, tiers=tiers, peer_client=peer_client, own_replica_id=replica_id,
                            write_policy=write_policy)
    return AsyncEngine(engine, fetcher)


async def ask(async_engine, prompt, request_id, peer_hint=None):
    tokens, last = [], None
    request = EngineRequest(request_id, prompt, greedy(NUM_OUT), peer_hint=peer_hint)
    async for out in async_engine.generate(request):
        tokens.extend(out.new_token_ids)
        last = out
    return tokens, last.cached_tokens


def flush(async_engine):
    for tier in async_engine.fetcher.tiers:
        assert tier.flush(timeout=10)


def page_kv(async_engine, key):
    engine = async_engine.engine
    return engine.runner.read_page(engine.kv.cache.lookup(key)).clone()


@pytest.fixture
def prompts():
    prefix = random_prompt(PREFIX_PAGES * 128 + 20, seed=50)
    return prefix + random_prompt(30, seed=51), prefix + random_prompt(40, seed=52)


def test_every_source_gives_the_same_tokens_and_bit_identical_kv(tiny, prompts, redis_server, tmp_path):
    first, second = prompts
    holder = make_async_engine(tiny, "A", redis_url=redis_server, disk_dir=str(tmp_path / "disk"))
    peers = {"A": holder}
    via_peer = make_async_engine(tiny, "B", peer_client=LocalPeerClient(peers))
    via_host = make_async_engine(tiny, "C", redis_url=redis_server)
    via_disk = make_async_engine(tiny, "D", disk_dir=str(tmp_path / "disk"))
    recompute = make_async_engine(tiny, "E")
    engines = [holder, via_peer, via_host, via_disk, recompute]
    try:
        async def scenario():
            tokens, cached = await ask(holder, first, "a1")
            assert cached.total == 0
            assert tokens == tiny.generate(first, NUM_OUT)
            flush(holder)
            results = {
                "local": await ask(holder, second, "a2"),
                "peer": await ask(via_peer, second, "b", peer_hint="A"),
                "host": await ask(via_host, second, "c"),
                "disk": await ask(via_disk, second, "d"),
                "recompute": await ask(recompute, second, "e"),
            }
            return results

        results = asyncio.run(scenario())
        expected = tiny.generate(second, NUM_OUT)
        for source, (tokens, cached) in results.items():
            assert tokens == expected, source
            if source != "recompute":
                assert cached.as_dict()[source] == PREFIX_PAGES * 128, source
                assert cached.total == PREFIX_PAGES * 128, source
            else:
                assert cached.total == 0
        keys = holder.engine.page_keys(second)[:PREFIX_PAGES]
        for engine in (via_peer, via_host, via_disk):
            for key in keys:
                assert torch.equal(page_kv(engine, key), page_kv(holder, key))
        # recompute gives the same page contents up to float rounding of a different batch shape
        for key in keys:
            torch.testing.assert_close(page_kv(recompute, key), page_kv(holder, key), rtol=0, atol=1e-5)
        sources = via_peer.fetcher.source_to_stats
        assert (sources[CacheSource.PEER].pages, sources[CacheSource.PEER].errors) == (PREFIX_PAGES, 0)
        assert via_host.fetcher.source_to_stats[CacheSource.HOST].pages == PREFIX_PAGES
        assert via_disk.fetcher.source_to_stats[CacheSource.DISK].pages == PREFIX_PAGES
    finally:
        for engine in engines:
            engine.shutdown()


def test_peer_dying_during_copy_falls_back_to_the_shared_tier(tiny, prompts, redis_server):
    first, second = prompts
    holder = make_async_engine(tiny, "A", redis_url=redis_server[:-1] + "1")
    client = LocalPeerClient({"A": holder}, fail=True)
    other = make_async_engine(tiny, "B", redis_url=redis_server[:-1] + "1", peer_client=client)
    try:
        async def scenario():
            await ask(holder, first, "a")
            flush(holder)
            return await ask(other, second, "b", peer_hint="A")

        tokens, cached = asyncio.run(scenario())
        assert client.num_calls == 1
        assert tokens == tiny.generate(second, NUM_OUT)
        assert cached.as_dict() == {"local": 0, "peer": 0, "host": PREFIX_PAGES * 128, "disk": 0}
        assert other.fetcher.source_to_stats[CacheSource.PEER].errors == 1
    finally:
        holder.shutdown()
        other.shutdown()


def test_redis_down_mid_run_recomputes_and_recovers(tiny, prompts, redis_process_factory):
    first, second = prompts
    server = redis_process_factory()
    holder = make_async_engine(tiny, "A", redis_url=server.url)
    reader = make_async_engine(tiny, "B", redis_url=server.url)
    try:
        async def before_outage():
            await ask(holder, first, "a")
            flush(holder)

        asyncio.run(before_outage())
        server.stop()
        tokens, cached = asyncio.run(ask(reader, second, "b"))
        assert tokens == tiny.generate(second, NUM_OUT) and cached.total == 0
        assert not reader.fetcher.tiers[0].available
        # Redis returns (empty: it kept nothing); a fresh holder writes again and the reader recovers
        server.start()
        third = second[:-1] + [7]
        holder2 = make_async_engine(tiny, "C", redis_url=server.url)
        try:
            async def after_outage():
                await ask(holder2, first, "c")
                flush(holder2)
                await asyncio.sleep(2.5)  # past the tier's reconnect backoff
                assert await reader.reset_prefix_cache()  # it computed the prefix itself during the outage
                return await ask(reader, third, "d")

            tokens, cached = asyncio.run(after_outage())
        finally:
            holder2.shutdown()
        assert tokens == tiny.generate(third, NUM_OUT)
        assert cached.host == PREFIX_PAGES * 128
    finally:
        holder.shutdown()
        reader.shutdown()


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "flip_one_bit"])
def test_damaged_disk_page_is_discarded_and_recomputed(tiny, prompts, tmp_path, damage):
    first, second = prompts
    disk = str(tmp_path / "disk")
    holder = make_async_engine(tiny, "A", disk_dir=disk)
    reader = make_async_engine(tiny, "B", disk_dir=disk)
    try:
        asyncio.run(ask(holder, first, "a"))
        flush(holder)
        key = holder.engine.page_keys(first)[1]  # damage the second page: the first still comes from disk
        path = holder.fetcher.tiers[0].page_path(key)
        size = os.path.getsize(path)
        with open(path, "r+b") as handle:
            if damage == "truncate":
                handle.truncate(size // 2)
            elif damage == "flip_one_bit":  # tampering inside the sealed KV: only the AES-GCM tag notices
                handle.seek(size // 2)
                byte = handle.read(1)[0]
                handle.seek(size // 2)
                handle.write(bytes([byte ^ 0x01]))
            else:
                handle.seek(size // 2)
                handle.write(bytes(64))
        tokens, cached = asyncio.run(ask(reader, second, "b"))
        assert tokens == tiny.generate(second, NUM_OUT)
        assert cached.disk == 128
        assert reader.fetcher.tiers[0].stats().discarded_corrupt == 1
        # the reader recomputed the page and wrote a whole file again: a third replica reads all pages from disk
        flush(reader)
        third = make_async_engine(tiny, "C", disk_dir=disk)
        try:
            tokens, cached = asyncio.run(ask(third, second, "c"))
        finally:
            third.shutdown()
        assert tokens == tiny.generate(second, NUM_OUT) and cached.disk == PREFIX_PAGES * 128
    finally:
        holder.shutdown()
        reader.shutdown()


def test_redis_entry_with_other_tokens_is_discarded(tiny, prompts, redis_server):
    import redis as redis_client

    first, second = prompts
    url = redis_server
    holder = make_async_engine(tiny, "A", redis_url=url)
    reader = make_async_engine(tiny, "B", redis_url=url)
    try:
        async def store():
            await ask(holder, first + [1], "a")  # a different salt-free prompt: its own first key
            flush(holder)

        asyncio.run(store())
        tier = holder.fetcher.tiers[0]
        # plant the stored bytes of page 0 of `first + [1]` under the key of page 0 of a prompt with other tokens
        other = random_prompt(PREFIX_PAGES * 128 + 20, seed=99)
        client = redis_client.Redis.from_url(url)
        source_key = tier.redis_key(holder.engine.page_keys(first)[0])
        planted = client.get(source_key)
        target = tier.redis_key(holder.engine.page_keys(other)[0])
        client.set(target, planted)
        tokens, cached = asyncio.run(ask(reader, other, "b"))
        assert tokens == tiny.generate(other, NUM_OUT)
        assert cached.total == 0
        assert reader.fetcher.tiers[0].stats().discarded_corrupt == 1
        flush(reader)  # the recomputed page replaced the planted entry
        assert client.get(target) not in (None, planted)
    finally:
        holder.shutdown()
        reader.shutdown()


def test_only_reused_pages_are_written(tiny, prompts, tmp_path, redis_server):
    """Default policy: a page computed once is not written; a local hit (second use) writes the reused pages, once;
    a reader on another replica then gets them from each tier with the same greedy output."""
    first, second = prompts
    disk = str(tmp_path / "disk")
    redis_url = redis_server[:-1] + "5"
    holder = make_async_engine(tiny, "A", redis_url=redis_url, disk_dir=disk, write_policy="reused")
    readers = [make_async_engine(tiny, "B", redis_url=redis_url), make_async_engine(tiny, "C", disk_dir=disk)]
    try:
        host, disk_tier = holder.fetcher.tiers
        asyncio.run(ask(holder, first, "a1"))
        flush(holder)
        assert host.stats().pages_stored == disk_tier.stats().pages_stored == 0  # used once: nothing written
        assert not os.path.exists(os.path.join(disk, "bfloat16")) and not os.path.exists(os.path.join(disk, "float32"))

        asyncio.run(ask(holder, second, "a2"))  # reuses the 3 prefix pages from the local cache
        flush(holder)
        assert host.stats().pages_stored == disk_tier.stats().pages_stored == PREFIX_PAGES
        asyncio.run(ask(holder, second, "a3"))  # reused again within rewrite_after_s: not written again
        flush(holder)
        assert host.stats().pages_stored == disk_tier.stats().pages_stored == PREFIX_PAGES
        keys = holder.engine.page_keys(second)[:PREFIX_PAGES]
        assert host.lookup(keys) == disk_tier.lookup(keys) == PREFIX_PAGES

        expected = tiny.generate(second, NUM_OUT)
        for reader, source in zip(readers, ("host", "disk")):
            tokens, cached = asyncio.run(ask(reader, second, "r"))
            assert tokens == expected, source
            assert cached.as_dict()[source] == PREFIX_PAGES * 128, source
    finally:
        holder.shutdown()
        for reader in readers:
            reader.shutdown()


def test_pages_copied_from_a_peer_are_written(tiny, prompts, tmp_path):
    first, second = prompts
    holder = make_async_engine(tiny, "A", write_policy="reused")
    copier = make_async_engine(tiny, "B", disk_dir=str(tmp_path / "disk"), peer_client=LocalPeerClient({"A": holder}),
                               write_policy="reused")
    try:
        asyncio.run(ask(holder, first, "a"))
        tokens, cached = asyncio.run(ask(copier, second, "b", peer_hint="A"))
        assert tokens == tiny.generate(second, NUM_OUT) and cached.peer == PREFIX_PAGES * 128
        flush(copier)
        tier = copier.fetcher.tiers[0]
        assert tier.stats().pages_stored == PREFIX_PAGES  # the peer pages; not the request's own computed tail
        assert tier.lookup(holder.engine.page_keys(second)) == PREFIX_PAGES
    finally:
        holder.shutdown()
        copier.shutdown()


def test_pages_copied_from_a_peer_are_written_after_the_first_token(tiny, prompts, tmp_path):
    """Sealing and sending the copied pages would take CPU from the prefill that waits for them: the fetch defers
    the write, and the request starts it once its first token is out."""
    first, second = prompts
    holder = make_async_engine(tiny, "A", write_policy="reused")
    copier = make_async_engine(tiny, "B", disk_dir=str(tmp_path / "disk"), peer_client=LocalPeerClient({"A": holder}),
                               write_policy="reused")
    store = copier.fetcher._store_in_background
    first_token_at_store = []

    def recording_store(pages, parent_key, chain):
        tracked = copier.engine._tracked.get("b")
        if tracked is not None:
            first_token_at_store.append(tracked.first_token_at)
        else:  # not queued yet (a store too early), or finished already (its last token came before the store ran)
            first_token_at_store.append(1.0 if copier.engine.num_requests_finished else None)
        return store(pages, parent_key, chain)

    copier.fetcher._store_in_background = recording_store
    try:
        asyncio.run(ask(holder, first, "a"))
        tokens, cached = asyncio.run(ask(copier, second, "b", peer_hint="A"))
        assert tokens == tiny.generate(second, NUM_OUT) and cached.peer == PREFIX_PAGES * 128
        assert len(first_token_at_store) == 1 and first_token_at_store[0] > 0  # once, after the first token
        deadline = time.monotonic() + 10
        while copier.fetcher._background and time.monotonic() < deadline:
            time.sleep(0.01)
        flush(copier)
        assert copier.fetcher.tiers[0].stats().pages_stored == PREFIX_PAGES

        # the fetcher on its own: with ``defer_store`` nothing is written until the caller runs what it was given
        third = second[: PREFIX_PAGES * 128]
        later: list = []
        tiers = build_tiers(copier.fetcher.page_format, redis_url=None, disk_cache_dir=str(tmp_path / "disk2"),
                            disk_budget_bytes=1 << 30, tier_key=TIER_KEY)
        fetcher = PrefixFetcher(copier.fetcher.page_format, tiers=tiers, peer_client=LocalPeerClient({"A": holder}),
                                own_replica_id="C")
        keys = holder.engine.page_keys(third)
        tokens_per_page = [third[i * 128:(i + 1) * 128] for i in range(PREFIX_PAGES)]

        async def fetch_then_store():
            pages = await fetcher.fetch(keys, tokens_per_page, peer_hint="A", defer_store=later)
            stored_before = fetcher.tiers[0].stats().pages_stored
            assert len(later) == 1
            later.pop()()
            await asyncio.gather(*fetcher._background)
            return pages, stored_before

        pages, stored_before = asyncio.run(fetch_then_store())
        assert len(pages) == PREFIX_PAGES and stored_before == 0
        assert tiers[0].flush(timeout=10)
        assert tiers[0].stats().pages_stored == PREFIX_PAGES
        fetcher.close()
    finally:
        holder.shutdown()
        copier.shutdown()


def test_a_tier_load_that_raises_is_a_counted_miss_and_keeps_the_fetch_going():
    """A tier whose load raises (a bug, or its executor shut down) is a miss like any other fault: ``fetch`` does not
    raise, and counts one error per failed attempt, also when two loads overlap."""
    import threading

    from common.page_format import PageFormat
    from common.types import TierStats
    from replica.tiers.base import KVTier

    fmt = PageFormat(model_fingerprint="fp", dtype="float32", page_size=128, num_layers=1, num_kv_heads=1,
                             head_dim=4)

    class FaultyTier(KVTier):
        source = CacheSource.DISK
        available = True
        page_format = fmt

        def __init__(self, raise_error: bool):
            self.raise_error = raise_error
            self.errors = 0
            self.barrier = threading.Barrier(2)

        def lookup(self, keys):
            return 0

        def load(self, keys, token_ids_per_page):
            if self.raise_error:
                raise RuntimeError("tier bug")
            self.barrier.wait()  # two loads under way; each meets one error of its own
            self.errors += 1
            self.barrier.wait()
            return []

        def store(self, pages):
            return 0

        def flush(self, timeout=None):
            return True

        def close(self, timeout=5.0):
            pass

        def stats(self):
            return TierStats(errors=self.errors)

    keys, tokens = [b"k" * 32], [list(range(128))]

    async def fetch_twice(fetcher):
        return await asyncio.gather(fetcher.fetch(keys, tokens), fetcher.fetch(keys, tokens))

    raising = PrefixFetcher(fmt, tiers=[FaultyTier(raise_error=True)])
    assert asyncio.run(fetch_twice(raising)) == [[], []]
    assert raising.source_to_stats[CacheSource.DISK].errors == 2
    overlapping = PrefixFetcher(fmt, tiers=[FaultyTier(raise_error=False)])
    assert asyncio.run(fetch_twice(overlapping)) == [[], []]
    assert overlapping.source_to_stats[CacheSource.DISK].errors == 2  # not 4: each attempt counts once
    raising.close()
    overlapping.close()
