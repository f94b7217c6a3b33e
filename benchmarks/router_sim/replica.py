"""One simulated replica: FCFS continuous batching with chunked prefill, a paged KV pool with a prefix cache (LRU over
unreferenced pages), peer copy on a hint, and the KV events the real engine publishes (common/events.py).

Mirrors replica/scheduler.py where it matters for routing: admission in arrival order while pages and ``max_num_seqs``
allow (the head of the queue blocks when pages run out), the longest cached prefix matched and pinned on admission (all
but the last prompt token), a request whose next page another running request is computing held back (so one prefix is
computed once), pages committed to the cache when computed (prompt pages at the end of its prefill, output pages when
the request ends), and the least recently used unreferenced pages evicted first (a request's tail pages before its
head).

Peer copy mirrors replica/export_index.py too: a request whose hinted peer is computing the next pages it would copy
(a running request there is prefilling them) waits for them, at most ``HOLDER_WAIT_S`` from its first try, while the
requests behind it are admitted; the real holder answers such an export once the pages are computed, within the same
bound. After the bound it copies what the peer holds and computes the rest.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from common.events import PagesRemoved, PagesStored
from common.routing_stats import EXPORT_WAIT_S, MeasuredCosts
from benchmarks.router_sim.costs import CostModel
from replica.cost_meter import StepCostFit

HOLDER_WAIT_S = EXPORT_WAIT_S
"""How long a holder waits for pages it is computing before answering an export (the real replica's bound)."""


def _ewma(previous: float | None, value: float) -> float:
    """The running mean a replica's source meter keeps of a per-page cost (replica/cost_meter.py)."""
    return value if previous is None else previous + 0.3 * (value - previous)


class _Running:
    __slots__ = ("request", "held", "num_private", "prefill_left", "context", "generated", "num_reused")

    def __init__(self, request, held, num_private, prefill_left, context, num_reused):
        self.request = request
        self.held = held
        self.num_private = num_private
        self.prefill_left = prefill_left
        self.context = context
        self.generated = 0
        self.num_reused = num_reused


class SimReplica:
    def __init__(self, number: int, replica_id: str, num_pages: int, cost: CostModel, *,
                 protected_fraction: float = 0.0) -> None:
        """``protected_fraction``: the engine's segmented LRU (replica/page_pool.py, ``--kv-cache-protected-fraction``):
        cached pages that were reused are evicted after those never reused, up to that share of the pages; 0: LRU."""
        self.number = number
        self.replica_id = replica_id
        self.num_pages = num_pages
        self.cost = cost
        self.waiting: deque = deque()
        self.running: list = []
        self.key_to_refs: dict = {}
        self.lru: OrderedDict = OrderedDict()
        """Free cached pages never reused (probation), head = released longest ago: evicted first."""
        self.protected: OrderedDict = OrderedDict()
        """Free cached pages that were reused (a local hit, or copied / fetched for a request): evicted after
        ``lru``."""
        self.reused: set = set()
        self.max_protected = int(num_pages * protected_fraction)
        self.ghosts: OrderedDict = OrderedDict()
        """Keys of the pages evicted last (one pool's worth): computed again, a page enters protected
        (KVCacheManager's ghost list)."""
        self.num_private = 0
        self.computing: set = set()
        self.pending_events: list = []
        self.seq = 0
        self.stepping = False
        self.step_started = 0.0
        self.num_decode_steps = 1
        self.slowdown = 1.0
        """Set by the simulation when replicas share cores: this step runs that many times slower."""
        self.version = 0
        self._chunks: list = []
        self.tier = None
        """The cluster's shared host tier (``sim.SharedTier``), or None."""
        self.num_routed = 0
        self.num_rejected = 0
        self.num_evicted = 0
        self.num_copied_pages = 0
        self.step_fit = StepCostFit()
        """What this replica measures of its own steps, as the real replica's cost meter does (replica/cost_meter.py)."""
        self._decode_run = False
        self.copy_ms_per_page: float | None = None
        """EWMA of the copy time per page it saw (the real replica's source meter)."""
        self.tier_ms_per_page: float | None = None
        """The same for its host-tier fetches (a shared tier: ``cluster.tier``)."""
        self.num_tier_pages = 0
        self.pending_import_ms = 0.0
        """Engine-thread time of proactive copies that landed while it stepped: added to its next step."""
        self.proactive_keys: set = set()
        """Pages a proactive copy put here (hot-prefix replication), while cached."""
        self.num_proactive_hit_pages = 0
        self.num_proactive_hit_requests = 0

    # ---- what the router may read ----------------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def num_free(self) -> int:
        return self.num_pages - len(self.key_to_refs) - self.num_private

    @property
    def num_not_in_use(self) -> int:
        """Free pages as the real engine reports them: empty pages plus cached pages no request holds."""
        return self.num_pages - self.num_private - (len(self.key_to_refs) - len(self.lru) - len(self.protected))

    def active_pages(self) -> int:
        return sum(-(-(run.context) // self.cost.page_size) for run in self.running) + sum(
            -(-request.prompt_len // self.cost.page_size) for request in self.waiting)

    def drain_events(self) -> list:
        events, self.pending_events = self.pending_events, []
        return events

    def leading_cached(self, keys, start: int, limit: int) -> int:
        number = start
        refs = self.key_to_refs
        while number < limit and keys[number] in refs:
            number += 1
        return number - start

    # ---- one engine step -------------------------------------------------------------------------------------------
    def start_step(self, now: float, copy_enabled: bool, cluster) -> float:
        """Admit what fits, schedule one step; returns its duration in seconds (0.0: nothing to do)."""
        import_ms = self._admit(now, copy_enabled, cluster) + self.pending_import_ms
        self.pending_import_ms = 0.0
        if not self.running:
            return 0.0
        cost = self.cost
        budget = cost.max_num_batched_tokens
        num_decode = 0
        sum_context = 0
        for run in self.running:
            if run.prefill_left == 0:
                num_decode += 1
                sum_context += run.context
        budget -= num_decode
        prefill_ms = 0.0
        self._chunks = []
        prefill_tokens, pairs = 0, 0.0
        for run in self.running:
            if budget <= 0:
                break
            if run.prefill_left:
                take = min(run.prefill_left, budget)
                prefill_ms += cost.prefill_chunk_ms(take, run.context)
                self._chunks.append((run, take))
                budget -= take
                prefill_tokens += take
                pairs += take * (run.context + take / 2)

        self.stepping = True
        self.slowdown = 1.0
        self.step_started = now
        if not self._chunks and not import_ms:
            # decode only: nothing changes until a request finishes or one arrives, so run the steps up to the next
            # finish as one event (an arrival cuts it at the step boundary after it: see cut_decode_run)
            self.num_decode_steps = min(run.request.out_len - run.generated for run in self.running)
            self._decode_run = True
            self._decode_coefficients = (cost.step_ms + num_decode * cost.decode_row_ms,
                                         cost.decode_context_us * 1e-3, sum_context, num_decode)
            return self._decode_run_ms(self.num_decode_steps) / 1000.0
        self.num_decode_steps = 1
        self._decode_run = False
        step_ms = cost.step_ms + cost.decode_ms(num_decode, sum_context) + prefill_ms + import_ms
        # the real meter times forward + sampling only (copies happen before the step, on the fetch path)
        self.step_fit.observe((step_ms - import_ms) / 1000.0, prefill_tokens, pairs, num_decode, sum_context)
        return step_ms / 1000.0

    def measured_costs(self) -> MeasuredCosts | None:
        """What a real replica would send in its routing stats: the step fit once 16 steps ran, the copy cost once it
        copied. Decode runs count as one step each (their mean step)."""
        values = {}
        if self.step_fit.num_steps >= 16:
            values.update(zip(("step_ms", "prefill_token_ms", "attention_pair_us", "decode_row_ms"),
                              self.step_fit.coefficients()))
        if self.copy_ms_per_page is not None:
            values["peer_copy_page_ms"] = self.copy_ms_per_page
        if self.tier_ms_per_page is not None:
            values["host_page_ms"] = self.tier_ms_per_page
        return MeasuredCosts(**values) if values else None

    def _decode_run_ms(self, num_steps: int) -> float:
        fixed, per_context, sum_context, num_rows = self._decode_coefficients
        return num_steps * fixed + per_context * (num_steps * sum_context + num_rows * num_steps * (num_steps - 1) / 2)

    def cut_decode_run(self, now: float) -> float | None:
        """A request arrived during a run of decode steps: end the run at the first step boundary at or after ``now``.
        Returns the new end time, or None when the run is a single step (its end event stands)."""
        if self.num_decode_steps <= 1:
            return None
        elapsed_ms = (now - self.step_started) * 1000.0 / self.slowdown
        low, high = 1, self.num_decode_steps
        while low < high:
            middle = (low + high) // 2
            if self._decode_run_ms(middle) >= elapsed_ms:
                high = middle
            else:
                low = middle + 1
        if low == self.num_decode_steps:
            return None
        self.num_decode_steps = low
        return self.step_started + self._decode_run_ms(low) * self.slowdown / 1000.0

    def end_step(self, now: float, cluster) -> None:
        """Apply the step that just ended: decode tokens, finished prefills (first tokens), finished requests."""
        if self._decode_run:
            # a run of decode steps (possibly cut short): its mean step
            num_steps = self.num_decode_steps
            _, _, sum_context, num_rows = self._decode_coefficients
            self.step_fit.observe(self._decode_run_ms(num_steps) / num_steps / 1000.0, 0, 0.0, num_rows,
                                  sum_context + num_rows * (num_steps - 1) / 2)
        chunked = {id(run) for run, _ in self._chunks}
        finished = []
        num_steps = self.num_decode_steps
        for run in self.running:
            if run.prefill_left == 0 and id(run) not in chunked:
                run.generated += num_steps
                run.context += num_steps
                if run.generated >= run.request.out_len:
                    finished.append(run)
        for run, take in self._chunks:
            run.prefill_left -= take
            run.context += take
            if run.prefill_left == 0:
                request = run.request
                request.first_token_s = now
                prompt_pages = request.prompt_len // self.cost.page_size
                self._commit(run, request.final_keys[run.num_reused:prompt_pages])
                self.computing.difference_update(request.page_keys[run.num_reused:prompt_pages])
                run.num_reused = prompt_pages
                run.generated = 1
                if run.generated >= request.out_len:
                    finished.append(run)
        self._chunks = []
        for run in finished:
            self._finish(run, now, cluster)
        self.stepping = False

    # ---- internals -------------------------------------------------------------------------------------------------
    def _admit(self, now: float, copy_enabled: bool, cluster) -> float:
        import_ms = 0.0
        cost = self.cost
        page_size = cost.page_size
        skipped = deque()
        while self.waiting and len(self.running) < cost.max_num_seqs:
            request = self.waiting[0]
            keys = request.page_keys
            limit = (request.prompt_len - 1) // page_size
            local = self.leading_cached(keys, 0, limit)
            if local < limit and keys[local] in self.computing:
                skipped.append(self.waiting.popleft())  # held back: a running request is computing its next page
                continue
            copied = 0
            hint = getattr(request, "peer_hint", None)
            if copy_enabled and hint is not None and hint is not self and local < limit:
                copied = hint.leading_cached(keys, local, limit)
                if local + copied < limit and keys[local + copied] in hint.computing:
                    # the holder is computing the next pages: wait for them (bounded), as the real export does
                    since = request.holder_wait_since
                    if since < 0.0:
                        since = request.holder_wait_since = now
                    if now - since < HOLDER_WAIT_S - 1e-9:
                        skipped.append(self.waiting.popleft())
                        cluster.wait_for_holder(self, hint, since + HOLDER_WAIT_S)
                        continue
            need_new = -(-(request.prompt_len + request.out_len) // page_size) - local
            held = list(keys[:local])
            self._pin(held, reuse=False)  # a reuse only once admitted (the real scheduler acquires after its check)
            if self.num_free < need_new:
                self._evict(need_new - self.num_free)
            if self.num_free < need_new:
                self._unpin(held)
                if not self.running and not skipped:
                    # cannot fit even alone: refuse (the real engine answers with an error)
                    self.waiting.popleft()
                    self.num_rejected += 1
                    cluster.on_rejected(request, self)
                    continue
                break
            self.waiting.popleft()
            self.reused.update(held)
            self.num_private += need_new
            run = _Running(request, held, need_new, request.prompt_len - local * page_size, local * page_size, local)
            request.cached_local = local * page_size
            if self.proactive_keys:
                num_proactive = sum(1 for key in keys[:local] if key in self.proactive_keys)
                self.num_proactive_hit_pages += num_proactive
                self.num_proactive_hit_requests += num_proactive > 0
            import_ms += local * page_size * cost.cached_token_us * 1e-3
            if copied:
                import_ms += self._reuse(run, copied, cost.peer_copy_page_ms)
                self.copy_ms_per_page = _ewma(self.copy_ms_per_page, cost.peer_copy_page_ms)
                request.cached_peer = copied * page_size
                self.num_copied_pages += copied
            # the shared host tier continues the run (the real fetch order: own, peer, host), each page verified
            fetched = self.tier.leading(keys, run.num_reused, limit) if self.tier is not None else 0
            if fetched:
                import_ms += self._reuse(run, fetched, cost.host_tier_page_ms, to_tier=False)
                self.tier_ms_per_page = _ewma(self.tier_ms_per_page, cost.host_tier_page_ms)
                request.cached_tier = fetched * page_size
                self.num_tier_pages += fetched
            self.computing.update(keys[run.num_reused:request.prompt_len // page_size])
            self.running.append(run)
        while skipped:
            self.waiting.appendleft(skipped.pop())
        return import_ms

    def import_prefix(self, keys) -> int:
        """A proactive copy landed: cache the pages of ``keys`` after the leading ones held here, unreferenced (most
        recently used), evicting LRU pages for room, stopping at a page a running request here is computing (the real
        engine plans the copy against its own computation). Returns how many pages were added."""
        num_local = self.leading_cached(keys, 0, len(keys))
        wanted = []
        for key in keys[num_local:]:
            if key in self.computing or key in self.key_to_refs:
                break
            wanted.append(key)
        if not wanted:
            return 0
        held = list(keys[:num_local])
        self._pin(held, reuse=False)  # the prefix's own leading pages are not evicted to make room for its rest
        if self.num_free < len(wanted):
            self._evict(len(wanted) - self.num_free)
        self._unpin(held)
        wanted = wanted[: max(0, self.num_free)]
        if not wanted:
            return 0
        for key in wanted:
            self.key_to_refs[key] = 0
            self.lru[key] = None
        self.proactive_keys.update(wanted)
        self.seq += 1
        self.pending_events.append(PagesStored(self.seq, tuple(wanted)))
        if self.tier is not None:
            self.tier.store(wanted)
        if self.stepping:
            self.pending_import_ms += len(wanted) * self.cost.peer_copy_page_ms
        return len(wanted)

    def _reuse(self, run: _Running, count: int, page_ms: float, to_tier: bool = True) -> float:
        """The next ``count`` prompt pages of ``run`` imported (copied or fetched) instead of computed; their cost."""
        start, page_size = run.num_reused, self.cost.page_size
        keys = run.request.page_keys[start:start + count]
        self._commit(run, keys, to_tier=to_tier)
        self.reused.update(keys)  # the engine protects imported pages like hits
        run.prefill_left -= count * page_size
        run.context += count * page_size
        run.num_reused = start + count
        return count * page_ms

    def _pin(self, keys, reuse: bool = True) -> None:
        refs = self.key_to_refs
        for key in keys:
            count = refs[key]
            if count == 0:
                self._unqueue(key)
            refs[key] = count + 1
        if reuse:
            self.reused.update(keys)

    def _unpin(self, keys) -> None:
        refs = self.key_to_refs
        for key in reversed(keys):
            count = refs[key] - 1
            refs[key] = count
            if count == 0:
                self._queue(key)

    def _note_cached(self, key) -> None:
        """A request cached ``key`` anew: a key evicted lately was needed again, a reuse (KVCacheManager's ghost list;
        a proactive copy, ``import_prefix``, does not count)."""
        if key in self.ghosts:
            del self.ghosts[key]
            self.reused.add(key)

    def _queue(self, key) -> None:
        """A cached page no request holds joins the tail of probation, or of the protected queue when it was reused
        (whose oldest page goes back to probation when it is full), as ``PagePool._queue_free`` does."""
        if key not in self.reused or self.max_protected == 0:
            self.lru[key] = None
            return
        protected = self.protected
        protected[key] = None
        while len(protected) > self.max_protected:
            demoted, _ = protected.popitem(last=False)
            self.reused.discard(demoted)
            self.lru[demoted] = None

    def _unqueue(self, key) -> None:
        if key in self.lru:
            del self.lru[key]
        else:
            del self.protected[key]

    def _commit(self, run: _Running, keys, to_tier: bool = True) -> None:
        """Pages of ``run`` just computed (or copied): into the cache, pinned by ``run``; and into the shared tier,
        when the cluster has one, as the real replica writes computed and copied pages (not those it fetched from the
        tier)."""
        refs = self.key_to_refs
        stored = []
        for key in keys:
            count = refs.get(key)
            if count is None:
                refs[key] = 1
                stored.append(key)
                self._note_cached(key)
            else:  # another request cached it meanwhile: held instead, a reuse (``commit_page``)
                if count == 0:
                    self._unqueue(key)
                refs[key] = count + 1
                self.reused.add(key)
            run.held.append(key)
            run.num_private -= 1
            self.num_private -= 1
        if stored:
            self.seq += 1
            self.pending_events.append(PagesStored(self.seq, tuple(stored)))
        if to_tier and self.tier is not None and keys:
            self.tier.store(keys)

    def _evict(self, num_wanted: int) -> None:
        refs, lru, protected = self.key_to_refs, self.lru, self.protected
        removed = []
        while num_wanted > 0 and (lru or protected):
            key, _ = (lru if lru else protected).popitem(last=False)
            del refs[key]
            self.reused.discard(key)
            removed.append(key)
            num_wanted -= 1
            self.ghosts[key] = None
            if len(self.ghosts) > self.num_pages:
                self.ghosts.popitem(last=False)
        if removed:
            self.num_evicted += len(removed)
            self.proactive_keys.difference_update(removed)
            self.seq += 1
            self.pending_events.append(PagesRemoved(self.seq, tuple(removed)))

    def _finish(self, run: _Running, now: float, cluster) -> None:
        request = run.request
        full_pages = (request.prompt_len + request.out_len) // self.cost.page_size
        self._commit(run, request.final_keys[run.num_reused:full_pages])
        self._unpin(run.held)
        self.num_private -= run.num_private
        self.running.remove(run)
        request.finished_s = now
        cluster.on_finished(request, self)

    def check_integrity(self) -> None:
        assert self.num_private >= 0 and self.num_free >= 0, (self.num_private, self.num_free)
        assert set(self.lru) | set(self.protected) == {key for key, count in self.key_to_refs.items() if count == 0}
        assert not set(self.lru) & set(self.protected) and len(self.protected) <= self.max_protected
        assert all(key in self.reused for key in self.protected)
