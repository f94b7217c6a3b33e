"""The event loop: arrivals are routed by a router (our policy or a baseline) at their arrival time; replicas run
engine steps priced by the cost model; every ``stats_period_s`` each replica's new KV events and its load reach the
router (``PrefixIndex.sync`` with the replica's events, as the Ray adapter does with each routing-stats payload).
For a router that reads measured costs (``prefixserve-measured``) the loads also carry each replica's measured costs
(a fit of its own simulated steps and its copy time per page, as replica/cost_meter.py measures them) and the index
hears each replica's evictions and LRU queue (``note_residency``), as the Ray adapter does.

A router named ``*-replicate`` (routers.py) runs hot-prefix replication beside our policy: the real
``router.replication.HotPrefixPlanner`` sees every request before it is routed (its page keys, which replicas hold
how many of them per the router's index, the policy's loads) and is ticked at each routing-stats period and whenever
it planned a copy, as the ingress's copier does (cluster/hot_prefix.py). A started copy reads the pages the source
holds then and lands on the target ``peer_copy_page_ms`` a page later (``SimReplica.import_prefix``: no compute, LRU
pages evicted for room, nothing past a page the target is computing itself; the import's cost is added to the
target's next step when it is busy, as the real import runs on the engine thread between steps, and costs nothing on
an idle one). A cancelled copy never lands. The result counts the copies and the prompt pages later requests reused
from copied pages.

With ``host_tier_pages`` the replicas share a host tier of that many pages (``SharedTier``: LRU, written with every
page a replica computes or copies, read after a replica's own and copied pages at ``host_tier_page_ms`` a page), and
its stored / removed events reach our router's ``tier_index`` at each sync, as the replicas' ``tiers`` entries do.

Eviction in each replica (``eviction``): "own" (the default) runs every system on its own engine's policy: our
routers on our engine's segmented LRU (``EngineConfig.kv_cache_protected_fraction``, replica/page_pool.py), the
baselines on plain LRU (vLLM's free-block queue and SGLang's radix cache evict least recently used first); "lru" or
"segmented" runs every router on the one policy, to compare the routing rules alone.

Our router prices evictions by its replicas' eviction (``router.policy.eviction_weight_for``), as the deployed router
does.

Modeled TTFT = first-token time - arrival time: queueing for admission, copy time, chunked prefill steps shared with
other requests' decodes and prefills.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.replica import SimReplica
from benchmarks.router_sim.routers import make_router
from benchmarks.router_sim.workloads import Workload
from common.events import MEDIUM_HOST, PagesRemoved, PagesStored
from common.routing_stats import ReplicaLoad, tier_holder_id
from router.index import PrefixIndex
from router.policy import eviction_weight_for
from router.replication import HotPrefixPlanner, StartCopy

_ARRIVAL, _STEP_END, _SYNC, _WAKE, _COPY_DONE = 0, 1, 2, 3, 4


class SharedTier:
    """A host tier every replica reads and writes: ``capacity`` pages, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict = OrderedDict()
        self.events: list = []
        self.seq = 0

    def store(self, keys) -> None:
        stored = []
        for key in keys:
            if key in self.pages:
                self.pages.move_to_end(key)
            else:
                self.pages[key] = None
                stored.append(key)
        if stored:
            self.seq += 1
            self.events.append(PagesStored(self.seq, tuple(stored)))
        removed = []
        while len(self.pages) > self.capacity:
            removed.append(self.pages.popitem(last=False)[0])
        if removed:
            self.seq += 1
            self.events.append(PagesRemoved(self.seq, tuple(removed)))

    def leading(self, keys, start: int, limit: int) -> int:
        """How many of ``keys[start:limit]`` the tier holds in a row (each one touched)."""
        count = 0
        for key in keys[start:limit]:
            if key not in self.pages:
                break
            self.pages.move_to_end(key)
            count += 1
        return count

    def drain_events(self) -> list:
        events, self.events = self.events, []
        return events


class ClusterView:
    """What a router can see (see routers.py)."""

    def __init__(self, replicas: list, page_size: int, clock=None) -> None:
        self.replicas = replicas
        self.num_replicas = len(replicas)
        self.replica_ids = [replica.replica_id for replica in replicas]
        self.number_of = {replica.replica_id: replica.number for replica in replicas}
        self.page_size = page_size
        self.index = PrefixIndex(clock=clock) if clock is not None else PrefixIndex()
        for replica_id in self.replica_ids:
            self.index.add_replica(replica_id)
        self.loads = [ReplicaLoad(r.replica_id, 0, r.num_pages, r.num_pages) for r in replicas]

    def live_queue(self, number: int) -> int:
        return self.replicas[number].num_requests

    def active_pages(self, number: int) -> int:
        return self.replicas[number].active_pages()

    def kv_usage(self, number: int) -> float:
        replica = self.replicas[number]
        return 1.0 - replica.num_free / replica.num_pages


