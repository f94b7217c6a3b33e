"""Cross-replica prefix reuse at the engine level (no Ray): the same greedy tokens and bit-identical KV whether a
prefix came from local pages, a peer replica, the Redis host tier, the Arrow disk tier or recompute; and every fault
(Redis down, a corrupt file, a stale entry, a dying peer) degrades to recompute with the output unchanged."""

import asyncio
import copy
import dataclasses
import os
import threading
import time

import pytest
import torch

from engine_utils import TinyModel, greedy, random_prompt
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from replica.landing import LandingPages
from replica.shared_pool import PoolReader
from common.types import CacheSource, EngineRequest, TierStats
from replica.tiers.base import KVTier
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
    the write, and the request starts it once its first token is out, and only once its caller has taken that token
    (before, it held the token back by starting a worker thread and sharing the GIL with it)."""
    first, second = prompts
    holder = make_async_engine(tiny, "A", write_policy="reused")
    copier = make_async_engine(tiny, "B", disk_dir=str(tmp_path / "disk"), peer_client=LocalPeerClient({"A": holder}),
                               write_policy="reused")
    store = copier.fetcher._store_in_background
    first_token_at_store = []
    caller_had_it_at_store = []
    caller_has_first = []

    def recording_store(pages, parent_key, chain):
        caller_had_it_at_store.append(bool(caller_has_first))
        tracked = copier.engine._tracked.get("b")
        if tracked is not None:
            first_token_at_store.append(tracked.first_token_at)
        else:  # not queued yet (a store too early), or finished already (its last token came before the store ran)
            first_token_at_store.append(1.0 if copier.engine.num_requests_finished else None)
        return store(pages, parent_key, chain)

    copier.fetcher._store_in_background = recording_store
    try:
        asyncio.run(ask(holder, first, "a"))

        async def ask_and_note_the_first_output():
            tokens, last = [], None
            request = EngineRequest("b", second, greedy(NUM_OUT), peer_hint="A")
            async for out in copier.generate(request):
                caller_has_first.append(True)
                tokens.extend(out.new_token_ids)
                last = out
            return tokens, last.cached_tokens

        tokens, cached = asyncio.run(ask_and_note_the_first_output())
        assert tokens == tiny.generate(second, NUM_OUT) and cached.peer == PREFIX_PAGES * 128
        assert len(first_token_at_store) == 1 and first_token_at_store[0] > 0  # once, after the first token
        assert caller_had_it_at_store == [True]  # ... which the caller had taken
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


class StubTier(KVTier):
    """A tier that stores nothing; a test gives it ``load`` (and ``errors``, which ``stats`` reports)."""

    available = True
    errors = 0

    def lookup(self, keys):
        return 0

    def store(self, pages):
        return 0

    def flush(self, timeout=None):
        return True

    def close(self, timeout=5.0):
        pass

    def stats(self):
        return TierStats(errors=self.errors)


def test_a_tier_load_that_raises_is_a_counted_miss_and_keeps_the_fetch_going():
    """A tier whose load raises (a bug, or its executor shut down) is a miss like any other fault: ``fetch`` does not
    raise, and counts one error per failed attempt, also when two loads overlap."""
    import threading

    from common.page_format import PageFormat

    fmt = PageFormat(model_fingerprint="fp", dtype="float32", page_size=128, num_layers=1, num_kv_heads=1,
                             head_dim=4)

    class FaultyTier(StubTier):
        source = CacheSource.DISK
        page_format = fmt

        def __init__(self, raise_error: bool):
            self.raise_error = raise_error
            self.errors = 0
            self.barrier = threading.Barrier(2)

        def load(self, keys, token_ids_per_page):
            if self.raise_error:
                raise RuntimeError("tier bug")
            self.barrier.wait()  # two loads under way; each meets one error of its own
            self.errors += 1
            self.barrier.wait()
            return []

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


class CountingWrites:
    """Wraps a runner's ``write_page``: the pages copied into the pool (a landing page is never copied)."""

    def __init__(self, runner):
        self.page_ids = []
        self._write = runner.write_page
        runner.write_page = self

    def __call__(self, page_id, kv):
        self.page_ids.append(page_id)
        self._write(page_id, kv)


