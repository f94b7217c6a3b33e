"""The Ray Serve adapter: ``PrefixAwareRequestRouter`` feeds the prefix index from routing stats and asks the policy.

Ray Serve 2.60 facts this relies on (read from ray/serve/_private/request_router/ and router.py):

- One router instance lives in every process holding a handle to the replica deployment. Serve constructs it, calls
  ``initialize_state(**request_router_kwargs)``, then ``update_replicas`` whenever the controller broadcasts the
  replica set, which it does when a replica joins or leaves *and* when any replica's ``record_routing_stats()`` dict
  changed. So the index is synced from ``RunningReplica.routing_stats`` inside ``update_replicas`` (only for replicas
  whose dict differs from the one last applied); choosing never makes a remote call.
- ``choose_replicas`` returns ranked tiers; Serve tries the first tier (the chosen replica alone), then the next (all
  the others, where Serve itself picks the shortest queue) when a replica rejects at ``max_ongoing_requests``.
- ``pending_request.args`` is the handle call's argument list, a fresh list per request; the replica receives
  ``pending_request.args`` as they are when the request is sent, after ``choose_replicas`` returned. So a request
  object replaced in that list (a copy with ``peer_hint`` set; the caller's object is not mutated) is what the replica
  gets. The hint written there names the replica believed to hold the most leading pages; when that is the chosen
  replica itself the replica must ignore it; it only matters if Serve falls back to another tier. The copy also
  carries that replica's page stream (``peer_stream``) as its routing stats name it, or None: never a stream the
  request came with, so a receiver only ever connects where a replica's own report pointed.
- Replica ids are ``RunningReplica.replica_id.unique_id``; inside a replica the same string is
  ``serve.get_replica_context().replica_id.unique_id``; a replica reaches the peer named by ``peer_hint`` through its
  own deployment's handle (a request carrying ``target_replica`` is routed to exactly that replica; one carrying
  ``avoid_replica``, a request lane's "busy" sent on through the handle, to another one when there is one).
- ``pending_request.args`` holds the ``EngineRequest`` (``generate(request)``), so its ``prompt_token_ids`` give the
  prompt length the cost model needs (``num_prompt_tokens_of``); requests without one fall back to the full pages.
  With its ``page_keys`` they also give its partial page keys (``partial_key_of``), which tell the policy which
  recently finished request a chat's next turn continues (router/policy.py ``PartialKey``).
- Every decision is also added to this process's ``router.decision_metrics.DECISIONS`` (chosen replica, reason),
  which the ingress exports on ``/metrics`` as ``prefixserve_router_decisions_total``.
- ``on_request_completed(replica_id, internal_request_id)`` fires when a sent request finishes, fails or is rejected;
  with the pending request's future (cancelled, or resolved to the replica actually used) it keeps the policy's
  in-flight counts exact.
- Hot-prefix replication: the ingress registers a planner for this deployment in its process
  (``router/replication.py``); the router of that process feeds it every request's page keys, holders and loads
  (``_observe_hot_prefix``) and tells it when a replica leaves. Routers elsewhere (replicas' peer-copy handles) find
  no planner and skip this.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import types
from typing import Any, Callable, List, Mapping, Optional, Sequence

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from common.page_keys import PageKey
from common.types import LaneOpen, OutputChannelRequest, StreamLocation
from router import decision_metrics, local_routers, long_calls
from router.index import PrefixIndex
from router import replication
from router.policy import PartialKey, PolicyConfig, PrefixAwarePolicy, RoutingDecision, token_partial_key
from common.routing_stats import ReplicaLoad, ReplicaReport, RoutingStatsError, parse_routing_stats, tier_holder_id

logger = logging.getLogger(__name__)

DEFAULT_STATS_PERIOD_S = 0.5
DEFAULT_STATS_TIMEOUT_S = 5.0
BUSY_MEMORY_S = 60.0
"""How long the router keeps what a lane request's busy replica held, for the request's next choice (which follows
at once: the ingress sends it on through the handle)."""



class PrefixAwareRequestRouter(RequestRouter):
    """Routes each request to the replica chosen by ``PrefixAwarePolicy``; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configure(PolicyConfig())
        deployment_id = getattr(self, "_deployment_id", None)
        if deployment_id is not None:  # the ingress's request lanes route with it (cluster/request_lanes.py)
            local_routers.register(deployment_id.app_name, deployment_id.name, self)

    def initialize_state(self, **policy_kwargs: Any) -> None:
        """Called by Serve with ``request_router_kwargs``: the fields of ``PolicyConfig``."""
        self._configure(PolicyConfig(**policy_kwargs))

    # ---- state fed by Serve ----------------------------------------------------------------------------------------
    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current_ids = {replica_id_of(replica) for replica in replicas}
        for replica_id in set(self.index.replica_ids()) - current_ids:
            self._forget(replica_id)
        for replica in replicas:
            self.index.add_replica(replica_id_of(replica))
            self._sync_stats(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        request_id = self._serve_id_to_policy_id.get(internal_request_id, internal_request_id)
        counted_on = self.policy.counted_on(request_id)
        if counted_on is not None and counted_on != replica_id.unique_id:
            return  # an attempt a replica refused, completing after Serve sent the request on: that one still counts
        self._serve_id_to_policy_id.pop(internal_request_id, None)
        self.policy.note_finished(request_id, replica_id.unique_id)
        self._request_id_to_future.pop(request_id, None)

    # ---- the decision ----------------------------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        return self._choose(candidate_replicas, pending_request, use_queue_lengths=True)

    def _choose(self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest],
                use_queue_lengths: bool) -> List[List[RunningReplica]]:
        """``choose_replicas``; ``use_queue_lengths``: whether a replica's load may be raised to Serve's queue-length
        cache (``_load_of``), which only requests through the handle keep fresh."""
        if not candidate_replicas:
            return []
        replica_id_to_replica = {replica_id_of(r): r for r in candidate_replicas}
        target = target_replica_of(pending_request)
        if target is not None:
            # a request for one specific replica (peer copy); if it is gone, any replica answers "no pages"
            if self._hot_prefix_planner() is not None:  # pinned requests are demand too
                self._observe_hot_prefix(pending_request, page_keys_of(pending_request),
                                         [self._load_of(r, use_queue_lengths) for r in candidate_replicas])
            if target in replica_id_to_replica:
                if is_output_channel(pending_request):  # no page keys, no hint: just there
                    return [[replica_id_to_replica[target]]]
                self._hint_best_holder(pending_request, target)
                return [[replica_id_to_replica[target]]]
            self._keep_own_hint(pending_request)  # the target left: any replica, with no stream but the router's
            return [list(candidate_replicas)]
        page_keys = page_keys_of(pending_request)
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        avoid = avoided_replica_of(pending_request)
        avoid_matched = 0
        if avoid is not None:
            # It answered "busy" on its lane: another replica when there is one (for as long as Serve retries these
            # tiers: the handle's queue bounds the wait), copying the prefix from it when it holds more. The policy
            # takes this choice as a retry of the lane's (its session moves, none is recorded again); the demand was
            # counted then.
            request_id = lane_request_id(engine_request_of(pending_request)[2])
            others = [r for r in candidate_replicas if replica_id_of(r) != avoid]
            if others:
                candidate_replicas = others
                replica_id_to_replica = {replica_id_of(r): r for r in candidate_replicas}
                # what it held when the lane chose it (the index expects the whole prompt there since)
                avoid_matched = self._busy_matched.get(request_id, (0.0, 0))[1]
        loads = [self._load_of(r, use_queue_lengths) for r in candidate_replicas]
        if avoid is None:
            self._observe_hot_prefix(pending_request, page_keys, loads)
        num_prompt_tokens = num_prompt_tokens_of(pending_request)
        partial_key = partial_key_of(pending_request, self.policy.config.page_size)
        decision = self.policy.choose(page_keys, loads, num_prompt_tokens=num_prompt_tokens, partial_key=partial_key,
                                      request_id=request_id)
        decision_metrics.DECISIONS.add(self._deployment_name(), decision.replica_id, decision.reason.value)
        if isinstance(pending_request, _CallerSent):
            pending_request.matched_pages = decision.matched_pages
        if self.policy.session_events:
            for (replica_id, event), count in self.policy.drain_session_events().items():
                decision_metrics.SESSION_EVENTS.add(self._deployment_name(), replica_id, event, count)
        if pending_request is not None:
            hint = hint_for_request(decision)
            config = self.policy.config
            if (config.enable_peer_hint and decision.peer_hint is None
                    and avoid_matched - decision.matched_pages >= config.min_peer_copy_pages):
                hint = avoid  # the busy replica holds more of the prefix than any candidate: copy it from there
            set_peer_hint(pending_request, hint, self._replica_id_to_stream)
            self._count_inflight(pending_request, decision.replica_id, num_prompt_tokens, partial_key, request_id)
        chosen = replica_id_to_replica[decision.replica_id]
        rest = [r for r in candidate_replicas if r is not chosen]
        return [[chosen], rest] if rest else [[chosen]]

    # ---- requests the caller sends itself (cluster/request_lanes.py) -----------------------------------------------
    def replica_ids(self) -> list[str]:
        """The replicas this router routes among now."""
        return [replica_id_of(replica) for replica in self.curr_replicas.values()]

    async def route_for_lane(self, request: Any) -> tuple[str, Any, Callable[..., None]]:
        """Choose a replica for ``request`` (an ``EngineRequest``) as ``choose_replicas`` does for one sent through the
        handle: the same decision, metrics and peer hint, and the chosen replica counts it in flight until the caller
        calls the answer's ``done()`` (once, when the request ended; ``done(False)`` when it never ran there: a
        "busy", or never sent, after which it goes on through the handle with ``avoid_replica``). Answers the replica
        id, the request to send (a copy carrying the hint) and ``done``. Call on the router's event loop, with at
        least one replica (``replica_ids()``)."""
        pending = _CallerSent(request)
        try:
            # Serve's queue lengths: not here. Serve learns a replica's queue length only from requests through its
            # handle; with lanes those are few, so an entry is the count a pinned request or a "busy" one saw when
            # sent (itself included), kept for seconds after: it pushed a prefix's next request off its holder. The
            # reported loads and this router's own in-flight counts cover lane requests.
            tiers = self._choose(list(self.curr_replicas.values()), pending, use_queue_lengths=False)
        except BaseException:
            pending.future.cancel()  # counted in flight already: stop counting (_on_assigned)
            raise
        chosen = tiers[0][0]
        pending.future.set_result(chosen)  # counted there (_on_assigned), as Serve does when it sends one
        request_id = pending.metadata.internal_request_id

        matched = pending.matched_pages

        def done(ran: bool = True) -> None:
            if not ran:  # sent on through the handle, where _choose reads what this replica held
                self._note_busy(request_id, matched)
            self.policy.note_finished(request_id, chosen.replica_id.unique_id, answered=ran)
            self._request_id_to_future.pop(request_id, None)

        return replica_id_of(chosen), pending.args[0], done

    def _note_busy(self, request_id: str, matched_pages: int) -> None:
        """A lane request its replica answered "busy" for, and the pages that replica held at the lane's choice: the
        request's next choice (through the handle, ``avoid_replica``) reads them. Kept ``BUSY_MEMORY_S``."""
        now = time.monotonic()
        busy = self._busy_matched
        while busy and next(iter(busy.values()))[0] < now - BUSY_MEMORY_S:
            del busy[next(iter(busy))]
        busy[request_id] = (now, matched_pages)

    def _hint_best_holder(self, pending_request: PendingRequest, target: str) -> None:
        """For a pinned request: name the replica holding more of its prefix than the target as peer_hint, with its
        page stream; with none, the request's own hint stays (``_keep_own_hint``)."""
        holder = self.policy.hint_for_pinned(page_keys_of(pending_request), target)
        if holder is None:
            self._keep_own_hint(pending_request)
        else:
            set_peer_hint(pending_request, holder, self._replica_id_to_stream)

    def _keep_own_hint(self, pending_request: PendingRequest) -> None:
        """Keep the peer_hint a request came with (operators, tests, a hot-prefix copy), with the page stream this
        router knows for that replica: never one the request came with."""
        found = hinted_request_of(pending_request)
        if found is not None:
            set_peer_hint(pending_request, found[2].peer_hint, self._replica_id_to_stream)

    def _observe_hot_prefix(self, pending_request: Optional[PendingRequest], page_keys: Sequence[PageKey],
                            loads: List[ReplicaLoad]) -> None:
        """Hot-prefix replication (router/replication.py): count the request's demand in the planner the ingress
        registered for this deployment in this process (none: the feature is off here). Before ``choose``, which
        makes the index expect the chosen replica to hold the keys. Never fails the routing."""
        planner = self._hot_prefix_planner()
        found = engine_request_of(pending_request)
        if planner is None or not page_keys or found is None:
            return
        try:
            request = found[2]
            keys = page_keys[: planner.config.max_prefix_pages]
            matched = self.index.longest_prefix(keys, [load.replica_id for load in loads])
            replica_id_to_load = {load.replica_id: self.policy.effective_load(load) for load in loads}
            planner.observe(keys, request.prompt_token_ids, getattr(request, "cache_salt", None), matched,
                            replica_id_to_load)
        except Exception:  # noqa: BLE001 - replication is an optimisation; routing goes on
            logger.exception("hot-prefix planner failed on a request; routing it anyway")

    def _hot_prefix_planner(self) -> "replication.HotPrefixPlanner | None":
        deployment_id = getattr(self, "_deployment_id", None)
        if deployment_id is None:
            return None
        return replication.planner_for(deployment_id.app_name, deployment_id.name)

    # ---- internals -------------------------------------------------------------------------------------------------
    def _deployment_name(self) -> str:
        deployment_id = getattr(self, "_deployment_id", None)
        return getattr(deployment_id, "name", "") or ""

    def _configure(self, config: PolicyConfig) -> None:
        self.index = PrefixIndex()
        self.policy = PrefixAwarePolicy(self.index, config)
        self._replica_id_to_raw_stats: dict[str, Any] = {}
        self._replica_id_to_load: dict[str, ReplicaLoad] = {}
        self._replica_id_to_stream: dict[str, StreamLocation] = {}
        """Replicas' page streams, as their reports name them: sent along with a peer_hint naming the replica."""
        self._request_id_to_future: dict[str, asyncio.Future] = {}
        self._serve_id_to_policy_id: dict[str, str] = {}
        """Requests the policy knows by another id than Serve's: a lane's "busy" sent on through the handle keeps its
        lane id (``lane_request_id``), the id its session was recorded under."""
        self._busy_matched: dict[str, tuple[float, int]] = {}
        """Lane requests answered "busy": (when, the pages the busy replica held at the lane's choice) by lane id."""

    def _sync_stats(self, replica: RunningReplica) -> None:
        replica_id = replica_id_of(replica)
        raw = replica.routing_stats
        last = self._replica_id_to_raw_stats.get(replica_id)
        if raw is last or raw == last:
            return
        self._replica_id_to_raw_stats[replica_id] = raw
        try:
            report = parse_routing_stats(raw)
        except RoutingStatsError as error:
            logger.warning("ignoring routing stats of replica %s: %s", replica_id, error)
            self._replica_id_to_stream.pop(replica_id, None)
            return
        if report is None:
            self._replica_id_to_stream.pop(replica_id, None)
            return
        if report.replica_id != replica_id:
            logger.warning("replica %s reports itself as %r; indexing it as %s", replica_id, report.replica_id,
                           replica_id)
        apply_residency(self.index, replica_id, report)  # before the events: they count as touched at this report
        self.index.sync(replica_id, epoch=report.epoch, events=report.events, snapshot=report.snapshot)
        for tier in report.tiers:  # the pages this replica stored in the shared tiers (router/policy.py)
            self.policy.tier_index.sync(tier_holder_id(replica_id, tier.medium), epoch=tier.epoch, events=tier.events,
                                        snapshot=tier.snapshot)
        self._replica_id_to_load[replica_id] = dataclasses.replace(report.to_load(), replica_id=replica_id)
        if report.stream is not None:
            self._replica_id_to_stream[replica_id] = report.stream
        else:
            self._replica_id_to_stream.pop(replica_id, None)

    def _load_of(self, replica: RunningReplica, use_queue_lengths: bool = True) -> ReplicaLoad:
        """Reported load, raised to Serve's own queue-length cache entry when that is fresher and higher (less the
        calls of this process that Serve counts as ongoing requests but are no load: router/long_calls.py), unless
        ``use_queue_lengths`` is off."""
        replica_id = replica_id_of(replica)
        reported = self._replica_id_to_load.get(replica_id) or ReplicaLoad(replica_id)
        if not use_queue_lengths:
            return reported
        num_queued = self.replica_queue_len_cache.get(replica.replica_id)
        if num_queued is not None and long_calls.OPEN[replica_id]:
            num_queued -= long_calls.OPEN[replica_id]
        if num_queued is not None and num_queued > reported.num_requests:
            return dataclasses.replace(reported, num_requests=num_queued)
        return reported

    def _count_inflight(self, pending_request: PendingRequest, replica_id: str, num_prompt_tokens: int | None = None,
                        partial_key: PartialKey | None = None, request_id: str | None = None) -> None:
        """Count the request in flight under ``request_id`` (the policy's id of it; default Serve's own)."""
        serve_id = pending_request.metadata.internal_request_id
        request_id = request_id or serve_id
        if request_id != serve_id:  # Serve completes it under its own id (on_request_completed)
            self._serve_id_to_policy_id[serve_id] = request_id
        self.policy.note_routed(request_id, replica_id, page_keys_of(pending_request),
                                num_prompt_tokens=num_prompt_tokens, partial_key=partial_key)
        future = pending_request.future
        if self._request_id_to_future.get(request_id) is not future:
            self._request_id_to_future[request_id] = future
            future.add_done_callback(lambda done, rid=request_id: self._on_assigned(rid, done))

    def _on_assigned(self, request_id: str, future: asyncio.Future) -> None:
        """The pending request got its replica (count it there) or was cancelled before being sent (stop counting)."""
        if self._request_id_to_future.get(request_id) is not future:
            return
        if future.cancelled() or future.exception() is not None:
            self.policy.note_finished(request_id)
            self._request_id_to_future.pop(request_id, None)
            for serve_id in [s for s, policy_id in self._serve_id_to_policy_id.items() if policy_id == request_id]:
                del self._serve_id_to_policy_id[serve_id]
            return
        self.policy.note_routed(request_id, replica_id_of(future.result()))

    def _forget(self, replica_id: str) -> None:
        planner = self._hot_prefix_planner()
        if planner is not None:
            planner.forget_replica(replica_id)
        self.index.remove_replica(replica_id)
        self.policy.forget_replica(replica_id)
        self._replica_id_to_raw_stats.pop(replica_id, None)
        self._replica_id_to_load.pop(replica_id, None)
        self._replica_id_to_stream.pop(replica_id, None)


