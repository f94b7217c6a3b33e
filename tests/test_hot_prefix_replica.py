"""Hot-prefix replication, the target replica's side, at the engine level (no Ray): ``prefetch_prefix`` copies a
prefix's pages from a peer ahead of need, with no compute; a later request hits them locally with the reference's
greedy tokens and bit-identical KV; the hits are counted; every failure copies nothing and the output is unchanged."""

import asyncio

from common.events import PagesStored
from common.types import CachedTokens, PrefetchRequest, PrefetchResult, ProactiveCopyStats
from engine_utils import random_prompt
from test_kv_sources import NUM_OUT, LocalPeerClient, ask, make_async_engine, page_kv, tiny  # noqa: F401 - fixture

PAGE = 128


def prompts():
    prefix = random_prompt(3 * PAGE + 20, seed=70)
    return prefix + random_prompt(30, seed=71), prefix + random_prompt(40, seed=72)


def engines(tiny, *, fail=False, with_peer=True):
    peers = {}
    holder = make_async_engine(tiny, "a")
    target = make_async_engine(tiny, "b", peer_client=LocalPeerClient(peers, fail=fail) if with_peer else None)
    peers["a"] = holder
    return holder, target


def test_a_prefetched_prefix_is_hit_locally_with_the_reference_output(tiny):
    holder, target = engines(tiny)
    first, second = prompts()

    async def scenario():
        await ask(holder, first, "r1")
        result = await target.prefetch_prefix(PrefetchRequest("copy-1", "b", "a", first, 3))
        assert result == PrefetchResult("b", 3, num_pages_present=0, num_pages_copied=3)
        keys = target.engine.page_keys(first[: 3 * PAGE])
        await target.cached_page_keys()  # one more engine-thread round: the import's events are drained
        stored = [event for event in target.drain_kv_events() if isinstance(event, PagesStored)]
        assert [key for event in stored for key in event.keys] == keys  # the router's index learns from these
        assert [info.parent_key for event in stored for info in event.infos] == [None] + keys[:2]
        for key in keys:
            assert (page_kv(target, key) == page_kv(holder, key)).all()
        tokens, cached = await ask(target, second, "r2")
        assert cached == CachedTokens(local=3 * PAGE)
        assert tokens == tiny.generate(second, NUM_OUT)
        again = await target.prefetch_prefix(PrefetchRequest("copy-2", "b", "a", second, 3))
        assert again == PrefetchResult("b", 3, num_pages_present=3, num_pages_copied=0)
        await target.check_integrity()
        assert target.stats().proactive == ProactiveCopyStats(num_prefetches=2, num_failed=0, num_pages_copied=3,
                                                              num_pages_present=3, num_hit_pages=3,
                                                              num_hit_requests=1)

    try:
        asyncio.run(scenario())
    finally:
        holder.shutdown()
        target.shutdown()


def test_a_prefetch_keeps_what_is_cached_and_copies_only_the_rest(tiny):
    holder, target = engines(tiny)
    first, second = prompts()

    async def scenario():
        await ask(holder, first, "r1")
        await ask(target, first[: PAGE + 10], "r0")  # the target computes page 0 itself
        result = await target.prefetch_prefix(PrefetchRequest("copy-1", "b", "a", second, 3))
        assert result == PrefetchResult("b", 3, num_pages_present=1, num_pages_copied=2)
        tokens, cached = await ask(target, second, "r2")
        assert cached == CachedTokens(local=3 * PAGE) and tokens == tiny.generate(second, NUM_OUT)
        stats = target.stats().proactive
        assert (stats.num_hit_pages, stats.num_hit_requests) == (2, 1)  # page 0 was computed here, not copied

    try:
        asyncio.run(scenario())
    finally:
        holder.shutdown()
        target.shutdown()


def test_failed_prefetches_copy_nothing_and_the_request_still_matches_the_reference(tiny):
    first, second = prompts()
    for fail, with_peer, salt, error in ((True, True, None, "a had none"), (False, False, None, "copy is off"),
                                         (False, True, "other-tenant", "a had none")):
        holder, target = engines(tiny, fail=fail, with_peer=with_peer)

        async def scenario():
            await ask(holder, first, "r1")
            result = await target.prefetch_prefix(PrefetchRequest("copy-1", "b", "a", first, 3, cache_salt=salt))
            assert result.num_pages_copied == 0 and error in result.error
            assert target.engine.kv.num_cached_pages == 0
            tokens, cached = await ask(target, second, "r2")
            assert cached == CachedTokens() and tokens == tiny.generate(second, NUM_OUT)
            stats = target.stats().proactive
            assert (stats.num_prefetches, stats.num_failed, stats.num_pages_copied) == (1, 1, 0)

        try:
            asyncio.run(scenario())
        finally:
            holder.shutdown()
            target.shutdown()


def test_hostile_prefetch_input_is_bounded(tiny):
    holder, target = engines(tiny)

    async def scenario():
        too_many = await target.prefetch_prefix(PrefetchRequest("c", "b", "a", [1] * (PAGE - 1), 10**9))
        assert too_many == PrefetchResult("b", 0, error="no full page to copy")
        bad = await target.prefetch_prefix(PrefetchRequest("c", "b", "a", [10**9] * PAGE, 1))
        assert bad.error == "token ids out of the vocabulary" and bad.num_pages_copied == 0

    try:
        asyncio.run(scenario())
    finally:
        holder.shutdown()
        target.shutdown()


def test_an_import_that_fails_part_way_leaks_no_page(tiny):
    """A device error while writing the second page of a proactive copy: the copy fails, and every page it had
    allocated goes back (before, they stayed referenced forever: pool capacity lost for good)."""
    import pytest

    holder, target = engines(tiny, with_peer=False)
    first, _ = prompts()

    async def scenario():
        await ask(holder, first, "r1")

    try:
        asyncio.run(scenario())
        engine = target.engine
        keys = holder.engine.page_keys(first)
        pages = holder.engine.export_pages(keys)
        assert len(pages) == 3
        calls = []
        write = engine.runner.write_page

        def failing_write(page_id, kv):
            calls.append(page_id)
            if len(calls) == 2:
                raise RuntimeError("device error")
            write(page_id, kv)

        engine.runner.write_page = failing_write
        with pytest.raises(RuntimeError, match="device error"):
            engine.import_prefix(keys, 0, pages)
        engine.runner.write_page = write
        assert engine.kv.num_free_pages == engine.kv.num_pages
        assert engine.kv.match_prefix(keys) == engine.kv.match_prefix(keys[:1])  # the first page was imported
        engine.check_integrity()
        assert engine.import_prefix(keys, 0, pages) == (2, 1)  # and the copy works again
    finally:
        holder.shutdown()
        target.shutdown()