def reserved_pages(async_engine):
    """Spy on ``reserve_landing``: the page ids of each reservation, in order."""
    engine = async_engine.engine
    reserve, calls = engine.reserve_landing, []

    def spy(num_pages, keep=()):
        calls.append(reserve(num_pages, keep))
        return calls[-1]

    engine.reserve_landing = spy
    return calls


def wait_for_no_pages_in_use(async_engine):
    """The fetch's references go back on the engine thread once it is unregistered: a moment after the output."""
    deadline = time.monotonic() + 10
    while async_engine.engine.kv.num_pages_in_use and time.monotonic() < deadline:
        time.sleep(0.01)
    asyncio.run(async_engine.check_integrity())
    assert async_engine.engine.kv.num_pages_in_use == 0


def read_what_the_holder_stored(holder, reader, first, second):
    """The holder computes ``first`` and flushes its tier writes; the reader then serves ``second`` (the same prefix)
    while its pool writes and landing reservations are counted: (writes, reservations, tokens, cached tokens)."""
    asyncio.run(ask(holder, first, "a"))
    flush(holder)
    writes = CountingWrites(reader.engine.runner)
    reservations = reserved_pages(reader)
    tokens, cached = asyncio.run(ask(reader, second, "b"))
    return writes, reservations, tokens, cached


def assert_adopted_landing_pages(holder, reader, prompt, writes, reservations):
    """The reader reserved the prefix's pages once, wrote none into its pool, caches the prefix in the reserved pages
    with the holder's KV, and has every reference back. Returns the prefix's keys."""
    assert len(reservations) == 1 and len(reservations[0]) == PREFIX_PAGES
    assert writes.page_ids == []
    keys = reader.engine.page_keys(prompt)[:PREFIX_PAGES]
    assert [reader.engine.kv.cache.lookup(key) for key in keys] == reservations[0]
    for key in keys:
        assert torch.equal(page_kv(reader, key), page_kv(holder, key))
    wait_for_no_pages_in_use(reader)
    return keys


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tier_pages_are_decrypted_into_pool_pages_that_the_request_adopts(tiny, prompts, tmp_path, redis_server, tier):
    """A request whose prefix is in a shared tier (no peer): the engine reserves pool pages as it plans the fetch,
    the tier decrypts into them, and the request puts them in its page table: no copy into the pool, the same tokens,
    bit-identical KV, and every reference back once it is done."""
    first, second = prompts
    sources = {"redis_url": redis_server} if tier == "host" else {"disk_dir": str(tmp_path / "disk")}
    holder = make_async_engine(tiny, "A", **sources)
    reader = make_async_engine(tiny, "B", **sources)
    try:
        writes, reservations, tokens, cached = read_what_the_holder_stored(holder, reader, first, second)
        assert tokens == tiny.generate(second, NUM_OUT)
        assert cached.as_dict()[tier] == PREFIX_PAGES * 128
        assert_adopted_landing_pages(holder, reader, second, writes, reservations)
    finally:
        holder.shutdown()
        reader.shutdown()


def test_with_too_few_free_pages_a_tier_load_lands_in_its_own_tensors(tiny, prompts, tmp_path):
    """``reserve_landing`` takes at most half of the free pages: a fetch that needs more loads into tensors of its
    own, copied into the pool at admission as before. Same tokens."""
    first, second = prompts
    disk = str(tmp_path / "disk")
    holder = make_async_engine(tiny, "A", disk_dir=disk)
    reader = make_async_engine(tiny, "B", disk_dir=disk, num_pages=5)  # 2 of 5 free pages may land, 3 are needed
    try:
        writes, reservations, tokens, cached = read_what_the_holder_stored(holder, reader, first, second)
        assert tokens == tiny.generate(second, NUM_OUT) and cached.disk == PREFIX_PAGES * 128
        assert all(page_ids == [] for page_ids in reservations) and len(writes.page_ids) == PREFIX_PAGES
        wait_for_no_pages_in_use(reader)
    finally:
        holder.shutdown()
        reader.shutdown()


