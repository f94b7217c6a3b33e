"""Shared prefix fetches on the receiving replica (replica/fetch_sharing.py) and peer exports off the holder's engine
thread (replica/export_index.py).

Engine level, no Ray (the Ray transport is covered by test_e2e_cross_replica): N requests that miss the same prefix at
once cause one peer fetch and all get the reference's greedy tokens; a failing shared fetch makes every waiter
recompute; a waiter that goes away does not cancel the fetch for the others; a holder whose engine thread is stuck in
a step still answers an export, and one asked for pages it is computing right now answers when they are committed
(bounded); a page being exported is never handed out for other tokens mid-copy, and an evicted page is never exported;
a request cancelled while its admission is queued leaves the engine thread serving."""

import asyncio
import concurrent.futures
import copy
import threading
import time

import pytest
import torch

from common.errors import EngineDeadError, InvalidRequestError
from common.types import CachedTokens, EngineRequest
from engine_utils import greedy, random_prompt, run_to_completion
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.export_index import ExportIndex
from replica.fetch_sharing import FetchRegistry, Segment
from test_kv_sources import NUM_OUT, ask, make_async_engine, page_kv, tiny  # noqa: F401 - fixture

PAGE = 128


# ---- the registry, pure logic ---------------------------------------------------------------------------------------
def keys(*names):
    return [name.encode() for name in names]


def tokens_for(page_keys):
    return [[index] * 2 for index, _ in enumerate(page_keys)]


def test_plans_join_fetches_in_flight_and_fetch_only_what_nobody_has():
    registry = FetchRegistry()
    first = registry.plan("r1", keys("k1", "k2"), tokens_for("ab"), parent_key=b"k0", peer_hint="A", can_fetch=True)
    (fetch,) = first.new_fetches
    assert first.segments == [Segment(fetch, 0, 2)] and fetch.parent_key == b"k0" and fetch.num_participants == 1
    # shorter: a prefix of the same fetch; longer: joins it and fetches only the tail (its parent is the fetch's end)
    shorter = registry.plan("r2", keys("k1"), tokens_for("a"), parent_key=b"k0", peer_hint=None, can_fetch=False)
    assert shorter.segments == [Segment(fetch, 0, 1)] and shorter.new_fetches == []
    longer = registry.plan("r3", keys("k2", "k3", "k4"), tokens_for("abc"), parent_key=b"k1", peer_hint="B",
                           can_fetch=True)
    (tail,) = longer.new_fetches
    assert longer.segments == [Segment(fetch, 1, 1), Segment(tail, 0, 2)]
    assert (tail.keys, tail.parent_key, tail.peer_hint) == (tuple(keys("k3", "k4")), b"k2", "B")
    assert fetch.num_participants == 3 and registry.num_fetches == 2
    # a prompt that parts from the fetch after its first page joins that page only, and fetches its own pages after it
    parted = registry.plan("r6", keys("k1", "x2", "x3"), tokens_for("axy"), parent_key=b"k0", peer_hint="A",
                           can_fetch=True)
    (own,) = parted.new_fetches
    assert parted.segments == [Segment(fetch, 0, 1), Segment(own, 0, 2)]
    assert (own.keys, own.parent_key) == (tuple(keys("x2", "x3")), b"k1")
    registry.leave("r6")
    # pages queued by other requests are used as they are; a page computed here now ends the plan
    pending = {b"k5": "page5"}
    mixed = registry.plan("r4", keys("k5", "k6", "k7"), tokens_for("abc"), parent_key=b"k4", peer_hint="A",
                          can_fetch=True, pending=pending, computing={b"k6"})
    assert mixed.segments == [Segment(None, 0, 1, ("page5",))] and mixed.new_fetches == [] and mixed.ready
    # nothing can be fetched and nothing is on its way: an empty plan (the request computes)
    assert registry.plan("r5", keys("k9"), tokens_for("a"), parent_key=None, peer_hint=None,
                         can_fetch=False).segments == []


