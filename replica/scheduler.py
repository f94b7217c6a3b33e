"""Scheduler: FCFS continuous batching with chunked prefill under a token budget and preemption by recompute.

Each ``schedule()`` builds one engine step:

1. Running requests, oldest first, get the tokens they still need (1 for a decode, the rest of the prompt or a chunk
   of it for a prefill) while the step's token budget lasts. A request that needs a page when none is free preempts the
   newest running request (its pages are released and it goes back to the front of the waiting queue to be recomputed;
   its cached pages usually survive and are hit again).
2. Waiting requests, in arrival order, are admitted while the budget, ``max_num_seqs`` and free pages allow. On
   admission the longest cached prefix is matched (at most all but the last prompt token: one token is always computed
   to produce logits) and pinned. A waiting request whose next page is being computed right now by a running request
   is held back a step, so that concurrent requests with one prefix share one copy instead of computing it twice; the
   same for a page another request imports (fetched from a peer or a tier) in this step: it is a local hit next step.
   Running requests are never preempted to admit waiting ones.

Retention (priority + TTL) never changes these decisions: a retained page that no request holds is a free page
(``num_free_pages`` counts it) that the pool evicts last, so pins cannot starve running requests or deadlock the
queue; a request whose retained prefix alone exceeds the replica's retention budget is refused at ``plan`` time. The
scheduler gives a request's retention to its hit pages on admission and to its new pages as they are committed.

The scheduler never touches the free queue; it asks the ``KVCacheManager``. It never writes model memory either: pages
fetched from outside the replica that an admitted request uses are listed in ``SchedulerOutput.imports`` and the
engine writes them into their pool pages before the step runs. A page a tier load already decrypted into the pool (a
landing page, replica/landing.py) goes into the request's page table as it is; the request's references on landing
pages it does not use (its local hit grew meanwhile) go back on admission, and all of them if it is aborted while
queued. When pages run short (the head of the queue does not fit, or a running request needs a page) the queued
requests' landing pages are taken back first: their KV is copied out and imported later like any fetched page.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from common.page_keys import PageKey
from common.types import CacheSource
from replica.kv_manager import KVCacheManager
from replica.landing import landing_page_ids
from replica.page_record import PageRecord
from replica.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed this step: [seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens)."""


@dataclass(frozen=True)
class CommittedPage:
    """A page computed this step that entered the prefix cache."""

    page_id: int
    key: PageKey
    token_ids: tuple[int, ...]
    salted: bool = False
    """Page 0 of a chain that folds in a cache salt (the KV events say so: ``("salted",)``)."""


@dataclass(frozen=True)
class PageImport:
    """A fetched page to write into the pool page ``seq.page_ids[page_index]`` (already there when that is the page's
    ``landing_page``) and commit to the prefix cache."""

    seq: Sequence
    page_index: int
    page: PageRecord


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    imports: list[PageImport] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)