def test_landing_pages_of_a_queued_request_go_back_when_it_is_aborted_or_its_local_hit_grew(tiny, prompts):
    """At the engine: records on landing pages held by queued requests. One request is aborted while queued (its
    references go back); another finds its prefix cached by the time it is admitted (the records are not used, the
    references go back); a third adopts them. Every reference accounted for at each point."""
    first, second = prompts
    holder = LLMEngine(EngineConfig(num_pages=32, replica_id="A"), copy.deepcopy(tiny.served))
    engine = LLMEngine(EngineConfig(num_pages=32, replica_id="B"), copy.deepcopy(tiny.served))
    holder.add_request(EngineRequest("h", first, greedy(1)))
    while holder.has_work():
        holder.step()
    keys = holder.page_keys(second)[:PREFIX_PAGES]
    exported = holder.export_pages(keys)

    def landed(tag):
        page_ids = engine.reserve_landing(PREFIX_PAGES)
        assert len(page_ids) == PREFIX_PAGES
        for page_id, page in zip(page_ids, exported):
            engine.runner.write_page(page_id, page.kv)  # what the tier load does
        records = [dataclasses.replace(page, source=CacheSource.DISK, landing_page=page_id)
                   for page, page_id in zip(exported, page_ids)]
        plan = engine.plan(EngineRequest(tag, second, greedy(NUM_OUT)))
        assert plan.missing.start == 0
        return plan, records, page_ids

    plan, records, page_ids = landed("aborted")
    engine.add(plan, records)
    engine.kv.release(page_ids)  # the fetch's own references go back: the queued request holds one each
    engine.check_integrity()
    assert engine.kv.num_pages_in_use == PREFIX_PAGES
    engine.abort("aborted")
    engine.check_integrity()
    assert engine.kv.num_pages_in_use == 0

    plan, records, page_ids = landed("adopts")
    engine.add(plan, records)
    engine.check_integrity([page_ids])  # the fetch's references count while it still holds them
    engine.kv.release(page_ids)
    late_plan, late_records, late_ids = landed("hit-grew")  # planned before "adopts" cached the prefix
    engine.add(late_plan, late_records)
    engine.kv.release(late_ids)
    writes = CountingWrites(engine.runner)
    outputs = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.cached_tokens.disk == (PREFIX_PAGES * 128 if out.request_id == "adopts" else 0)
        engine.check_integrity()
    expected = tiny.generate(second, NUM_OUT)
    assert outputs == {"adopts": expected, "hit-grew": expected}
    assert writes.page_ids == []
    assert [engine.kv.cache.lookup(key) for key in keys] == page_ids
    assert engine.kv.num_pages_in_use == 0
    assert all(engine.kv.pool.is_free(page_id) for page_id in late_ids)


def test_a_tier_load_that_times_out_keeps_its_landing_pages_until_its_thread_returns():
    """A load past ``tier_timeout_s`` goes on writing into the pages it was given: the fetch's next tier does not get
    them, and they go back only once the late load has returned."""
    from common.page_format import PageFormat

    fmt = PageFormat(model_fingerprint="fp", dtype="float32", page_size=128, num_layers=1, num_kv_heads=1,
                     head_dim=4)
    go_on = threading.Event()

    class Tier(StubTier):
        page_format = fmt

        def __init__(self, source, stall):
            self.source, self.stall, self.outs = source, stall, []

        def load(self, keys, token_ids_per_page, out=None):
            self.outs.append(out)
            if self.stall:
                go_on.wait(10)
                for tensor in out:
                    tensor.fill_(-1.0)  # late writes: nobody may be using these pages any more
                return []
            return [torch.ones(fmt.kv_shape) for _ in keys]

    slow, fast = Tier(CacheSource.HOST, stall=True), Tier(CacheSource.DISK, stall=False)
    fetcher = PrefixFetcher(fmt, tiers=[slow, fast], tier_timeout_s=0.2)
    released = []
    views = [torch.zeros(fmt.kv_shape) for _ in range(2)]
    landing = LandingPages([5, 8], views, lambda pages: released.append(pages.page_ids))
    keys, tokens = [b"a" * 32, b"b" * 32], [list(range(128)), list(range(128, 256))]
    try:
        pages = asyncio.run(fetcher.fetch(keys, tokens, landing=landing))
        assert slow.outs == [views] and fast.outs == [None]  # the second tier loads into tensors of its own
        assert [page.landing_page for page in pages] == [None, None] and len(pages) == 2
        landing.drop()
        assert released == []  # the stalled load may still write
        go_on.set()
        deadline = time.monotonic() + 10
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert released == [[5, 8]]
    finally:
        go_on.set()
        fetcher.close()