def test_a_fetch_stays_joinable_until_done_and_every_participant_is_gone():
    registry = FetchRegistry()
    fetch = registry.plan("r1", keys("k1"), tokens_for("a"), parent_key=None, peer_hint="A",
                          can_fetch=True).new_fetches[0]
    registry.plan("r2", keys("k1"), tokens_for("a"), parent_key=None, peer_hint=None, can_fetch=False)
    registry.leave("r1")  # r1's client went away: the fetch goes on for r2
    registry.leave("r1")  # idempotent
    assert fetch.num_participants == 1 and registry.num_fetches == 1
    fetch.future.set_result(["page1"])
    registry.finished(fetch)  # done, but r2 has not queued its pages yet: a new request still joins the result
    late = registry.plan("r3", keys("k1"), tokens_for("a"), parent_key=None, peer_hint="A", can_fetch=True)
    assert late.segments == [Segment(fetch, 0, 1)] and late.new_fetches == []
    registry.leave("r2")
    assert registry.num_fetches == 1
    registry.leave("r3")
    assert registry.num_fetches == 0  # r2 / r3 carry the pages from here on (``pending`` for later plans)
    again = registry.plan("r4", keys("k1"), tokens_for("a"), parent_key=None, peer_hint="A", can_fetch=True)
    assert len(again.new_fetches) == 1 and again.new_fetches[0] is not fetch
    registry.abandon_all()
    assert again.new_fetches[0].future.result() == [] and registry.num_fetches == 0


# ---- N requests, one fetch (engine level) ---------------------------------------------------------------------------
class GatedPeerClient:
    """A peer copy that waits for ``gate`` (so the test decides when it lands), records the keys of every call, and
    then copies from the holder's engine or (``fail``) raises."""

    def __init__(self, peers: dict, fail: bool = False) -> None:
        self.peers = peers
        self.fail = fail
        self.calls: list[list[bytes]] = []
        self.gate = asyncio.Event()

    async def fetch(self, peer_id, page_keys):
        self.calls.append(list(page_keys))
        await self.gate.wait()
        if self.fail:
            raise ConnectionError(f"replica {peer_id} died")
        return await self.peers[peer_id].export_pages(list(page_keys))


def pair(tiny, *, fail=False):
    peers = {}
    client = GatedPeerClient(peers, fail=fail)
    holder = make_async_engine(tiny, "a")
    target = make_async_engine(tiny, "b", peer_client=client)
    peers["a"] = holder
    return holder, target, client


async def participants(async_engine):
    """Requests sharing each registered fetch (read on the engine thread)."""
    return await async_engine._call(lambda: [fetch.num_participants for fetch in async_engine.fetches.fetches()])


async def wait_for_participants(async_engine, expected, timeout_s=30.0):
    async def poll():
        while await participants(async_engine) != expected:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout_s)


def hot_prompts(num, prefix_len=3 * PAGE + 20):
    prefix = random_prompt(prefix_len, seed=90)
    return [prefix + random_prompt(20 + index, seed=91 + index) for index in range(num)]


def test_concurrent_requests_for_one_missing_prefix_share_one_peer_fetch(tiny):
    holder, target, client = pair(tiny)
    prompts = hot_prompts(4)

    async def scenario():
        await ask(holder, prompts[0], "warm")
        hints = ["a", "a", None, "a"]  # a request the router sent without a hint joins the fetch too
        tasks = [asyncio.ensure_future(ask(target, prompt, f"r{index}", peer_hint=hint))
                 for index, (prompt, hint) in enumerate(zip(prompts, hints))]
        await wait_for_participants(target, [4])
        assert len(client.calls) == 1
        client.gate.set()
        results = await asyncio.gather(*tasks)
        assert await participants(target) == []
        await target.check_integrity()
        return results

    try:
        results = asyncio.run(scenario())
        assert client.calls == [target.engine.page_keys(prompts[0])[:3]]
        for prompt, (tokens, cached) in zip(prompts, results):
            assert tokens == tiny.generate(prompt, NUM_OUT)
            assert cached.total == 3 * PAGE and cached.host == cached.disk == 0
        # one request imports the copy; the others are held back a step and hit it locally (one copy in the pool)
        assert sorted(cached.peer for _, cached in results) == [0, 0, 0, 3 * PAGE]
        for key in target.engine.page_keys(prompts[0])[:3]:
            assert torch.equal(page_kv(target, key), page_kv(holder, key))
    finally:
        holder.shutdown()
        target.shutdown()


