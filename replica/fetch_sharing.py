"""Shared prefix fetches: one fetch per missing page on a replica, however many requests want it at once.

When a hot prefix spills over to a second replica, several requests for it arrive there before its pages do. Each
would fetch the same pages from the peer (or, with no peer hint, recompute them), and the scheduler's "compute a
shared prefix once" hold-back cannot help: a request waiting for a fetch has not entered the scheduler yet. So the
engine thread plans every request's missing pages against what is already on its way (``FetchRegistry.plan``)::

    request keys     | k0 | k1 | k2 | k3 | k4 | k5 |
    local cache      | hit|                                      missing = k1..k5
    pending pages         | k1 |                                 fetched by an earlier request, queued, not imported
    fetch in flight            | k2 | k3 |                       started by another request: join it (offset 0)
    new fetch                            | k4 | k5 |             nobody has them: start one, others may join it

A plan is a list of ``Segment``s, in page order; the request's pages are the leading run that the segments deliver
(the first segment that comes back short ends it). A segment stops early at a page a running request is computing
here right now: that page and the rest are left to the scheduler, whose hold-back then waits for the computation.

Lifetime and failure (the registry is engine-thread state; fetches run on the event loop and never raise):

- a ``SharedFetch`` is registered under its keys from the plan that starts it until it is done **and** every request
  that joined it has handed its pages to the scheduler or left (cancelled). While done but still registered, a plan
  joins it and gets its result at once; after that, its pages sit in queued requests (the ``pending`` argument);
- a failed or empty fetch resolves to ``[]``: every request that joined it recomputes those pages;
- a request that leaves (its client went away) only drops its share; the fetch goes on for the others.

The registry holds no torch objects but a fetch's landing pages (replica/landing.py), which it drops when it
unregisters the fetch; the pages themselves (``PageRecord``) are only carried through.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from common.page_keys import PageKey
from replica.landing import LandingPages

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SharedFetch:
    """One fetch of consecutive pages (``keys[i]`` holds ``token_ids[i]``; ``parent_key`` precedes ``keys[0]``).
    ``future`` resolves to the verified leading run of pages found (``list[PageRecord]``), never to an exception."""

    keys: tuple[PageKey, ...]
    token_ids: tuple[tuple[int, ...], ...]
    peer_hint: str | None
    parent_key: PageKey | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    num_participants: int = 0
    """Requests that joined (or started) it and have not yet handed their pages to the scheduler or left."""

    landing: LandingPages | None = None
    """Pool pages reserved for its pages (replica/landing.py); dropped when the fetch is unregistered."""

    deferred: list = field(default_factory=list)
    """Work to run once its pages have served a first token (writing pages copied from a peer to the shared tiers:
    run before, it takes CPU from the prefill waiting for them). Run on the event loop by ``run_deferred``."""

    def run_deferred(self) -> None:
        """Run and forget the deferred work (any participant may call it: it runs once)."""
        while self.deferred:
            work = self.deferred.pop(0)
            try:
                work()
            except Exception:  # noqa: BLE001 - deferred work is a cache write, never a request failure
                logger.exception("deferred work of a prefix fetch failed")

    def resolve(self, pages: list) -> None:
        """Resolve ``future`` to ``pages`` unless it already is (the fetch's end and shutdown may race)."""
        try:
            self.future.set_result(pages)
        except concurrent.futures.InvalidStateError:
            pass


@dataclass(frozen=True)
class Segment:
    """``count`` consecutive pages of a request's missing run: ``fetch``'s result from ``offset`` on, or (``fetch``
    None) ``pages``, ready now."""

    fetch: SharedFetch | None
    offset: int
    count: int
    pages: tuple = ()


@dataclass
class FetchPlan:
    segments: list[Segment]
    new_fetches: list[SharedFetch]
    """Fetches this plan registered: the caller starts them (each must resolve its future, whatever happens)."""

    @property
    def ready(self) -> bool:
        """Nothing to wait for: every segment's pages are at hand."""
        return all(segment.fetch is None for segment in self.segments)


class FetchRegistry:
    """Fetches in flight on one replica, by page key (engine thread only; see the module docstring)."""

    def __init__(self) -> None:
        self._key_to_fetch: dict[PageKey, tuple[SharedFetch, int]] = {}
        self._participant_to_fetches: dict[object, list[SharedFetch]] = {}

    @property
    def num_fetches(self) -> int:
        return len({id(fetch) for fetch, _ in self._key_to_fetch.values()})

    def fetches(self) -> list[SharedFetch]:
        """The registered fetches, each once, in registration order."""
        seen: dict[int, SharedFetch] = {}
        for fetch, _ in self._key_to_fetch.values():
            seen.setdefault(id(fetch), fetch)
        return list(seen.values())

    def plan(self, participant: object, keys: Sequence[PageKey], token_ids: Sequence[Sequence[int]], *,
             parent_key: PageKey | None, peer_hint: str | None, can_fetch: bool,
             pending: Mapping[PageKey, object] = {}, computing: Collection[PageKey] = ()) -> FetchPlan:
        """Plan the missing pages ``keys`` (``token_ids`` per page, ``parent_key`` before ``keys[0]``) of one request,
        known here as ``participant`` (unique per request; ``leave`` ends its shares). ``pending``: verified pages
        queued requests carry, by key. ``computing``: keys running requests are computing here. ``can_fetch``: some
        source could have pages (a peer hint or a shared tier); otherwise only pages already on their way are used."""
        segments: list[Segment] = []
        new: list[SharedFetch] = []
        pos, num_keys = 0, len(keys)
        while pos < num_keys:
            key = keys[pos]
            if key in pending:
                run = []
                while pos < num_keys and keys[pos] in pending:
                    run.append(pending[keys[pos]])
                    pos += 1
                segments.append(Segment(None, 0, len(run), tuple(run)))
                continue
            found = self._key_to_fetch.get(key)
            if found is not None:
                fetch, offset = found
                limit, count = min(len(fetch.keys) - offset, num_keys - pos), 1
                while count < limit and fetch.keys[offset + count] == keys[pos + count]:
                    count += 1  # only as far as the prompts agree: where they part, this request fetches its own
                segments.append(Segment(fetch, offset, count))
                self._join(participant, fetch)
                pos += count
                continue
            if key in computing or not can_fetch:
                break
            end = pos + 1
            while (end < num_keys and keys[end] not in pending and keys[end] not in self._key_to_fetch
                   and keys[end] not in computing):
                end += 1
            fetch = SharedFetch(tuple(keys[pos:end]), tuple(tuple(tokens) for tokens in token_ids[pos:end]),
                                peer_hint, keys[pos - 1] if pos else parent_key)
            for index, fetch_key in enumerate(fetch.keys):
                self._key_to_fetch[fetch_key] = (fetch, index)
            self._join(participant, fetch)
            new.append(fetch)
            segments.append(Segment(fetch, 0, end - pos))
            pos = end
        return FetchPlan(segments, new)

    def leave(self, participant: object) -> None:
        """The request handed its pages to the scheduler, or went away: drop its shares (idempotent)."""
        for fetch in self._participant_to_fetches.pop(participant, ()):
            fetch.num_participants -= 1
            if fetch.num_participants == 0 and fetch.future.done():
                self._unregister(fetch)

    def finished(self, fetch: SharedFetch) -> None:
        """``fetch``'s future is resolved: unregister it if nobody still holds a share."""
        if fetch.num_participants == 0:
            self._unregister(fetch)

    def abandon_all(self) -> None:
        """Shutdown: resolve every unresolved fetch to no pages (nobody waits forever) and forget everything."""
        for fetch in self.fetches():
            fetch.resolve([])
            if fetch.landing is not None:
                fetch.landing.drop()
        self._key_to_fetch.clear()
        self._participant_to_fetches.clear()

    def _join(self, participant: object, fetch: SharedFetch) -> None:
        fetch.num_participants += 1
        self._participant_to_fetches.setdefault(participant, []).append(fetch)

    def _unregister(self, fetch: SharedFetch) -> None:
        for key in fetch.keys:
            found = self._key_to_fetch.get(key)
            if found is not None and found[0] is fetch:
                del self._key_to_fetch[key]
        if fetch.landing is not None:  # every request that joined holds its own references now, or left
            fetch.landing.drop()


def collect_pages(plan: FetchPlan, results: Sequence[Sequence], keys: Sequence[PageKey],
                  token_ids: Sequence[Sequence[int]]) -> list:
    """The request's pages: the leading run the segments delivered (``results[i]``: segment i's fetch result, or
    ignored for a ready segment), each checked against the request's own key and token ids (a page shared from
    another request's fetch must hold this request's tokens too)."""
    pages: list = []
    for segment, result in zip(plan.segments, results):
        got = segment.pages if segment.fetch is None else result[segment.offset : segment.offset + segment.count]
        for page in got:
            index = len(pages)
            if page.key != keys[index] or tuple(page.token_ids) != tuple(token_ids[index]):
                return pages
            pages.append(page)
        if len(got) < segment.count:
            break
    return pages


def run_deferred(fetches) -> None:
    """``SharedFetch.run_deferred`` of each of ``fetches`` (on the event loop)."""
    for fetch in fetches:
        fetch.run_deferred()