def test_a_plan_holds_landing_pages_it_took_from_a_queued_request_that_then_goes_away(tiny, tmp_path):
    """Pages on their way can come from a queued request's records (``pending``): a later request with a longer
    prompt takes r1's three landing pages and fetches two more. r1 is aborted while that fetch runs: the plan's own
    references keep the pages, so the later request still gets the right KV. Every reference accounted for."""
    disk = str(tmp_path / "disk")
    holder = make_async_engine(tiny, "A", disk_dir=disk)
    reader = make_async_engine(tiny, "B", disk_dir=disk, max_num_seqs=1)
    long_prompt = random_prompt(5 * 128 + 30, seed=60)
    short_prompt = long_prompt[: 3 * 128] + random_prompt(25, seed=61)
    tier = reader.fetcher.tiers[0]
    load, gate = tier.load, threading.Event()

    def gated_load(keys, token_ids_per_page, out=None):
        if len(keys) == 2:  # the later request's own fetch
            gate.wait(30)
        return load(keys, token_ids_per_page, out)

    async def waiting():
        return await reader._call(lambda: [(seq.request_id, len(seq.fetched))
                                           for seq in reader.engine.scheduler.waiting])

    async def until(condition):
        for _ in range(3000):
            if await condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def scenario():
        await ask(holder, long_prompt, "h")
        flush(holder)
        tier.load = gated_load
        # the blocker runs until the checks below are done (cancelled then): one that ended by itself on a fast box
        # let r1 be admitted before it was aborted, so r2 found r1's pages cached locally
        blocker = asyncio.ensure_future(collect(reader, random_prompt(40, seed=62), "blocker", 2000))
        await until(lambda: reader._call(lambda: len(reader.engine.scheduler.running) == 1))
        r1 = asyncio.ensure_future(ask(reader, short_prompt, "r1"))
        await until(lambda: _eq(waiting(), [("r1", 3)]))
        r2 = asyncio.ensure_future(ask(reader, long_prompt, "r2"))
        await until(lambda: reader._call(lambda: len(reader._holds) == 1))
        r1.cancel()
        await until(lambda: _eq(waiting(), []))
        await reader._call(spoil_free_pages)  # a page r2 did not hold would now hold garbage
        await reader.check_integrity()
        held = await reader._call(lambda: list(reader._holds.values()))
        assert len(held) == 1 and len(held[0]) == 3
        blocker.cancel()
        gate.set()
        tokens, cached = await r2
        await asyncio.gather(blocker, return_exceptions=True)
        return tokens, cached

    def spoil_free_pages():
        kv = reader.engine.kv
        for page_id in range(kv.num_pages):
            if kv.pool.is_free(page_id):
                reader.engine.runner.kv_cache[:, :, page_id].fill_(float("nan"))

    async def _eq(awaitable, expected):
        return await awaitable == expected

    try:
        tokens, cached = asyncio.run(scenario())
        assert tokens == tiny.generate(long_prompt, NUM_OUT)
        assert cached.disk == 5 * 128
        wait_for_no_pages_in_use(reader)
        assert reader._holds == {}
    finally:
        gate.set()
        holder.shutdown()
        reader.shutdown()


async def collect(async_engine, prompt, request_id, num_out):
    tokens = []
    async for out in async_engine.generate(EngineRequest(request_id, prompt, greedy(num_out))):
        tokens.extend(out.new_token_ids)
    return tokens