@dataclass
class RunResult:
    workload: str
    router: str
    dp: int
    num_requests: int
    num_rejected: int
    hit_rate: float
    local_hit_rate: float
    ideal_hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    busiest_over_mean: float
    decision_p50_us: float
    decision_p99_us: float
    makespan_s: float
    num_events: int
    reasons: dict = field(default_factory=dict)
    wall_s: float = 0.0
    replication: dict = field(default_factory=dict)
    """With hot-prefix replication: copies started / done / cancelled / failed, pages copied, and the prompt pages
    requests reused from copied pages (``proactive_hit_pages``) and how many requests did."""

    def row(self) -> dict:
        return dict(self.__dict__)


def percentile(values: list, q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[rank]


class Simulation:
    def __init__(self, workload: Workload, router_name: str, dp: int, cost: CostModel, *, seed: int = 0,
                 stats_period_s: float = 0.5, concurrency: int = 0, cores: float = 0.0,
                 policy_kwargs: dict | None = None, host_tier_pages: int = 0, eviction: str = "own") -> None:
        """``concurrency`` > 0: a client that keeps at most that many requests in flight (``prefixserve bench
        --concurrency``; held requests are sent in arrival order, and TTFT counts from the send). ``cores`` > 0: the
        replicas share that many CPU cores: a step that starts while n replicas are stepping runs max(1, n / cores)
        times slower (0: every replica has a core of its own). ``policy_kwargs`` replace our router's PolicyConfig
        fields (default: the cost model's numbers)."""
        self.workload = workload
        self.cost = cost
        self.dp = dp
        self.stats_period_s = stats_period_s
        self.concurrency = concurrency
        self.cores = cores
        self.in_flight = 0
        self.held: list = []
        protected = protected_fraction(eviction, router_name)
        if router_name.startswith("prefixserve") and "eviction_weight" not in (policy_kwargs or {}):
            # ours prices evictions by its replicas' eviction, as the deployed router does (cluster/app.py)
            policy_kwargs = {**(cost.policy_kwargs() if policy_kwargs is None else policy_kwargs),
                             "eviction_weight": eviction_weight_for(protected)}
        self.replicas = [SimReplica(n, f"replica-{n:02d}", workload.num_pages_per_replica, cost,
                                    protected_fraction=protected) for n in range(dp)]
        self.tier = SharedTier(host_tier_pages) if host_tier_pages > 0 else None
        for replica in self.replicas:
            replica.tier = self.tier
        self.view = ClusterView(self.replicas, cost.page_size, clock=lambda: self.now)
        self.router = make_router(router_name, self.view, cost, seed, policy_kwargs)
        self.heap: list = []
        self.counter = 0
        self.decision_s: list = []
        self.reasons: dict = {}
        self.num_done = 0
        self.num_events = 0
        self.now = 0.0
        self.holder_to_waiters: dict = {}
        """Replica number -> replicas with a request waiting for pages it is computing (``wait_for_holder``)."""
        self.wakes: set = set()
        replication = getattr(self.router, "replication", None)
        self.planner = HotPrefixPlanner(replication, clock=lambda: self.now) if replication is not None else None
        self.copies: dict = {}
        """Copy id -> (target replica, the keys it will hold) of each proactive copy on its way."""

    def push(self, at: float, kind: int, payload) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (at, self.counter, kind, payload))

    def run(self) -> RunResult:
        started = time.perf_counter()
        requests = self.workload.all_requests()
        for request in self.workload.first_requests:
            self.push(request.arrival_s, _ARRIVAL, request)
        self.push(self.stats_period_s, _SYNC, None)
        total = len(requests)
        while self.heap:
            at, _, kind, payload = heapq.heappop(self.heap)
            self.now = at
            if kind == _ARRIVAL:
                if self.concurrency > 0 and not getattr(payload, "holds_slot", False):
                    if self.in_flight >= self.concurrency:
                        self.held.append(payload)
                        continue
                    self.in_flight += 1
                payload.arrival_s = at  # sent now (a held request: TTFT counts from its send, as the client's does)
                self._arrive(payload, at)
            elif kind == _STEP_END:
                replica, version = payload
                if version != replica.version:
                    continue  # a decode run cut short by an arrival: its new end event stands instead
                replica.end_step(at, self)
                self._kick(replica, at)
                waiters = self.holder_to_waiters.pop(replica.number, None)
                for waiter in waiters or ():  # pages they wait for may have been committed: try again
                    self._kick(waiter, at)
            elif kind == _WAKE:
                self._kick(payload, at)  # a holder wait's bound passed
            elif kind == _COPY_DONE:
                self._land_copy(payload, at)
            else:
                self._sync()
                if self.planner is not None:
                    self._tick(at)
                if self.num_done < total:
                    self.push(at + self.stats_period_s, _SYNC, None)
        for replica in self.replicas:
            replica.check_integrity()
        return self._result(requests, time.perf_counter() - started)

    # ---- callbacks from replicas -----------------------------------------------------------------------------------
    def on_finished(self, request, replica) -> None:
        self.num_done += 1
        self.router.on_finished(request)
        if self.concurrency > 0:
            if self.held:  # the slot passes to the longest-held request
                waiting = self.held.pop(0)
                waiting.holds_slot = True
                self.push(self.now, _ARRIVAL, waiting)
            else:
                self.in_flight -= 1
        if request.next_turn is not None:
            following = request.next_turn
            following.arrival_s = max(self.now + following.arrival_s, request.arrival_s + following.min_gap_s,
                                      following.not_before_s)
            self.push(following.arrival_s, _ARRIVAL, following)

    def wait_for_holder(self, replica, holder, deadline: float) -> None:
        """``replica`` holds a request back for pages ``holder`` is computing: try it again after each of the holder's
        steps, and at ``deadline`` (when it stops waiting)."""
        self.holder_to_waiters.setdefault(holder.number, set()).add(replica)
        wake = (replica.number, deadline)
        if wake not in self.wakes:
            self.wakes.add(wake)
            self.push(deadline, _WAKE, replica)

    def on_rejected(self, request, replica) -> None:
        request.finished_s = self.now
        self.on_finished(request, replica)

    # ---- internals -------------------------------------------------------------------------------------------------
    def _arrive(self, request, now: float) -> None:
        if self.planner is not None:  # before the decision, as the Ray adapter observes before ``choose``
            self._observe(request, now)
        began = time.perf_counter()
        number, hint, reason = self.router.route(request, now)
        self.decision_s.append(time.perf_counter() - began)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        replica = self.replicas[number]
        request.routed_s = now
        request.replica = number
        request.reason = reason
        request.peer_hint = self.replicas[hint] if hint is not None else None
        replica.num_routed += 1
        replica.waiting.append(request)
        self._kick(replica, now)

    # ---- hot-prefix replication (the module docstring) ---------------------------------------------------------------
    def _observe(self, request, now: float) -> None:
        keys = request.page_keys[: self.planner.config.max_prefix_pages]
        if not keys:
            return
        policy = self.router.policy
        matched = self.view.index.longest_prefix(keys, self.view.replica_ids)
        loads = {load.replica_id: policy.effective_load(load) for load in self.view.loads}
        # the keys stand in for the token ids: a simulated target copies by key
        if self.planner.observe(keys, keys, None, matched, loads, now=now):
            self._tick(now)

    def _tick(self, now: float) -> None:
        for action in self.planner.tick(now):
            if not isinstance(action, StartCopy):
                self.copies.pop(action.copy_id, None)  # cancelled: its pages never land
                continue
            target = self.replicas[self.view.number_of[action.target]]
            source = self.replicas[self.view.number_of[action.source]]
            keys = list(action.token_ids[: action.num_pages])
            num_local = target.leading_cached(keys, 0, len(keys))
            num_copied = source.leading_cached(keys, num_local, len(keys))
            if num_copied == 0:
                self.planner.report_failed(action.copy_id, now)
                continue
            self.copies[action.copy_id] = (target, keys[: num_local + num_copied])
            self.push(now + num_copied * self.cost.peer_copy_page_ms / 1000.0, _COPY_DONE, action.copy_id)

    def _land_copy(self, copy_id: str, now: float) -> None:
        entry = self.copies.pop(copy_id, None)
        if entry is None:
            return  # cancelled on the way
        target, keys = entry
        num_imported = target.import_prefix(keys)
        if num_imported and target.stepping:
            self._kick(target, now)  # a run of decode steps ends at the next step, which pays for the import
        if num_imported or target.leading_cached(keys, 0, len(keys)) == len(keys):
            self.planner.report_done(copy_id, num_imported, now)
        else:
            self.planner.report_failed(copy_id, now)

    def _kick(self, replica: SimReplica, now: float) -> None:
        if replica.stepping:
            cut_at = replica.cut_decode_run(now)
            if cut_at is not None:
                replica.version += 1
                self.push(cut_at, _STEP_END, (replica, replica.version))
            return
        duration = replica.start_step(now, self.router.copy_enabled, self)
        if replica.stepping and self.cores > 0:
            stepping = sum(1 for other in self.replicas if other.stepping)
            replica.slowdown = max(1.0, stepping / self.cores)
            duration *= replica.slowdown
        if replica.stepping:
            replica.version += 1
            self.push(now + duration, _STEP_END, (replica, replica.version))

    def _sync(self) -> None:
        index = self.view.index
        loads = self.view.loads
        measured = getattr(self.router, "uses_measured_costs", False)
        residency = getattr(self.router, "uses_residency", False)
        for replica in self.replicas:
            if residency:  # before the events, as the Ray adapter does
                index.note_residency(replica.replica_id, num_evictions=replica.num_evicted,
                                     num_lru_pages=replica.num_not_in_use)
            events = replica.drain_events()
            if events:
                self.num_events += len(events)
                if self.router.uses_index:
                    index.sync(replica.replica_id, epoch="sim", events=events)
            loads[replica.number] = ReplicaLoad(replica.replica_id, replica.num_requests, replica.num_not_in_use,
                                                replica.num_pages,
                                                costs=replica.measured_costs() if measured else None)
        if self.tier is not None:
            events = self.tier.drain_events()
            policy = getattr(self.router, "policy", None)
            if events and policy is not None:  # one pseudo-holder for the whole tier (the union of the replicas')
                policy.tier_index.sync(tier_holder_id("tier", MEDIUM_HOST), epoch="sim", events=events)

    def _result(self, requests: list, wall_s: float) -> RunResult:
        page_size = self.cost.page_size
        served = [r for r in requests if r.first_token_s >= 0]
        prompt_tokens = sum(r.prompt_len for r in requests)
        cached = sum(r.cached_local + r.cached_peer + r.cached_tier for r in served)
        local = sum(r.cached_local for r in served)
        ideal = sum(r.ideal_cached_pages * page_size for r in requests)
        ttfts = [r.first_token_s - r.arrival_s for r in served]
        routed = [replica.num_routed for replica in self.replicas]
        mean_routed = sum(routed) / len(routed)
        return RunResult(
            workload=self.workload.name, router=self.router.name, dp=self.dp, num_requests=len(requests),
            num_rejected=sum(replica.num_rejected for replica in self.replicas),
            hit_rate=cached / prompt_tokens, local_hit_rate=local / prompt_tokens, ideal_hit_rate=ideal / prompt_tokens,
            ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
            ttft_mean_s=sum(ttfts) / max(len(ttfts), 1),
            busiest_over_mean=max(routed) / mean_routed if mean_routed else float("nan"),
            decision_p50_us=percentile(self.decision_s, 50) * 1e6,
            decision_p99_us=percentile(self.decision_s, 99) * 1e6,
            makespan_s=max((r.finished_s for r in requests), default=0.0), num_events=self.num_events,
            reasons=dict(sorted(self.reasons.items())), wall_s=wall_s,
            replication=self._replication_counts(),
        )

    def _replication_counts(self) -> dict:
        if self.planner is None:
            return {}
        stats = self.planner.snapshot()
        return {"started": stats.num_started, "done": stats.num_done, "cancelled": stats.num_cancelled,
                "failed": stats.num_failed, "pages_copied": stats.num_pages_copied,
                "proactive_hit_pages": sum(replica.num_proactive_hit_pages for replica in self.replicas),
                "proactive_hit_requests": sum(replica.num_proactive_hit_requests for replica in self.replicas)}


