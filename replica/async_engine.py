"""Async streaming interface over ``LLMEngine``: one request in, its tokens out as they are produced.

The engine runs on its own thread (torch releases the GIL in kernels, so the asyncio loop stays responsive). Callers
never touch the engine directly: requests, aborts and commands go through a thread-safe inbox drained at the start of
every step, and a step's outputs come back in one ``call_soon_threadsafe`` per event loop, which hands each to its
request's asyncio queue or, for a request bound to an output channel, to the channel's batch of that step. Nothing
here blocks the event loop.

Output channels: under Ray Serve every message on a request's stream costs the replica ~0.5 ms of CPU (most of it
holding the GIL the engine thread also needs) and the caller ~1 ms, per request and per step, so with several
streams a step's messages took longer than the step. A caller that opens a channel (``open_channel``) gets one message
per step with the outputs of all its requests bound to it; a request is bound at its first output (which still goes
on its own stream, for the time to first token), if it named the channel and the channel is open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import uuid
from collections import deque
from typing import AsyncIterator, Callable

from common.errors import EngineDeadError, InvalidRequestError
from common.events import KVEvent
from common.types import EngineRequest, EngineStats, PrefetchRequest, PrefetchResult, RequestOutput, StreamLocation
from common.routing_stats import EXPORT_WAIT_S
from replica.engine import AdmissionPlan, LLMEngine
from replica.fetch_sharing import FetchPlan, FetchRegistry, SharedFetch, collect_pages, run_deferred
from replica.kv_sources import PrefixFetcher
from replica.landing import LandingPages, landing_page_ids
from replica.page_record import PageRecord
from replica.page_stream import node_address
from replica.shared_pool import SharedPoolBundle

logger = logging.getLogger(__name__)


class OutputChannelClosed(RuntimeError):
    """The output channel a request's outputs went to was closed before the request finished."""


@dataclasses.dataclass(eq=False)
class OutputChannel:
    """One caller's channel on this replica (event-loop state): the outputs waiting to be sent, in step order."""

    channel_id: str
    pending: list = dataclasses.field(default_factory=list)
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    sinks: set = dataclasses.field(default_factory=set)
    """The ``RequestSink``s bound to this channel (their requests have not finished)."""
    closed: bool = False

    def put(self, outputs: list[RequestOutput]) -> None:
        self.pending.extend(outputs)
        self.ready.set()

    async def next_batch(self, idle_s: float) -> list[RequestOutput] | None:
        """Every output waiting, in order, as one list, once there is one; None when nothing came for ``idle_s`` and
        no request is bound."""
        while not self.pending:
            self.ready.clear()
            try:
                await asyncio.wait_for(self.ready.wait(), idle_s)
            except asyncio.TimeoutError:
                if not self.sinks and not self.pending:
                    return None
        batch, self.pending = self.pending, []
        return batch


class _ChannelDone:
    """Queued on a bound request's own queue when its last output went to the channel."""


CHANNEL_DONE = _ChannelDone()