@pytest.mark.parametrize("longer_first", [False, True])
def test_longer_and_shorter_prefixes_share_the_overlap_and_fetch_only_the_rest(tiny, longer_first):
    holder, target, client = pair(tiny)
    prefix = random_prompt(5 * PAGE + 20, seed=95)
    short, long = prefix[: 3 * PAGE + 20], prefix  # 3 and 5 reusable pages
    page_keys = target.engine.page_keys(long)

    async def scenario():
        await ask(holder, long, "warm")
        (first_name, first_prompt), (second_name, second_prompt) = (
            [("long", long), ("short", short)] if longer_first else [("short", short), ("long", long)])
        tasks = {first_name: asyncio.ensure_future(ask(target, first_prompt, first_name, peer_hint="a"))}
        await wait_for_participants(target, [1])
        tasks[second_name] = asyncio.ensure_future(ask(target, second_prompt, second_name, peer_hint="a"))
        # the short one joins the long one's fetch; the long one joins the short one's and fetches the tail itself
        await wait_for_participants(target, [2] if longer_first else [2, 1])
        client.gate.set()
        return {name: await task for name, task in tasks.items()}

    try:
        results = asyncio.run(scenario())
        expected_calls = [page_keys[:5]] if longer_first else [page_keys[:3], page_keys[3:5]]
        assert client.calls == expected_calls
        for name, prompt, num_pages in (("short", short, 3), ("long", long, 5)):
            tokens, cached = results[name]
            assert tokens == tiny.generate(prompt, NUM_OUT)
            assert cached.total == num_pages * PAGE
        assert sum(cached.peer for _, cached in results.values()) == 5 * PAGE  # each page imported once
    finally:
        holder.shutdown()
        target.shutdown()


def test_a_failed_shared_fetch_makes_every_waiter_recompute_correctly(tiny):
    holder, target, client = pair(tiny, fail=True)
    prompts = hot_prompts(3)

    async def scenario():
        await ask(holder, prompts[0], "warm")
        tasks = [asyncio.ensure_future(ask(target, prompt, f"r{index}", peer_hint="a"))
                 for index, prompt in enumerate(prompts)]
        await wait_for_participants(target, [3])
        client.gate.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await target.check_integrity()
        assert await participants(target) == []
        return results

    try:
        results = asyncio.run(scenario())
        assert len(client.calls) == 1
        for prompt, (tokens, cached) in zip(prompts, results):
            assert tokens == tiny.generate(prompt, NUM_OUT)
            assert cached.peer == 0
        # the scheduler's hold-back: one of them computes the prefix, the others reuse it
        assert sorted(cached.local for _, cached in results) == [0, 3 * PAGE, 3 * PAGE]
    finally:
        holder.shutdown()
        target.shutdown()


def test_a_waiter_going_away_does_not_cancel_the_fetch_for_the_others(tiny):
    holder, target, client = pair(tiny)
    prompts = hot_prompts(3)

    async def scenario():
        await ask(holder, prompts[0], "warm")
        tasks = [asyncio.ensure_future(ask(target, prompt, f"r{index}", peer_hint="a"))
                 for index, prompt in enumerate(prompts)]
        await wait_for_participants(target, [3])
        tasks[0].cancel()  # the request that started the fetch: its client disconnects
        await wait_for_participants(target, [2])
        client.gate.set()
        results = await asyncio.gather(*tasks[1:])
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        await target.check_integrity()
        assert target.engine.request_ids() == [] and await participants(target) == []
        return results

    try:
        results = asyncio.run(scenario())
        assert len(client.calls) == 1
        for prompt, (tokens, cached) in zip(prompts[1:], results):
            assert tokens == tiny.generate(prompt, NUM_OUT) and cached.total == 3 * PAGE
        assert sum(cached.peer for _, cached in results) >= 3 * PAGE
    finally:
        holder.shutdown()
        target.shutdown()


def test_a_second_request_with_a_running_id_is_refused_and_the_first_still_gets_its_tokens(tiny):
    """While the first fetches its prefix (it is not yet in the engine's table), a duplicate gets InvalidRequestError
    and the first keeps its output channel (it used to lose it to the duplicate and wait forever)."""
    holder, target, client = pair(tiny)
    prompt = hot_prompts(1)[0]

    async def scenario():
        await ask(holder, prompt, "warm")
        first = asyncio.ensure_future(ask(target, prompt, "same", peer_hint="a"))
        await wait_for_participants(target, [1])  # fetching: not yet in the engine's table
        with pytest.raises(InvalidRequestError, match="already running"):
            await asyncio.wait_for(ask(target, prompt, "same", peer_hint="a"), 30)
        client.gate.set()
        tokens, cached = await asyncio.wait_for(first, 60)
        await target.check_integrity()
        assert target.engine.request_ids() == []
        return tokens, cached

    try:
        tokens, cached = asyncio.run(scenario())
        assert tokens == tiny.generate(prompt, NUM_OUT) and cached.peer == 3 * PAGE
    finally:
        holder.shutdown()
        target.shutdown()