def test_reserving_landing_pages_keeps_the_request_s_local_hit_and_half_of_the_free_pages(tiny):
    """``reserve_landing`` never evicts the request's own local hit, and takes pages only while they are at most half
    of what is free once that hit is set aside (none otherwise: the fetch then loads into tensors of its own)."""
    engine = LLMEngine(EngineConfig(num_pages=10, replica_id="A"), copy.deepcopy(tiny.served))
    prompt = random_prompt(6 * 128 + 10, seed=70)
    for request_id, tokens in (("warm", prompt), ("other", random_prompt(3 * 128 + 10, seed=71))):
        engine.add_request(EngineRequest(request_id, tokens, greedy(1)))  # "other" is cached after "warm": the
        while engine.has_work():  # least recently used pages are the hit's
            engine.step()
    keys = engine.page_keys(prompt)[:6]
    hit = engine.kv.match_prefix(keys)
    assert len(hit) == 6 and engine.kv.num_free_pages == 10
    assert engine.reserve_landing(3, keys) == []  # 4 free beside the hit: 3 > 4 // 2
    assert engine.kv.match_prefix(keys) == hit and engine.kv.num_pages_in_use == 0
    reserved = engine.reserve_landing(2, keys)  # from the free page and "other"'s, never the hit's
    assert len(reserved) == 2 and not set(reserved) & set(hit)
    assert engine.kv.match_prefix(keys) == hit
    engine.check_integrity([reserved])
    engine.kv.release(reserved)
    engine.check_integrity()
    assert engine.kv.num_pages_in_use == 0


def test_landing_pages_held_by_queued_requests_go_back_when_the_head_of_the_queue_needs_them(tiny, prompts):
    """Queued requests hold their landing pages until admitted; the request at the head of the queue may need more
    pages than they leave free, with nothing running to free any. The scheduler then takes them back (their KV copied
    into tensors of their own, imported later as before) instead of waiting forever; both requests get their tokens."""
    first, second = prompts
    holder = LLMEngine(EngineConfig(num_pages=32, replica_id="A"), copy.deepcopy(tiny.served))
    holder.add_request(EngineRequest("h", first, greedy(1)))
    while holder.has_work():
        holder.step()
    exported = holder.export_pages(holder.page_keys(second)[:PREFIX_PAGES])
    engine = LLMEngine(EngineConfig(num_pages=8, replica_id="B"), copy.deepcopy(tiny.served))
    cold = random_prompt(6 * 128 + 10, seed=75)  # 7 pages: fits the pool, not beside 3 landing pages
    engine.add(engine.plan(EngineRequest("cold", cold, greedy(NUM_OUT))))
    page_ids = engine.reserve_landing(PREFIX_PAGES)
    assert len(page_ids) == PREFIX_PAGES
    for page_id, page in zip(page_ids, exported):
        engine.runner.write_page(page_id, page.kv)
    records = [dataclasses.replace(page, source=CacheSource.DISK, landing_page=page_id)
               for page, page_id in zip(exported, page_ids)]
    engine.add(engine.plan(EngineRequest("warm", second, greedy(NUM_OUT))), records)
    engine.kv.release(page_ids)  # the fetch is done with them
    outputs = {}
    for _ in range(200):
        if not engine.has_work():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    assert not engine.has_work(), "the queue is stuck"
    assert outputs == {"cold": tiny.generate(cold, NUM_OUT), "warm": tiny.generate(second, NUM_OUT)}
    assert engine.scheduler.num_landing_pages_detached == PREFIX_PAGES
    assert engine.kv.num_pages_in_use == 0


class SameNodePeerClient(LocalPeerClient):
    """The same-node transport without Ray: the holder names its pages in its pool's shared memory (``share_pages``)
    and the reader copies them out with ``PoolReader``, into landing pages when given some (what ``ServePeerClient``
    does once it knows the holder's export socket)."""

    def __init__(self, peers: dict) -> None:
        super().__init__(peers)
        self.reader = PoolReader()

    def copies_into_pool(self, peer_id):
        return True

    async def fetch(self, peer_id, keys, landing=None):
        self.num_calls += 1
        bundle = await self.peers[peer_id].share_pages(list(keys))
        return await self.reader.copy(bundle, landing)