@dataclasses.dataclass(eq=False)
class RequestSink:
    """Where one request's outputs go (event-loop state): its queue, or ``channel`` once bound to one."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    channel: OutputChannel | None = None


KEYS_OFF_THREAD_MIN_TOKENS = 4096
"""From this prompt length the page keys (~0.06 ms per 1000 tokens) are hashed on a worker thread before the request
reaches the engine thread, which would otherwise hold its next step for them (~5 ms for 100k tokens)."""
EXPORT_THREADS = 4
"""Threads that copy pages out for peers (an export is a memory copy, or a bounded wait for pages being computed):
their own pool, so a burst of exports waiting on a prefix in progress cannot starve this replica's tier loads."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, fetcher: PrefixFetcher | None = None) -> None:
        self.engine = engine
        self.fetcher = fetcher
        if fetcher is not None:  # pages a peer copied into landing pages are read back by key for the tiers
            fetcher.read_back = engine.export_pages_concurrently
        if fetcher is not None and fetcher.tiers and engine.enable_prefix_caching:
            engine.page_sink = fetcher.on_computed
            engine.retention_sink = fetcher.on_retention
        self._inbox: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._stopped = False
        self._calls_lock = threading.Lock()
        self._calls: set[concurrent.futures.Future] = set()
        """Futures of ``_call``s not yet run; failed when the engine thread ends (nothing would run them)."""
        self._closed = False
        self._request_to_sink: dict[str, RequestSink] = {}
        self._channels: dict[str, OutputChannel] = {}
        """Open output channels by id (event-loop state: opened, closed and read on the callers' loop)."""
        self._kv_events: deque[KVEvent] = deque()
        self._fetches = FetchRegistry()
        self._landings: set[LandingPages] = set()
        """Fetches' landing pages whose references have not gone back yet (engine-thread state, replica/landing.py)."""
        self._holds: dict[object, list[int]] = {}
        """Landing pages of queued requests' records that a request's plan took (``Segment.pages``), by participant:
        held until the request is queued with them (it then holds its own references) or leaves."""
        self.export_wait_s = EXPORT_WAIT_S
        self._export_pool = concurrent.futures.ThreadPoolExecutor(EXPORT_THREADS, thread_name_prefix="kv-export")
        if engine.runner.shared_pool is not None:  # peers of this node ask over a socket once they know it
            share = lambda keys: engine.share_pages(keys, wait_for_computing_s=self.export_wait_s)  # noqa: E731
            engine.runner.shared_pool.serve_exports(share)
            host = node_address() if engine.config.peer_copy_stream else None
            if host is not None:  # peers of other nodes ask over TCP once they know it
                engine.runner.shared_pool.serve_stream(share, host)
        self._fetch_tasks: set[asyncio.Future] = set()
        self._thread = threading.Thread(target=self._run, name=f"engine-{engine.config.replica_id}", daemon=True)
        self._thread.start()

    # ---- public API ----------------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_fingerprint(self) -> str:
        return self.engine.model_fingerprint

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last has ``finished=True``. Raises ``InvalidRequestError`` before any
        output if the request can't be served. Closing the iterator early aborts the request."""
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_id = request.request_id
        if request_id in self._request_to_sink:  # the running request keeps its output channel
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        sink = RequestSink(loop, queue)
        self._request_to_sink[request_id] = sink
        participant = object()  # this call's share in fetches (request ids need not be unique while fetching)
        fetches: list[SharedFetch] = []
        finished = False
        rejected = False
        try:
            keys = None
            if (request.peer_stream is not None and request.peer_hint and self.fetcher is not None
                    and self.engine.config.enable_peer_copy):
                self.fetcher.learn_peer_stream(request.peer_hint, request.peer_stream)
            if self.engine.enable_prefix_caching and len(request.prompt_token_ids) >= KEYS_OFF_THREAD_MIN_TOKENS:
                # hash a long prompt's page keys here, not on the engine thread between its steps
                keys = await loop.run_in_executor(None, self.engine.page_keys, list(request.prompt_token_ids),
                                                  request.cache_salt)
            try:
                admitted = await self._call(lambda: self._admit(request, participant, loop, keys))
            except InvalidRequestError:
                rejected = True  # nothing was queued (and another request may hold this id)
                raise
            if admitted is not None:  # pages to fetch first (or shared with a fetch under way): only this request waits
                plan, fetch_plan = admitted
                fetches = [segment.fetch for segment in fetch_plan.segments if segment.fetch is not None]
                fetched = await self._collect(plan, fetch_plan)
                fetched = await self._ask_own_peer_for_the_rest(plan, fetch_plan, fetched, request.peer_hint)
                self._submit(lambda: self._add(plan, fetched, participant))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is CHANNEL_DONE:  # the last output went to the channel
                    finished = True
                    return
                item = coalesce_pending(item, queue)
                if not item.finished and sink.channel is None:
                    # no await since the queue was drained: every later output of this step onwards is dispatched
                    # after this line, so it goes to the channel, behind this one
                    item = self._bind(sink, request.output_channel, item)
                yield item
                # the caller has sent the first token on: the fetches' tier writes may take the CPU now (before the
                # yield they held the token back by 0.3-4 ms: a worker thread to start, the GIL to share)
                run_deferred(fetches)
                if item.finished:
                    finished = True
                    return
        finally:
            run_deferred(fetches)
            if sink.channel is not None:
                sink.channel.sinks.discard(sink)
            if self._request_to_sink.get(request_id) is sink:
                del self._request_to_sink[request_id]
            if not finished and not rejected:
                self._submit(lambda: self._abandon(request_id, participant))

    def _bind(self, sink: RequestSink, channel_id: str | None, first: RequestOutput) -> RequestOutput:
        """Event loop: bind the request to its caller's open channel, if any; ``first`` marked when bound."""
        channel = self._channels.get(channel_id) if channel_id else None
        if channel is None or channel.closed:
            return first
        sink.channel = channel
        channel.sinks.add(sink)
        return dataclasses.replace(first, via_channel=True)

    def open_channel(self, channel_id: str) -> OutputChannel:
        """Event loop: open (or reopen, replacing the previous one) the output channel ``channel_id``; read its
        ``next_batch`` and call ``close_channel`` when done."""
        previous = self._channels.get(channel_id)
        if previous is not None:
            self.close_channel(previous)
        channel = OutputChannel(channel_id)
        self._channels[channel_id] = channel
        return channel

    def close_channel(self, channel: OutputChannel) -> None:
        """Event loop: close ``channel``; the requests still bound to it fail (``OutputChannelClosed``): their caller
        stopped reading it."""
        channel.closed = True
        if self._channels.get(channel.channel_id) is channel:
            del self._channels[channel.channel_id]
        for sink in list(channel.sinks):
            sink.channel = None
            sink.queue.put_nowait(OutputChannelClosed(f"output channel {channel.channel_id} closed"))
        channel.sinks.clear()

    def _admit(self, request: EngineRequest, participant: object, loop: asyncio.AbstractEventLoop,
               page_keys: list | None = None) -> tuple[AdmissionPlan, FetchPlan] | None:
        """Engine thread: plan the request (``page_keys``: its keys, computed by ``generate`` for a long prompt);
        queue it now unless some of its missing pages are on their way or worth fetching (then the plans; see
        replica/fetch_sharing.py)."""
        plan = self.engine.plan(request, page_keys)
        if self.fetcher is not None and self.fetcher.tiers:  # pages reused from the local cache: worth sharing
            self.fetcher.share_local_hits(plan.page_keys[: plan.missing.start], self.engine.export_pages)
        if not plan.missing or self.fetcher is None or not self.fetcher.enabled:
            self.engine.add(plan)
            return None
        missing = plan.missing
        page_size = self.engine.config.page_size
        peer_hint = request.peer_hint if self.engine.config.enable_peer_copy else None
        can_fetch = bool(self.fetcher.tiers) or (self.fetcher.peer_client is not None and bool(peer_hint)
                                                 and peer_hint != self.fetcher.own_replica_id)
        keys = plan.page_keys[missing.start : missing.stop]
        token_ids = plan.missing_token_ids(page_size)
        fetch_plan = self._fetches.plan(
            participant, keys, token_ids, parent_key=plan.page_keys[missing.start - 1] if missing.start else None,
            peer_hint=peer_hint, can_fetch=can_fetch, pending=self.engine.pending_fetched_pages(),
            computing=self.engine.keys_being_computed())
        for fetch in fetch_plan.new_fetches:
            self._reserve_landing(fetch, plan.page_keys[: missing.start])
            self._start_fetch(fetch, loop)
        if fetch_plan.ready:  # nothing to wait for: queue it with the pages at hand
            self.engine.add(plan, collect_pages(fetch_plan, [()] * len(fetch_plan.segments), keys, token_ids))
            return None
        self._hold(participant, fetch_plan)
        return plan, fetch_plan

    def _reserve_landing(self, fetch: SharedFetch, keep: list) -> None:
        """Engine thread: pool pages for ``fetch`` to write its pages into, if its first source can (a shared tier
        decrypts into them; a peer's shared memory is copied, or its page stream received, into them: not a peer
        asked through Ray) and the pool can spare them (``LLMEngine.reserve_landing``; ``keep``: the request's local
        hit)."""
        fetcher = self.fetcher
        if fetcher.peer_client is not None and fetch.peer_hint and fetch.peer_hint != fetcher.own_replica_id:
            if not fetcher.copies_into_pool(fetch.peer_hint):
                return
        elif not fetcher.tiers:
            return
        in_flight = sum(len(landing.page_ids) for landing in self._landings)
        if in_flight + len(fetch.keys) > self.engine.kv.num_pages // 2:
            return  # fetches in flight hold half of the pool already (a miss keeps its pages until it is known)
        page_ids = self.engine.reserve_landing(len(fetch.keys), keep)
        if not page_ids:
            return
        try:
            views = self.engine.landing_views(page_ids)
        except BaseException:
            self.engine.kv.release(page_ids)
            raise
        fetch.landing = LandingPages(page_ids, views, self._give_back_landing)
        self._landings.add(fetch.landing)

    def _give_back_landing(self, landing: LandingPages) -> None:
        """Any thread: release a fetch's references on its landing pages, on the engine thread."""
        def give_back() -> None:
            if landing in self._landings:
                self._landings.discard(landing)
                self.engine.kv.release(landing.page_ids)

        if threading.current_thread() is self._thread:
            give_back()
        else:
            self._submit(give_back)

    def _hold(self, participant: object, fetch_plan: FetchPlan) -> None:
        """Engine thread: a reference on each landing page among the pages ``fetch_plan`` took from queued requests
        (the request holding them may be admitted or go away before this one is queued)."""
        page_ids = [page_id for segment in fetch_plan.segments if segment.fetch is None
                    for page_id in landing_page_ids(segment.pages)]
        if page_ids:
            self.engine.kv.acquire(page_ids, reuse=False)
            self._holds[participant] = page_ids

    def _leave(self, participant: object) -> None:
        """Engine thread: the request is queued with its pages, or went away: drop its shares in fetches and its
        holds."""
        self._fetches.leave(participant)
        page_ids = self._holds.pop(participant, None)
        if page_ids:
            self.engine.kv.release(page_ids)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def num_requests(self) -> int:
        """Requests in ``generate`` now (fetching, queued or running)."""
        return len(self._request_to_sink)

    async def export_pages(self, keys: list[bytes], to_cpu: bool = True, contiguous: bool = False) -> list[PageRecord]:
        """Copies of the leading pages of ``keys`` this replica holds (for a peer's copy), pinned while copied; on the
        CPU, or (``to_cpu=False``) on this replica's device; ``contiguous``: slots of one tensor. The copy runs on a
        worker thread at once, not between engine steps (``LLMEngine.export_pages_concurrently``), so a busy replica
        answers a peer in the time of the copy; pages this replica is computing right now are waited for, at most
        ``export_wait_s``."""
        copy = functools.partial(self.engine.export_pages_concurrently, list(keys), to_cpu=to_cpu,
                                 contiguous=contiguous, wait_for_computing_s=self.export_wait_s)
        # on threads of their own: an export may wait for pages being computed, and must not hold up this replica's
        # tier loads and stores in the loop's default executor (nor they it)
        return await asyncio.get_running_loop().run_in_executor(self._export_pool, copy)

    @property
    def stream_location(self) -> StreamLocation | None:
        """Where replicas on other nodes ask this one for pages over TCP (replica/page_stream.py), or None."""
        pool = self.engine.runner.shared_pool
        return pool.stream_location if pool is not None else None

    async def share_pages(self, keys: list[bytes]) -> SharedPoolBundle | None:
        """For a peer on this node: where the leading pages of ``keys`` this replica holds lie in its pool's shared
        memory (``LLMEngine.share_pages``; None when the pool is private). On the export threads: it may wait, like
        ``export_pages``, for pages being computed."""
        if self.engine.runner.shared_pool is None:
            return None
        share = functools.partial(self.engine.share_pages, list(keys), wait_for_computing_s=self.export_wait_s)
        return await asyncio.get_running_loop().run_in_executor(self._export_pool, share)

    def _start_fetch(self, fetch: SharedFetch, loop: asyncio.AbstractEventLoop) -> None:
        """Engine thread: run ``fetch`` on ``loop``; its future is resolved whatever happens (``[]`` on failure)."""
        try:
            loop.call_soon_threadsafe(self._spawn_fetch, fetch)
        except RuntimeError:  # the loop is closed: nobody can run it
            fetch.resolve([])
            self._fetches.finished(fetch)

    def _spawn_fetch(self, fetch: SharedFetch) -> None:
        task = asyncio.ensure_future(self._run_fetch(fetch))
        self._fetch_tasks.add(task)
        task.add_done_callback(lambda done: self._end_fetch(fetch, done))

    async def _run_fetch(self, fetch: SharedFetch) -> list[PageRecord]:
        """One shared fetch (owned by the engine, not by the request that started it: a client going away does not
        cancel it for the others)."""
        try:
            return await self.fetcher.fetch(list(fetch.keys), [list(tokens) for tokens in fetch.token_ids],
                                            peer_hint=fetch.peer_hint, parent_key=fetch.parent_key,
                                            defer_store=fetch.deferred, landing=fetch.landing)
        except Exception:  # noqa: BLE001 - sources degrade to recompute, never fail the request
            logger.exception("fetching prefix pages failed; recomputing them")
            return []

    def _end_fetch(self, fetch: SharedFetch, task: asyncio.Task) -> None:
        """Resolve the fetch's future (``[]`` if the task failed or was cancelled, even before it started)."""
        self._fetch_tasks.discard(task)
        pages = [] if task.cancelled() or task.exception() is not None else task.result()
        fetch.resolve(pages)
        self._submit(lambda: self._fetches.finished(fetch))

    async def _collect(self, plan: AdmissionPlan, fetch_plan: FetchPlan) -> list[PageRecord]:
        missing = plan.missing
        return await self._collect_pages(plan.page_keys[missing.start : missing.stop],
                                         plan.missing_token_ids(self.engine.config.page_size), fetch_plan)

    async def _ask_own_peer_for_the_rest(self, plan: AdmissionPlan, fetch_plan: FetchPlan,
                                         fetched: list[PageRecord], peer_hint: str | None) -> list[PageRecord]:
        """A request that joined another request's fetch came back short, and that fetch asked another peer (or none)
        than the one the router named for this request: ask this request's peer for the rest, before recomputing it.
        (The shared fetch carries the hint of the request that started it, which may be stale: its peer may have
        evicted the prefix since, while this request's router saw where the prefix is now.) The tiers are not asked
        again: the shared fetch did. Pages copied here go to the tiers at once (a rare path)."""
        missing = plan.missing
        num_missing = missing.stop - missing.start
        if (len(fetched) >= num_missing or not peer_hint or self.fetcher is None or self.fetcher.peer_client is None
                or not self.engine.config.enable_peer_copy or peer_hint == self.fetcher.own_replica_id):
            return fetched
        covered = 0
        for segment in fetch_plan.segments:  # the segment the run stopped in
            covered += segment.count
            if covered > len(fetched):
                break
        else:
            return fetched
        if segment.fetch is None or segment.fetch.peer_hint == peer_hint:
            return fetched  # nothing to fetch, or this request's own peer was asked already
        start = missing.start + len(fetched)
        rest = await self.fetcher.fetch(plan.page_keys[start : missing.stop],
                                        plan.missing_token_ids(self.engine.config.page_size)[len(fetched):],
                                        peer_hint=peer_hint, parent_key=plan.page_keys[start - 1] if start else None,
                                        use_tiers=False)
        return fetched + rest

    @staticmethod
    async def _collect_pages(keys, token_ids, fetch_plan: FetchPlan) -> list[PageRecord]:
        """The pages of ``keys`` that ``fetch_plan``'s segments deliver, in order, stopping at the first segment that
        came back short. Waiting is shielded: a cancelled caller stops waiting, the fetch goes on for the others."""
        results = []
        for segment in fetch_plan.segments:
            if segment.fetch is None:
                results.append(())
                continue
            result = await asyncio.shield(asyncio.wrap_future(segment.fetch.future))
            results.append(result)
            if len(result) < segment.offset + segment.count:
                break
        return collect_pages(fetch_plan, results, keys, token_ids)

    async def prefetch_prefix(self, request: PrefetchRequest) -> PrefetchResult:
        """Hot-prefix replication, target side: copy the first ``request.num_pages`` full pages of ``request.token_ids``
        from the peer ``request.peer_hint`` (then the shared tiers) into this replica's prefix cache, with no compute.
        The keys are hashed here from the tokens (this replica's fingerprint and the request's salt); the fetcher checks
        every page's key and token ids. Never raises for a missing or failing source: the result says what happened.
        Cancelling the call (the planner's demand dropped) stops it before the pages are cached."""
        engine = self.engine
        stats = engine.proactive
        try:
            result = await self._prefetch(request)
        except (asyncio.CancelledError, EngineDeadError):
            raise
        except Exception as exc:  # noqa: BLE001 - a proactive copy must never hurt the replica
            logger.exception("proactive copy %s failed", request.copy_id)
            result = PrefetchResult(engine.config.replica_id, request.num_pages, error=f"failed: {exc!r}")
        stats.num_prefetches += 1
        stats.num_failed += result.error is not None and result.num_pages_copied == 0
        stats.num_pages_present += result.num_pages_present
        return result

    async def _prefetch(self, request: PrefetchRequest) -> PrefetchResult:
        engine = self.engine
        replica_id = engine.config.replica_id
        page_size = engine.config.page_size
        num_pages = min(request.num_pages, len(request.token_ids) // page_size,
                        max(engine.max_model_len - 1, 0) // page_size)
        if not engine.enable_prefix_caching:
            return PrefetchResult(replica_id, num_pages, error="prefix caching is off")
        if self.fetcher is None or self.fetcher.peer_client is None:
            return PrefetchResult(replica_id, num_pages, error="cross-replica prefix copy is off")
        if num_pages <= 0:
            return PrefetchResult(replica_id, 0, error="no full page to copy")
        tokens = request.token_ids[: num_pages * page_size]
        if not all(isinstance(t, int) and 0 <= t < engine.vocab_size for t in tokens):
            return PrefetchResult(replica_id, num_pages, error="token ids out of the vocabulary")
        keys = engine.page_keys(tokens, request.cache_salt)
        token_ids = [tokens[i * page_size : (i + 1) * page_size] for i in range(num_pages)]
        participant = object()  # the copy shares fetches with requests for the same pages (fetch_sharing.py)
        loop = asyncio.get_running_loop()
        if request.peer_stream is not None:  # the router named the peer's page stream: a copy across nodes skips Ray
            self.fetcher.learn_peer_stream(request.peer_hint, request.peer_stream)

        def plan_fetch() -> tuple[int, FetchPlan | None]:
            num_local = len(engine.kv.match_prefix(keys))
            if num_local == num_pages:
                return num_local, None
            fetch_plan = self._fetches.plan(
                participant, keys[num_local:], token_ids[num_local:],
                parent_key=keys[num_local - 1] if num_local else None, peer_hint=request.peer_hint, can_fetch=True,
                pending=engine.pending_fetched_pages(), computing=engine.keys_being_computed())
            for fetch in fetch_plan.new_fetches:
                self._start_fetch(fetch, loop)
            self._hold(participant, fetch_plan)
            return num_local, fetch_plan

        def import_pages(num_local: int, pages: list[PageRecord]) -> tuple[int, int]:
            try:  # copied from landing pages (if any) while the fetch still holds them
                return engine.import_prefix(keys, num_local, pages, salted=request.cache_salt is not None)
            finally:
                self._leave(participant)

        fetch_plan = None
        try:
            num_local, fetch_plan = await self._call(plan_fetch)
            if fetch_plan is None:
                return PrefetchResult(replica_id, num_pages, num_pages_present=num_local)
            pages = await self._collect_pages(keys[num_local:], token_ids[num_local:], fetch_plan)
            if not pages:
                error = (f"{request.peer_hint} had none of the missing pages" if fetch_plan.segments
                         else "the missing pages are being computed here")
                return PrefetchResult(replica_id, num_pages, num_pages_present=num_local, error=error)
            num_copied, _ = await self._call(lambda: import_pages(num_local, pages))
        finally:
            self._submit(lambda: self._leave(participant))  # no-op once imported
            if fetch_plan is not None:
                run_deferred(segment.fetch for segment in fetch_plan.segments if segment.fetch is not None)
        error = None
        if num_local + num_copied < num_pages:
            error = f"{num_pages - num_local - num_copied} page(s) not copied (peer lacked them or no room)"
        return PrefetchResult(replica_id, num_pages, num_pages_present=num_local, num_pages_copied=num_copied,
                              error=error)

    def drain_kv_events(self) -> list[KVEvent]:
        events = []
        while self._kv_events:
            events.append(self._kv_events.popleft())
        return events

    async def reset_prefix_cache(self) -> bool:
        return await self._call(self.engine.reset_prefix_cache)

    async def pin_prefix(self, pin) -> tuple[int, int]:
        return await self._call(lambda: self.engine.pin_prefix(pin))

    async def unpin_prefix(self, prefix_id: str) -> bool:
        return await self._call(lambda: self.engine.unpin_prefix(prefix_id))

    async def take_back_pin(self, prefix_id: str, pin_id: str = "") -> bool:
        return await self._call(lambda: self.engine.take_back_pin(prefix_id, pin_id))

    async def prefix_reports(self) -> list:
        """The engine's retained prefixes, each with where the shared tiers hold it (asked on a worker thread, not the
        engine's), without their page keys."""
        reports = await self._call(self.engine.prefix_reports)
        tiers = self.fetcher.tiers if self.fetcher is not None else []

        def with_tiers() -> list:
            return [dataclasses.replace(report, page_keys=(), tiers=tuple(
                (tier.name, *tier.residency(report.page_keys)) for tier in tiers)) for report in reports]

        return await asyncio.to_thread(with_tiers) if reports and tiers else with_tiers()

    async def cached_page_keys(self) -> list[bytes]:
        return await self._call(self.engine.kv.cached_keys)

    async def retained_page_keys(self) -> list[tuple[bytes, int, float]]:
        """(key, priority, seconds left) of the cached pages held under a retention (``KVCacheManager``)."""
        return await self._call(self.engine.kv.retained_keys)

    async def check_integrity(self) -> None:
        """``LLMEngine.check_integrity``, counting the references fetches and plans hold on landing pages."""
        await self._call(lambda: self.engine.check_integrity(
            [landing.page_ids for landing in self._landings] + list(self._holds.values())))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._fetches.abandon_all()
        if self.fetcher is not None:
            self.fetcher.close()
        self._export_pool.shutdown(wait=False, cancel_futures=True)
        if self.engine.runner.shared_pool is not None:
            self.engine.runner.shared_pool.stop_serving_exports()

    # ---- engine thread -------------------------------------------------------------------------------------------
    async def _call(self, fn: Callable):
        """Run ``fn`` on the engine thread between steps and await its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the caller was cancelled before this ran: nobody takes the result
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                future.set_exception(exc)

        with self._calls_lock:
            if self._closed:
                raise EngineDeadError("the engine is shut down")
            self._calls.add(future)
        future.add_done_callback(self._forget_call)
        self._submit(run)
        return await asyncio.wrap_future(future)

    def _forget_call(self, future: concurrent.futures.Future) -> None:
        with self._calls_lock:
            self._calls.discard(future)

    def _submit(self, fn: Callable[[], None]) -> None:
        self._inbox.append(fn)
        self._wake.set()

    def _add(self, plan: AdmissionPlan, fetched: list[PageRecord], participant: object) -> None:
        try:  # in one engine-thread call: the pages are queued (with the request's references) as the fetch is dropped
            self.engine.add(plan, fetched)
        except Exception as exc:  # noqa: BLE001 - reported to the request's caller
            self._deliver(plan.request.request_id, exc)
        finally:
            self._leave(participant)

    def _abandon(self, request_id: str, participant: object) -> None:
        """The caller went away: drop its shares in fetches (they go on for others) and abort it if queued."""
        self._leave(participant)
        self.engine.abort(request_id)

    @property
    def fetches(self) -> FetchRegistry:
        """Shared fetches in flight (engine-thread state: read it from the engine thread, e.g. inside ``_call``)."""
        return self._fetches

    def _run(self) -> None:
        try:
            self._serve()
            self._fail_all(EngineDeadError("the engine shut down"))
        finally:  # however the thread ends: calls queued after its last command, or made from now on, get the error
            with self._calls_lock:
                self._closed = True
                unanswered, self._calls = list(self._calls), set()
            for future in unanswered:
                try:
                    future.set_exception(EngineDeadError("the engine shut down"))
                except concurrent.futures.InvalidStateError:
                    pass  # cancelled by its caller meanwhile

    def _serve(self) -> None:
        while not self._stopped:
            while self._inbox:
                command = self._inbox.popleft()
                try:
                    command()
                except Exception:  # noqa: BLE001 - a failed command (an abort, a fetch's end) must not end the thread
                    logger.exception("an engine-thread command failed; serving on")
                self._kv_events.extend(self.engine.kv.drain_events())  # a command's events precede the next's result
            if not self.engine.has_work():
                self.engine.kv.exports.set_computing(())  # nothing runs (an abort may have ended the computation)
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
                logger.exception("engine step failed; aborting the requests in flight")
                self._fail_all(exc)
                continue
            self._kv_events.extend(self.engine.kv.drain_events())
            self._deliver_step(outputs)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: hand a step's outputs over, in one call per event loop (one wake-up, not one per request)."""
        loop_to_items: dict[asyncio.AbstractEventLoop, list[tuple[RequestSink, RequestOutput]]] = {}
        for output in outputs:
            sink = self._request_to_sink.get(output.request_id)
            if sink is not None:
                loop_to_items.setdefault(sink.loop, []).append((sink, output))
        for loop, items in loop_to_items.items():
            try:
                loop.call_soon_threadsafe(dispatch, items)
            except RuntimeError:
                pass  # the caller's loop is closed; nobody is listening

    def _deliver(self, request_id: str, item) -> None:
        """Engine thread: hand one output or exception to its request."""
        sink = self._request_to_sink.get(request_id)
        if sink is None:
            return
        try:
            sink.loop.call_soon_threadsafe(dispatch, [(sink, item)])
        except RuntimeError:
            pass  # the caller's loop is closed; nobody is listening

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in self.engine.request_ids():
            self.engine.abort(request_id)
            self._deliver(request_id, exc)
        for request_id in list(self._request_to_sink):
            self._deliver(request_id, exc)


def dispatch(items: list[tuple[RequestSink, RequestOutput | BaseException]]) -> None:
    """Event loop: each output to its request's queue, or to its channel's batch of this step (one ``put`` per
    channel); exceptions always to the request's own stream, which its caller watches."""
    channel_to_batch: dict[OutputChannel, list[RequestOutput]] = {}
    for sink, item in items:
        channel = sink.channel
        if channel is None or isinstance(item, BaseException):
            sink.queue.put_nowait(item)
            continue
        channel_to_batch.setdefault(channel, []).append(item)
        if item.finished:
            sink.queue.put_nowait(CHANNEL_DONE)
    for channel, batch in channel_to_batch.items():
        channel.put(batch)


def coalesce_pending(item: RequestOutput, queue: asyncio.Queue) -> RequestOutput:
    """Merge outputs that queued up while the consumer was busy into one (tokens and text concatenated, the latest
    counters and finish state). A slow consumer (a loaded HTTP path) then gets one message per wake-up instead of
    one per engine step; a fast one sees no difference. An exception stays queued and is raised next."""
    while not item.finished and not queue.empty():
        following = queue._queue[0]  # peek: asyncio.Queue has no public peek
        if not isinstance(following, RequestOutput):
            break
        queue.get_nowait()
        item = dataclasses.replace(
            following,
            new_token_ids=item.new_token_ids + following.new_token_ids,
            new_text=item.new_text + following.new_text,
        )
    return item


def build_async_engine(config, peer_client=None) -> AsyncEngine:
    """Load the model, build the engine, and attach the prefix sources the config asks for (peer copy, Redis, disk)."""
    from replica.engine import build_engine
    from replica.kv_sources import build_tiers, page_format_of

    engine = build_engine(config)
    page_format = page_format_of(engine)
    tiers = []
    if engine.enable_prefix_caching:
        tiers = build_tiers(page_format, redis_url=config.redis_url, disk_cache_dir=config.disk_cache_dir,
                            disk_budget_bytes=config.disk_cache_budget_bytes, key_file=config.kv_tier_key_file,
                            redis_timeout_s=config.redis_timeout_s)
    fetcher = PrefixFetcher(
        page_format,
        tiers=tiers,
        peer_client=peer_client if (config.enable_peer_copy and engine.enable_prefix_caching) else None,
        own_replica_id=config.replica_id,
    )
    return AsyncEngine(engine, fetcher)