def num_reusable_pages(num_tokens: int, page_size: int) -> int:
    """Leading full pages a request may take from a cache: all but the last token (which is computed for logits)."""
    return (num_tokens - 1) // page_size


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        model_fingerprint: str,
    ) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model_fingerprint = model_fingerprint
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_queried = 0
        self.num_prompt_tokens_hit = 0
        self.num_prompt_tokens_hit_local = 0  # of those, found in this replica's own pages
        self.num_landing_pages_detached = 0  # landing pages taken back from queued requests (``_detach_landing``)

    # ---- queues --------------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a request (finished or aborted) and release its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.kv.release(landing_page_ids(seq.fetched))  # its references on fetched pages it never imported
            seq.fetched = ()
        self.kv.release(seq.page_ids)
        seq.page_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- one step ------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            num_pages_needed = self._num_pages_needed(seq, num_new)
            while num_pages_needed > self.kv.num_free_pages:
                if self._detach_landing():
                    continue  # pages queued requests held for fetched KV: taken back before preempting anyone
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            seq.page_ids.extend(self.kv.allocate(num_pages_needed))
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        in_flight_keys = self.in_flight_keys()
        imported_keys: set[PageKey] = set()  # pages admitted requests import this step: cached (a local hit) next step
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            page_keys = self._page_keys(seq)
            max_match = num_reusable_pages(seq.num_tokens, self.page_size)
            hit_page_ids = self.kv.match_prefix(page_keys[:max_match])
            imported = self._usable_fetched(seq, len(hit_page_ids), max_match)
            next_index = len(hit_page_ids) + len(imported)
            next_key = page_keys[next_index] if next_index < min(max_match, len(page_keys)) else None
            if ((imported and imported[0].key in imported_keys)
                    or (next_key is not None and (next_key in in_flight_keys or next_key in imported_keys))):
                deferred.append(self.waiting.popleft())
                continue
            num_cached_pages = len(hit_page_ids) + len(imported)
            num_computed = num_cached_pages * self.page_size
            num_new = min(seq.num_tokens - num_computed, budget)
            num_pages_total = -(-(num_computed + num_new) // self.page_size)
            num_landed = sum(page.landing_page is not None for page in imported)  # in the pool (landing.py)
            num_pages_needed = num_pages_total - len(hit_page_ids) - num_landed
            if num_pages_needed > self.kv.num_free_after_acquiring(hit_page_ids):
                if self._detach_landing():
                    continue  # the same request again, with the pages queued requests held for fetched KV back
                break
            self.waiting.popleft()
            # a preempted request re-admitted matches pages it computed itself: not a reuse (only its first admission
            # counts)
            self.kv.acquire(hit_page_ids, reuse=seq.num_cached_prompt_tokens is None)
            new_page_ids = self.kv.allocate(num_pages_needed)
            # an imported landing page takes its place in the page table (the request's reference on it becomes the
            # page's); the references on fetched pages it does not use go back
            adopted = {id(page) for page in imported if page.landing_page is not None}
            self.kv.release([page.landing_page for page in seq.fetched
                             if page.landing_page is not None and id(page) not in adopted])
            fresh = iter(new_page_ids)
            seq.page_ids = (hit_page_ids
                            + [page.landing_page if id(page) in adopted else next(fresh) for page in imported]
                            + list(fresh))
            out.imports.extend(PageImport(seq, len(hit_page_ids) + offset, page) for offset, page in enumerate(imported))
            seq.num_computed_tokens = num_computed
            seq.num_committed_pages = num_cached_pages
            if seq.num_cached_prompt_tokens is None:
                seq.num_cached_prompt_tokens = num_computed
                seq.cached_by_source = {CacheSource.LOCAL: len(hit_page_ids) * self.page_size}
                for page in imported:
                    seq.cached_by_source[page.source] = seq.cached_by_source.get(page.source, 0) + self.page_size
                self.num_prompt_tokens_queried += seq.num_prompt_tokens
                self.num_prompt_tokens_hit += num_computed
                self.num_prompt_tokens_hit_local += min(num_computed, len(hit_page_ids) * self.page_size)
                self.kv.observe_local_hit(page_keys[: len(hit_page_ids)])
                self.kv.registry.observe_request(page_keys[:max_match], num_cached_pages)
                if seq.retention is not None and seq.num_retained_pages:
                    self.kv.registry.add(page_keys[: seq.num_retained_pages], priority=seq.retention.priority,
                                         ttl_s=seq.retention.ttl_s, source="request")
            self.retain_pages(seq, hit_page_ids)
            seq.fetched = ()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            in_flight_keys.update(page_keys[num_cached_pages:])
            imported_keys.update(page.key for page in imported)
        self.waiting.extendleft(reversed(deferred))

    def _detach_landing(self) -> bool:
        """Give back the landing pages queued requests hold (replica/landing.py): each record's KV is copied into a
        tensor of its own, which is then imported like any fetched page. Called when the pool runs short: those
        references would otherwise keep pages from the request at the head of the queue (which may need more pages
        than are free while requests behind it hold the rest, with nothing running to free any) or make a running
        request preempt another. True if any reference went back."""
        copies: dict[int, PageRecord] = {}  # by landing page: a record several queued requests share is copied once
        for seq in self.waiting:
            if not any(page.landing_page is not None for page in seq.fetched):
                continue
            fetched = []
            for page in seq.fetched:
                if page.landing_page is not None:
                    if page.landing_page not in copies:
                        copies[page.landing_page] = dataclasses.replace(page, kv=page.kv.clone(), landing_page=None)
                    self.kv.release([page.landing_page])
                    page = copies[page.landing_page]
                fetched.append(page)
            seq.fetched = tuple(fetched)
        if copies:
            self.num_landing_pages_detached += len(copies)
        return bool(copies)

    def _usable_fetched(self, seq: Sequence, num_hit_pages: int, max_match: int) -> list[PageRecord]:
        """The fetched pages that continue the local hit without a gap (the fetcher verified them against the request's
        keys and tokens; the local hit may have grown or shrunk since they were fetched)::

            page index   | 0 | 1 | 2 | 3 | 4 |
            local hit    | x | x |                 num_hit_pages = 2
            fetched          | f1| f2| f3|         first_fetched_index = 1  -> usable: f2, f3
        """
        skip = num_hit_pages - seq.first_fetched_index
        if skip < 0:
            return []
        return list(seq.fetched[skip : skip + max(0, max_match - num_hit_pages)])

    def retain_pages(self, seq: Sequence, page_ids: list[int], first_index: int = 0) -> None:
        """Give the request's retention to those of ``page_ids`` (its pages from ``first_index`` on) that lie in its
        retained prefix."""
        retention = seq.retention
        if retention is None or first_index >= seq.num_retained_pages:
            return
        self.kv.retain(page_ids[: seq.num_retained_pages - first_index], retention.priority, retention.ttl_s)

    def _page_keys(self, seq: Sequence) -> list[PageKey]:
        """Keys of the request's full pages (the prompt's came with the request; later pages are hashed as they fill);
        none with caching off."""
        if not self.kv.enable_prefix_caching:
            return []
        return seq.extend_page_keys(self.page_size, self.model_fingerprint)

    def _num_pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_pages_total = -(-(seq.num_computed_tokens + num_new_tokens) // self.page_size)
        return max(0, num_pages_total - len(seq.page_ids))

    def in_flight_keys(self) -> set:
        """Keys of full pages that running requests are computing but have not committed yet."""
        keys = set()
        for seq in self.running:
            keys.update(seq.page_keys[seq.num_committed_pages :])
        return keys

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.release(seq.page_ids)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        out.chunks[:] = [chunk for chunk in out.chunks if chunk.seq is not seq]

    # ---- after the model ran ------------------------------------------------------------------------------------
    def commit_computed_pages(self, seq: Sequence) -> list[CommittedPage]:
        """Register the request's newly full, computed pages in the prefix cache (deduplicating shared ones).
        Returns the pages that entered the cache (for the shared tiers)."""
        num_full = seq.num_computed_tokens // self.page_size
        if num_full <= seq.num_committed_pages:
            return []
        if not self.kv.enable_prefix_caching:
            seq.num_committed_pages = num_full
            return []
        stored = []
        keys = self._page_keys(seq)
        tokens = seq.token_ids
        for page_index in range(seq.num_committed_pages, num_full):
            start = page_index * self.page_size
            page_tokens = tokens[start : start + self.page_size]
            result = self.kv.commit_page(seq.page_ids[page_index], keys[page_index], page_tokens,
                                         parent_key=keys[page_index - 1] if page_index else None,
                                         salted=seq.cache_salt is not None)
            if not result.deduplicated and result.page_id == seq.page_ids[page_index] and result.newly_cached:
                stored.append(CommittedPage(result.page_id, keys[page_index], tuple(page_tokens),
                                            salted=page_index == 0 and seq.cache_salt is not None))
                if start + self.page_size <= seq.num_prompt_tokens:
                    seq.num_cache_write_tokens += self.page_size
            seq.page_ids[page_index] = result.page_id
            self.retain_pages(seq, [result.page_id], page_index)
        seq.num_committed_pages = num_full
        return stored