def test_a_peer_on_the_same_node_copies_into_pool_pages_that_the_request_adopts(tiny, prompts, tmp_path):
    """A request whose prefix a peer on this node holds: the engine reserves pool pages as it plans the fetch, the
    copy out of the peer's shared memory writes into them, and the request puts them in its page table: no copy into
    the pool, the same tokens, bit-identical KV, every reference back; the pages are written to the tier after the
    first token, read back by key: the tier's copy is the holder's KV."""
    first, second = prompts
    holder = make_async_engine(tiny, "A", write_policy="reused")
    client = SameNodePeerClient({"A": holder})
    reader = make_async_engine(tiny, "B", disk_dir=str(tmp_path / "disk"), peer_client=client,
                               write_policy="reused")
    try:
        asyncio.run(ask(holder, first, "a"))
        writes = CountingWrites(reader.engine.runner)
        reservations = reserved_pages(reader)
        tokens, cached = asyncio.run(ask(reader, second, "b", peer_hint="A"))
        assert tokens == tiny.generate(second, NUM_OUT) and cached.peer == PREFIX_PAGES * 128
        assert client.num_calls == 1
        keys = assert_adopted_landing_pages(holder, reader, second, writes, reservations)
        deadline = time.monotonic() + 10
        while reader.fetcher._background and time.monotonic() < deadline:
            time.sleep(0.01)
        flush(reader)
        tier = reader.fetcher.tiers[0]
        assert tier.stats().pages_stored == PREFIX_PAGES
        slices = [second[i * 128:(i + 1) * 128] for i in range(PREFIX_PAGES)]
        for key, kv in zip(keys, tier.load(keys, slices)):
            assert torch.equal(kv, page_kv(holder, key))
    finally:
        holder.shutdown()
        reader.shutdown()


def test_pages_a_peer_copied_into_pool_pages_are_written_as_cached_when_the_write_runs(tiny, prompts, tmp_path):
    """The tier write of a peer's pages runs after the first token; landing pages may hold other KV by then (the
    request finished, the pages were evicted and reused). So the write reads the pages back by key: what is cached
    under them then, or nothing. Here the landing pages are overwritten with NaN before the write runs."""
    first, _ = prompts
    holder = make_async_engine(tiny, "A", write_policy="reused")
    try:
        asyncio.run(ask(holder, first, "a"))
        keys = holder.engine.page_keys(first)[:PREFIX_PAGES]
        tokens_per_page = [first[i * 128:(i + 1) * 128] for i in range(PREFIX_PAGES)]
        fmt = holder.fetcher.page_format
        pool = torch.zeros((fmt.kv_shape[0], 2, PREFIX_PAGES + 2, *fmt.kv_shape[2:]), dtype=holder.engine.runner.dtype)

        def fetch_then_store(read_back, directory):
            tiers = build_tiers(fmt, redis_url=None, disk_cache_dir=str(tmp_path / directory),
                                disk_budget_bytes=1 << 30, tier_key=TIER_KEY)
            fetcher = PrefixFetcher(fmt, tiers=tiers, peer_client=SameNodePeerClient({"A": holder}),
                                    own_replica_id="C")
            fetcher.read_back = read_back
            targets = [3, 0, 4]
            landing = LandingPages(targets, [pool[:, :, page_id] for page_id in targets], lambda _: None)
            later: list = []

            async def run():
                pages = await fetcher.fetch(keys, tokens_per_page, peer_hint="A", defer_store=later, landing=landing)
                assert [page.landing_page for page in pages] == targets
                pool.fill_(float("nan"))  # the pages went back and hold other KV now
                later.pop()()
                await asyncio.gather(*fetcher._background)

            asyncio.run(run())
            assert tiers[0].flush(timeout=10)
            stored = tiers[0].load(keys, tokens_per_page)
            fetcher.close()
            return stored

        stored = fetch_then_store(holder.engine.export_pages_concurrently, "cached")
        assert len(stored) == PREFIX_PAGES
        for key, kv in zip(keys, stored):
            assert torch.equal(kv, page_kv(holder, key))
        assert fetch_then_store(lambda wanted: [], "evicted") == []  # no longer cached: nothing written
    finally:
        holder.shutdown()