# ---- exports off the engine thread -----------------------------------------------------------------------------------
def test_a_holder_busy_in_a_step_still_answers_an_export(tiny):
    holder = make_async_engine(tiny, "a")
    prefix = random_prompt(3 * PAGE + 20, seed=97)
    other = random_prompt(2 * PAGE, seed=98)
    in_step, release = threading.Event(), threading.Event()

    def stuck_step(seconds, chunks):  # the engine thread stays inside its step until released
        in_step.set()
        assert release.wait(60)

    async def scenario():
        await ask(holder, prefix, "warm")
        page_keys = holder.engine.page_keys(prefix)[:3]
        expected = [page_kv(holder, key) for key in page_keys]
        holder.engine.step_observer = stuck_step
        busy = asyncio.ensure_future(ask(holder, other, "long"))
        assert await asyncio.to_thread(in_step.wait, 30)
        pages = await asyncio.wait_for(holder.export_pages(page_keys, contiguous=True), 30)
        assert not release.is_set() and not busy.done()  # answered while the step was still running
        release.set()
        holder.engine.step_observer = None
        tokens, _ = await busy
        return page_keys, expected, pages, tokens

    try:
        page_keys, expected, pages, tokens = asyncio.run(scenario())
        assert [page.key for page in pages] == page_keys
        assert [page.token_ids for page in pages] == [tuple(prefix[i * PAGE : (i + 1) * PAGE]) for i in range(3)]
        for page, kv in zip(pages, expected):
            assert torch.equal(page.kv, kv)
        assert tokens == tiny.generate(other, NUM_OUT)
    finally:
        release.set()
        holder.shutdown()


def test_a_page_being_exported_is_not_reused_until_the_copy_ends_and_an_evicted_page_is_not_exported(tiny):
    # 6 pages: the first prompt leaves its 3 full pages cached; the second needs all 6 at once, evicting them
    engine = LLMEngine(EngineConfig(num_pages=6, max_num_batched_tokens=1024), copy.deepcopy(tiny.served))
    first = random_prompt(3 * PAGE + 20, seed=99)
    second = random_prompt(5 * PAGE + 50, seed=100)
    run_to_completion(engine, {"first": first}, 2)
    page_keys = engine.page_keys(first)[:3]
    expected = [engine.runner.read_page(engine.kv.cache.lookup(key)).clone() for key in page_keys]

    copying, resume = threading.Event(), threading.Event()
    read_page = engine.runner.read_page

    def slow_read(page_id):  # the export has pinned its pages and is copying them, slowly
        copying.set()
        assert resume.wait(60)
        return read_page(page_id)

    engine.runner.read_page = slow_read
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        export = pool.submit(engine.export_pages_concurrently, page_keys)
        assert copying.wait(30)
        engine.runner.read_page = read_page  # only the export in flight is slow
        steps = pool.submit(run_to_completion, engine, {"second": second}, NUM_OUT)
        # the engine evicts the three pages (their keys leave the index: no new export finds them) and waits
        # before reusing them
        deadline_s = 30.0
        while engine.kv.exports.num_reuse_waits == 0 and deadline_s > 0:
            time.sleep(0.01)
            deadline_s -= 0.01
        assert engine.kv.exports.num_reuse_waits == 1 and not steps.done()
        assert engine.export_pages_concurrently(page_keys) == []
        resume.set()
        pages = export.result(timeout=60)
        tokens, _ = steps.result(timeout=120)
    assert [page.key for page in pages] == page_keys
    for page, kv in zip(pages, expected):
        assert torch.equal(page.kv, kv)  # the committed KV, not the second prompt's
    assert tokens["second"] == tiny.generate(second, NUM_OUT)
    assert engine.kv.exports.num_pinned_pages == 0
    engine.check_integrity()


def test_export_index_pins_only_published_pages_and_waits_for_copies_before_reuse():
    index = ExportIndex()
    index.publish(b"k0", 4, (1, 2))
    index.publish(b"k1", 7, (3, 4))
    pinned = index.pin_prefix([b"k0", b"k1", b"k2"])
    assert [(page.key, page.page_id, page.token_ids) for page in pinned] == [(b"k0", 4, (1, 2)), (b"k1", 7, (3, 4))]
    index.withdraw(b"k0")
    assert index.pin_prefix([b"k0", b"k1"]) == []  # the run starts at a withdrawn key: nothing
    done = threading.Event()

    def reuse():
        index.wait_unpinned([4, 9])
        done.set()

    waiter = threading.Thread(target=reuse)
    waiter.start()
    assert not done.wait(0.2)  # page 4 is still being copied
    index.unpin([4, 7])
    waiter.join(10)
    assert done.is_set() and index.num_pinned_pages == 0 and index.num_reuse_waits == 1
    index.clear()
    assert index.pin_prefix([b"k1"]) == []