EVICTIONS = ("own", "lru", "segmented")


def protected_fraction(eviction: str, router_name: str) -> float:
    """The replicas' segmented-LRU share for ``router_name`` under ``eviction`` (see the module docstring)."""
    from replica.config import EngineConfig

    if eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
    ours = eviction == "segmented" or (eviction == "own" and router_name.startswith("prefixserve"))
    return EngineConfig.kv_cache_protected_fraction if ours else 0.0


def simulate(workload_name: str, router_name: str, dp: int, *, seed: int = 0, scale: float = 1.0,
             cost: CostModel | None = None, host_tier_pages: int = 0, pool_fraction: float = 1.0,
             eviction: str = "own", **workload_kwargs) -> RunResult:
    """One generated workload (workloads.py) under one router; a trace runs with ``Simulation`` directly.
    ``host_tier_pages`` > 0: the replicas share a host tier of that many pages; ``pool_fraction`` scales each
    replica's page pool (below 1: the workload's prefixes no longer fit in the replicas' caches)."""
    from benchmarks.router_sim.workloads import WORKLOADS

    cost = cost or CostModel()
    workload = WORKLOADS[workload_name](dp, cost, seed=seed, scale=scale, **workload_kwargs)
    if pool_fraction != 1.0:
        workload.num_pages_per_replica = max(1, round(workload.num_pages_per_replica * pool_fraction))
    return Simulation(workload, router_name, dp, cost, seed=seed, host_tier_pages=host_tier_pages,
                      eviction=eviction).run()