# ---- small helpers (no Ray state) -----------------------------------------------------------------------------------
def replica_id_of(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


def engine_request_of(pending_request: Optional[PendingRequest]) -> tuple[str, Any, Any] | None:
    """Where the request object is: ("args", 0, obj) or ("kwargs", name, obj); None when no argument has page keys."""
    return _argument_with(pending_request, "page_keys")


def hinted_request_of(pending_request: Optional[PendingRequest]) -> tuple[str, Any, Any] | None:
    """Where the argument naming a peer is (``peer_hint``: an ``EngineRequest``, a ``PrefetchRequest``), as
    ``engine_request_of`` answers; None when no argument has one."""
    return _argument_with(pending_request, "peer_hint")


def _argument_with(pending_request: Optional[PendingRequest], attribute: str) -> tuple[str, Any, Any] | None:
    if pending_request is None:
        return None
    for position, arg in enumerate(pending_request.args):
        if hasattr(arg, attribute):
            return ("args", position, arg)
    for name, arg in pending_request.kwargs.items():
        if hasattr(arg, attribute):
            return ("kwargs", name, arg)
    return None


def num_prompt_tokens_of(pending_request: Optional[PendingRequest]) -> int | None:
    """The prompt length in tokens of the request object (``prompt_token_ids``), or None when it has none."""
    found = engine_request_of(pending_request)
    if found is None:
        return None
    token_ids = getattr(found[2], "prompt_token_ids", None)
    return len(token_ids) if token_ids else None


def partial_key_of(pending_request: Optional[PendingRequest], page_size: int) -> PartialKey | None:
    """The request object's partial page keys from its ``prompt_token_ids`` and ``page_keys`` (router/policy.py
    ``token_partial_key``), or None when it lacks either (or its keys are not of ``page_size``-token pages)."""
    found = engine_request_of(pending_request)
    if found is None:
        return None
    token_ids = getattr(found[2], "prompt_token_ids", None)
    page_keys = getattr(found[2], "page_keys", None)
    if not token_ids or not page_keys:
        return None
    return token_partial_key(page_keys, token_ids, page_size)


def apply_residency(index: PrefixIndex, replica_id: str, report: ReplicaReport) -> None:
    """Feed the index what the report says about how long pages stay: evictions so far, the LRU queue (free pages
    not held under a retention) and the retained pages (router/index.py "Residency ahead")."""
    num_lru_pages = None
    if report.num_evictions is not None:
        num_lru_pages = report.num_pages_free - (report.num_pages_retained or 0)
    index.note_residency(replica_id, epoch=report.epoch, num_evictions=report.num_evictions,
                         num_lru_pages=num_lru_pages, retained=report.retained)


def target_replica_of(pending_request: Optional[PendingRequest]) -> str | None:
    """The replica a request is addressed to (an argument with a ``target_replica`` attribute), or None."""
    if pending_request is None:
        return None
    for arg in list(pending_request.args) + list(pending_request.kwargs.values()):
        target = getattr(arg, "target_replica", None)
        if target:
            return target
    return None


def lane_request_id(request: Any) -> str:
    """The router's id of a request routed for a lane (``route_for_lane``), and of its retry through the handle after
    a "busy" answer (``EngineRequest.avoid_replica``): the policy takes the second choice as a retry of the first.
    Engine request ids are unique per attempt (a resent request gets a new one)."""
    return f"lane-{request.request_id}"


def avoided_replica_of(pending_request: Optional[PendingRequest]) -> str | None:
    """The replica that answered "busy" to this request on its lane (``EngineRequest.avoid_replica``), or None."""
    found = engine_request_of(pending_request)
    return getattr(found[2], "avoid_replica", None) if found is not None else None


def is_output_channel(pending_request: PendingRequest) -> bool:
    """An ``OutputChannelRequest`` or a ``LaneOpen`` (a caller's long-lived output channel or request lane,
    replica/serve_replica.py)."""
    return any(isinstance(arg, (OutputChannelRequest, LaneOpen))
               for arg in list(pending_request.args) + list(pending_request.kwargs.values()))


class _CallerSent:
    """What ``choose_replicas`` reads of a ``PendingRequest``, for a request its caller sends itself
    (``route_for_lane``): its arguments, an id, and a future resolved to the replica it goes to."""

    def __init__(self, request: Any) -> None:
        self.args = [request]
        self.kwargs: dict[str, Any] = {}
        self.metadata = types.SimpleNamespace(internal_request_id=lane_request_id(request))
        self.matched_pages = 0
        """The chosen replica's leading pages at the choice (``_choose``)."""
        self.future = asyncio.get_running_loop().create_future()


def page_keys_of(pending_request: Optional[PendingRequest]) -> Sequence[PageKey]:
    found = engine_request_of(pending_request)
    if found is None:
        return ()
    return found[2].page_keys or ()


def hint_for_request(decision: RoutingDecision) -> str | None:
    """The replica believed to hold the most leading pages (the chosen one itself on a prefix hit), or None."""
    if decision.peer_hint is not None:
        return decision.peer_hint
    return decision.replica_id if decision.matched_pages > 0 else None


def set_peer_hint(pending_request: PendingRequest, peer_hint: str | None,
                  streams: Mapping[str, StreamLocation] | None = None) -> None:
    """Replace the request argument with a copy carrying ``peer_hint`` and that replica's page stream from ``streams``
    (or none: a stream the request came with is never passed on), leaving the caller's object alone."""
    found = hinted_request_of(pending_request)
    if found is None:
        return
    where, position, request = found
    stream = streams.get(peer_hint) if streams and peer_hint is not None else None
    if not dataclasses.is_dataclass(request) or (request.peer_hint == peer_hint
                                                 and request.peer_stream == stream):
        return
    # EngineRequest and PrefetchRequest, the arguments that name a peer, both carry its stream
    updated = dataclasses.replace(request, peer_hint=peer_hint, peer_stream=stream)
    if where == "args":
        pending_request.args[position] = updated
    else:
        pending_request.kwargs[position] = updated


def router_config(
    *,
    balance_abs_threshold: int = PolicyConfig.balance_abs_threshold,
    balance_rel_threshold: float = PolicyConfig.balance_rel_threshold,
    min_peer_copy_pages: int = PolicyConfig.min_peer_copy_pages,
    enable_peer_hint: bool = PolicyConfig.enable_peer_hint,
    enable_cost_model: bool = PolicyConfig.enable_cost_model,
    enable_tier_routing: bool = PolicyConfig.enable_tier_routing,
    enable_residency_aging: bool = PolicyConfig.enable_residency_aging,
    page_size: int = PolicyConfig.page_size,
    max_num_batched_tokens: int = PolicyConfig.max_num_batched_tokens,
    eviction_weight: float = PolicyConfig.eviction_weight,
    session_growth: float = PolicyConfig.session_growth,
    session_start_growth: float = PolicyConfig.session_start_growth,
    session_move_fill: float = PolicyConfig.session_move_fill,
    session_idle_factor: float = PolicyConfig.session_idle_factor,
    stats_period_s: float = DEFAULT_STATS_PERIOD_S,
    stats_timeout_s: float = DEFAULT_STATS_TIMEOUT_S,
) -> RequestRouterConfig:
    """The ``request_router_config`` of the replica deployment (policy thresholds validated here, not in Serve).
    ``page_size`` and ``max_num_batched_tokens`` are the replicas' (``--kv-cache-page-size``,
    ``--max-num-batched-tokens``): the cost model counts tokens per page and per step with them, and a prompt's tail
    (``partial_key_of``) is cut where the replicas' pages end."""
    policy = PolicyConfig(balance_abs_threshold=balance_abs_threshold, balance_rel_threshold=balance_rel_threshold,
                          min_peer_copy_pages=min_peer_copy_pages, enable_peer_hint=enable_peer_hint,
                          enable_cost_model=enable_cost_model, enable_tier_routing=enable_tier_routing,
                          enable_residency_aging=enable_residency_aging,
                          page_size=page_size, max_num_batched_tokens=max_num_batched_tokens,
                          eviction_weight=eviction_weight, session_growth=session_growth,
                          session_start_growth=session_start_growth, session_move_fill=session_move_fill,
                          session_idle_factor=session_idle_factor)
    return RequestRouterConfig(
        request_router_class=PrefixAwareRequestRouter,
        request_router_kwargs=dataclasses.asdict(policy),
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=stats_timeout_s,
    )