def test_a_request_cancelled_while_its_admission_is_queued_leaves_the_engine_serving(tiny):
    # the admission runs on the engine thread after the step; the caller is gone by then (its result has no taker)
    engine = make_async_engine(tiny, "a")
    busy_prompt, queued_prompt = random_prompt(PAGE, seed=101), random_prompt(PAGE + 5, seed=102)
    in_step, release = threading.Event(), threading.Event()

    def stuck_step(seconds, chunks):
        in_step.set()
        assert release.wait(60)

    async def scenario():
        engine.engine.step_observer = stuck_step
        busy = asyncio.ensure_future(ask(engine, busy_prompt, "busy"))
        assert await asyncio.to_thread(in_step.wait, 30)
        queued = asyncio.ensure_future(ask(engine, queued_prompt, "queued"))
        await asyncio.sleep(0.05)  # its admission now waits behind the stuck step
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        engine.engine.step_observer = None
        release.set()
        busy_tokens, _ = await asyncio.wait_for(busy, 20)
        after_tokens, _ = await asyncio.wait_for(ask(engine, queued_prompt, "after"), 20)
        await engine.check_integrity()
        return busy_tokens, after_tokens

    try:
        busy_tokens, after_tokens = asyncio.run(scenario())
        assert busy_tokens == tiny.generate(busy_prompt, NUM_OUT)
        assert after_tokens == tiny.generate(queued_prompt, NUM_OUT)
    finally:
        release.set()
        engine.shutdown()


def test_an_export_of_pages_being_computed_waits_for_their_commit_bounded(tiny):
    holder = make_async_engine(tiny, "a")
    prefix = random_prompt(3 * PAGE + 20, seed=103)
    in_step, release = threading.Event(), threading.Event()

    def stuck_step(seconds, chunks):  # the step computing the prefix stops before committing its pages
        in_step.set()
        assert release.wait(60)

    async def scenario():
        page_keys = holder.engine.page_keys(prefix)[:3]
        assert await holder.export_pages(page_keys) == []  # neither cached nor being computed: no pages, no wait
        holder.engine.step_observer = stuck_step
        computing = asyncio.ensure_future(ask(holder, prefix, "p"))
        assert await asyncio.to_thread(in_step.wait, 30)
        holder.export_wait_s = 0.2
        assert await holder.export_pages(page_keys) == []  # the wait is bounded
        holder.export_wait_s = 30.0
        export = asyncio.ensure_future(holder.export_pages(page_keys, contiguous=True))
        await asyncio.sleep(0.2)
        assert not export.done()  # waiting for the commit
        holder.engine.step_observer = None
        release.set()
        pages = await asyncio.wait_for(export, 30)
        tokens, _ = await computing
        return page_keys, pages, tokens

    try:
        page_keys, pages, tokens = asyncio.run(scenario())
        assert [page.key for page in pages] == page_keys
        for page, key in zip(pages, page_keys):
            assert torch.equal(page.kv, page_kv(holder, key))
        assert tokens == tiny.generate(prefix, NUM_OUT)
    finally:
        release.set()
        holder.shutdown()


def test_exports_run_on_their_own_threads_not_the_loop_s_default_executor(tiny):
    """A burst of exports waiting for a prefix being computed must not take the threads tier loads run on."""
    holder = make_async_engine(tiny, "a")
    names = []
    export = holder.engine.export_pages_concurrently

    def recording(*args, **kwargs):
        names.append(threading.current_thread().name)
        return export(*args, **kwargs)

    holder.engine.export_pages_concurrently = recording
    try:
        assert asyncio.run(holder.export_pages([b"no-such-key"])) == []
        assert names and names[0].startswith("kv-export")
    finally:
        holder.shutdown()


def test_a_failing_engine_thread_command_leaves_the_engine_serving(tiny):
    """Commands other than steps (an abort, a fetch's end) run on the engine thread between steps: one that raises is
    logged, and the thread serves on (it used to end, and every request waited forever)."""
    target = make_async_engine(tiny, "a")
    prompt = hot_prompts(1)[0]

    def broken():
        raise RuntimeError("a command that fails")

    async def scenario():
        target._submit(broken)
        return await asyncio.wait_for(ask(target, prompt, "after"), 60)

    try:
        tokens, _ = asyncio.run(scenario())
        assert tokens == tiny.generate(prompt, NUM_OUT)
        assert target._thread.is_alive()
    finally:
        target.shutdown()


def test_a_call_after_shutdown_gets_an_error_instead_of_waiting_forever(tiny):
    """Admin and export calls run on the engine thread; once it has ended nothing runs them. A call made after
    shutdown used to wait forever: it is refused at once, and one queued as the thread ended is failed by it."""
    target = make_async_engine(tiny, "a")
    target.shutdown()
    assert not target._thread.is_alive()

    async def after_shutdown():
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(target.reset_prefix_cache(), 5)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(target.cached_page_keys(), 5)

    asyncio.run(after_shutdown())

    queued = make_async_engine(tiny, "b")
    started, release = threading.Event(), threading.Event()

    def blocker():
        started.set()
        release.wait(30)

    queued._submit(blocker)  # the thread is busy with this command
    assert started.wait(30)

    async def queued_while_busy():
        call = asyncio.ensure_future(queued._call(lambda: "ran"))
        await asyncio.sleep(0.1)
        queued._stopped = True  # the thread runs what is queued, then ends
        release.set()
        return await asyncio.wait_for(call, 5)

    assert asyncio.run(queued_while_busy()) == "ran"
    queued._thread.join(10)
    assert not queued._thread.is_alive() and not queued._calls

    # a call made while the ending thread fails its requests is queued after the thread's last command: the thread
    # fails it on its way out
    ending = make_async_engine(tiny, "c")
    failing, resume = threading.Event(), threading.Event()
    original_fail_all = ending._fail_all

    def slow_fail_all(exc):
        failing.set()
        resume.wait(30)
        original_fail_all(exc)

    ending._fail_all = slow_fail_all
    ending._stopped = True
    ending._wake.set()
    assert failing.wait(30)

    async def call_as_the_thread_ends():
        call = asyncio.ensure_future(ending._call(lambda: "never runs"))
        await asyncio.sleep(0.1)
        resume.set()
        await asyncio.wait_for(call, 5)

    with pytest.raises(EngineDeadError):
        asyncio.run(call_as_the_thread_ends())
    ending._thread.join(10)
    assert not ending._thread.is_alive()


class RecordingGatedPeerClient(GatedPeerClient):
    """``GatedPeerClient`` that also records which peer each call asked."""

    def __init__(self, peers: dict) -> None:
        super().__init__(peers)
        self.peer_ids: list[str] = []

    async def fetch(self, peer_id, page_keys):
        self.peer_ids.append(peer_id)
        return await super().fetch(peer_id, page_keys)


def test_a_request_whose_joined_fetch_asked_a_stale_peer_asks_its_own_peer_for_the_rest(tiny):
    """r0's router named peer "c", which no longer holds the prefix; r1's named "a", which does. r1 joins r0's fetch;
    when that comes back empty, r1 asks "a" for the pages instead of recomputing them."""
    peers = {}
    client = RecordingGatedPeerClient(peers)
    holder, stale = make_async_engine(tiny, "a"), make_async_engine(tiny, "c")
    target = make_async_engine(tiny, "b", peer_client=client)
    peers.update(a=holder, c=stale)
    prompts = hot_prompts(2)
    page_keys = target.engine.page_keys(prompts[0])[:3]

    async def scenario():
        await ask(holder, prompts[0], "warm")
        first = asyncio.ensure_future(ask(target, prompts[0], "r0", peer_hint="c"))
        await wait_for_participants(target, [1])
        second = asyncio.ensure_future(ask(target, prompts[1], "r1", peer_hint="a"))
        await wait_for_participants(target, [2])  # r1 joined r0's fetch (from "c")
        client.gate.set()
        results = await asyncio.gather(first, second)
        await target.check_integrity()
        return results

    try:
        (tokens0, cached0), (tokens1, cached1) = asyncio.run(scenario())
        assert client.peer_ids == ["c", "a"] and client.calls == [page_keys, page_keys]
        assert tokens0 == tiny.generate(prompts[0], NUM_OUT) and tokens1 == tiny.generate(prompts[1], NUM_OUT)
        # r0 recomputes (its peer had nothing); r1 imports the pages from "a", or, when r0 committed them while r1
        # was copying, is held back and reuses r0's: both are correct, neither recomputes twice
        assert cached1.total == 3 * PAGE and cached0.peer == 0
    finally:
        for engine in (holder, stale, target):
            engine.shutdown()
