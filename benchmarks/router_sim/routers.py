"""The routers compared: ours (router/policy.py + router/index.py, unchanged code) and baselines, each written here
from its project's documented rule (no code copied). Every router sees the cluster through the same ``view``:

    view.loads            ReplicaLoad per replica as of the last routing-stats period (what our Ray adapter gets)
    view.live_queue(i)    a replica's running + waiting requests now (what Serve's queue-length probe returns)
    view.active_pages(i)  pages of a replica's running and waiting requests now
    view.kv_usage(i)      fraction of a replica's pages not free now
    view.index            a PrefixIndex fed by the replicas' KV events every period (our index; also what llm-d's
                          precise prefix scorer and Dynamo's KvIndexer are built from)

    round-robin           next replica in turn
    pow2                  two replicas at random, the shorter live queue (Ray Serve's default router)
    sglang-cache-aware    sgl-router cache_aware: imbalanced when max-min load > 64 and max > 1.5 x min (load = the
                          router's own running-request counts) -> least loaded; else the replica whose approximate
                          tree (the prompts the router sent it) matches the most, if that match is > 0.3 of the prompt,
                          else the replica with the smallest tree; the prompt is inserted into the chosen tree
    llmd-scorers          llm-d inference scheduler default profile: score = 3 x prefix (matched pages / prompt pages,
                          from KV events) + 2 x KV utilisation (1 - used fraction) + 2 x queue ((max - q) / (max - min)
                          over the candidates, 1 when all equal); max score, ties at random
    ray-prefix            Ray's PrefixCacheAffinityRouter: imbalanced when max - min live queue > 10 -> power of two;
                          else the replicas whose tree (prompts sent to them) matches the most, if the match rate is
                          >= 0.1, else the replicas with the smallest trees; of those, two at random, the shorter queue;
                          the prompt is inserted into the chosen tree
    dynamo-cost           Dynamo KV router: cost = 1.0 x prefill blocks (prompt blocks - overlap blocks, from KV events)
                          + decode blocks (the replica's active blocks); least cost, ties at random

Prefix matches are page-granular here (the approximate trees of SGLang and Ray match characters; page-level matching
can only help them). Only our router sends peer hints: the baselines' systems have no cross-replica copy.
"""

from __future__ import annotations

import functools
import random
import time

from benchmarks.router_sim.costs import CostModel
from benchmarks.router_sim.workloads import segment_partial_key
from router.index import PrefixIndex
from router.policy import PolicyConfig, PrefixAwarePolicy
from router.replication import ReplicationConfig
from common.events import PagesStored


class Router:
    name = "router"
    uses_index = False
    copy_enabled = False

    def __init__(self, view, seed: int = 0) -> None:
        self.view = view
        self.rng = random.Random(f"{self.name}/{seed}")

    def route(self, request, now: float) -> tuple:
        """(replica number, peer hint replica number or None, reason)"""
        raise NotImplementedError

    def on_finished(self, request) -> None:
        pass


class Ours(Router):
    name = "prefixserve"
    uses_index = True
    copy_enabled = True

    def __init__(self, view, seed: int = 0, **config) -> None:
        super().__init__(view, seed)
        self.policy = PrefixAwarePolicy(view.index, PolicyConfig(**config))
        self.copy_enabled = self.policy.config.enable_peer_hint
        self.id_to_number = {replica_id: number for number, replica_id in enumerate(view.replica_ids)}

    def route(self, request, now):
        partial_key = self.partial_key_of(request)
        decision = self.policy.choose(request.page_keys, self.view.loads, num_prompt_tokens=request.prompt_len,
                                      now=now, partial_key=partial_key)
        self.policy.note_routed(request.request_id, decision.replica_id, request.page_keys,
                                num_prompt_tokens=request.prompt_len, partial_key=partial_key)
        hint = self.id_to_number[decision.peer_hint] if decision.peer_hint is not None else None
        return self.id_to_number[decision.replica_id], hint, decision.reason.value

    def on_finished(self, request):
        self.policy.note_finished(request.request_id)

    def partial_key_of(self, request):
        """The request's partial page keys from its segments (what the Ray adapter gets from its token ids), or None
        for a request without segments (a trace)."""
        if not request.segments:
            return None
        return functools.partial(segment_partial_key, request.segments, request.page_keys, request.prompt_len,
                                 self.view.page_size)


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self, view, seed=0):
        super().__init__(view, seed)
        self.next = 0

    def route(self, request, now):
        number = self.next
        self.next = (number + 1) % self.view.num_replicas
        return number, None, "turn"


class PowerOfTwo(Router):
    name = "pow2"

    def route(self, request, now):
        return self.pick_two(range(self.view.num_replicas)), None, "pow2"

    def pick_two(self, numbers) -> int:
        numbers = list(numbers)
        if len(numbers) == 1:
            return numbers[0]
        a, b = self.rng.sample(numbers, 2)
        return a if self.view.live_queue(a) <= self.view.live_queue(b) else b


class _RoutedTrees:
    """Per-replica approximate trees: the prompts a router sent each replica (page-granular), blind to evictions."""

    def __init__(self, view):
        self.tree = PrefixIndex()
        self.view = view
        self.seq = [0] * view.num_replicas
        for replica_id in view.replica_ids:
            self.tree.add_replica(replica_id)

    def match(self, keys) -> dict:
        return {self.view.number_of[r]: n for r, n in self.tree.longest_prefix(keys).items()}

    def size(self, number: int) -> int:
        return self.tree.num_keys(self.view.replica_ids[number])

    def insert(self, number: int, keys) -> None:
        self.seq[number] += 1
        self.tree.apply_events(self.view.replica_ids[number], [PagesStored(self.seq[number], tuple(keys))])


class SGLangCacheAware(Router):
    name = "sglang-cache-aware"

    def __init__(self, view, seed=0, cache_threshold=0.3, balance_abs=64, balance_rel=1.5):
        super().__init__(view, seed)
        self.trees = _RoutedTrees(view)
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.running = [0] * view.num_replicas
        self.request_to_number: dict = {}

    def route(self, request, now):
        loads = self.running
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs and high > self.balance_rel * low:
            number, reason = min(range(len(loads)), key=loads.__getitem__), "imbalanced"
        else:
            matches = self.trees.match(request.page_keys)
            best = max(matches, key=lambda n: (matches[n], -loads[n]), default=None)
            rate = matches[best] * self.view.page_size / request.prompt_len if best is not None else 0.0
            if rate > self.cache_threshold:
                number, reason = best, "cache_hit"
            else:
                number = min(range(len(loads)), key=lambda n: (self.trees.size(n), loads[n]))
                reason = "smallest_tree"
        self.trees.insert(number, request.page_keys)
        self.running[number] += 1
        self.request_to_number[request.request_id] = number
        return number, None, reason

    def on_finished(self, request):
        self.running[self.request_to_number.pop(request.request_id)] -= 1


class LlmdScorers(Router):
    name = "llmd-scorers"
    uses_index = True

    def route(self, request, now):
        view = self.view
        matches = view.index.longest_prefix(request.page_keys)
        num_pages = max(len(request.page_keys), 1)
        queues = [view.live_queue(n) for n in range(view.num_replicas)]
        high, low = max(queues), min(queues)
        best, best_numbers = None, []
        for number in range(view.num_replicas):
            prefix = matches.get(view.replica_ids[number], 0) / num_pages
            queue = 1.0 if high == low else (high - queues[number]) / (high - low)
            score = 3 * prefix + 2 * (1.0 - view.kv_usage(number)) + 2 * queue
            if best is None or score > best + 1e-12:
                best, best_numbers = score, [number]
            elif abs(score - best) <= 1e-12:
                best_numbers.append(number)
        return self.rng.choice(best_numbers), None, "max_score"


class RayPrefixAffinity(PowerOfTwo):
    name = "ray-prefix"

    def __init__(self, view, seed=0, imbalanced_threshold=10, match_rate_threshold=0.1):
        super().__init__(view, seed)
        self.trees = _RoutedTrees(view)
        self.imbalanced_threshold, self.match_rate_threshold = imbalanced_threshold, match_rate_threshold

    def route(self, request, now):
        view = self.view
        queues = [view.live_queue(n) for n in range(view.num_replicas)]
        if max(queues) - min(queues) > self.imbalanced_threshold:
            number, reason = self.pick_two(range(view.num_replicas)), "imbalanced"
        else:
            matches = self.trees.match(request.page_keys)
            top = max(matches.values(), default=0)
            if top * view.page_size / request.prompt_len >= self.match_rate_threshold:
                number, reason = self.pick_two([n for n, m in matches.items() if m == top]), "prefix_match"
            else:
                sizes = [self.trees.size(n) for n in range(view.num_replicas)]
                smallest = min(sizes)
                number = self.pick_two([n for n in range(view.num_replicas) if sizes[n] == smallest])
                reason = "smallest_tenant"
        self.trees.insert(number, request.page_keys)
        return number, None, reason


class DynamoCost(Router):
    name = "dynamo-cost"
    uses_index = True

    def __init__(self, view, seed=0, overlap_weight=1.0):
        super().__init__(view, seed)
        self.overlap_weight = overlap_weight

    def route(self, request, now):
        view = self.view
        matches = view.index.longest_prefix(request.page_keys)
        request_blocks = request.prompt_len / view.page_size
        best, best_numbers = None, []
        for number in range(view.num_replicas):
            overlap = matches.get(view.replica_ids[number], 0)
            cost = self.overlap_weight * (request_blocks - overlap) + view.active_pages(number) + request_blocks
            if best is None or cost < best - 1e-9:
                best, best_numbers = cost, [number]
            elif abs(cost - best) <= 1e-9:
                best_numbers.append(number)
        return self.rng.choice(best_numbers), None, "least_cost"


def make_router(name: str, view, cost: CostModel, seed: int = 0, policy_kwargs: dict | None = None) -> Router:
    """``policy_kwargs``: our router's PolicyConfig fields (default: the cost model's numbers)."""
    config = dict(cost.policy_kwargs() if policy_kwargs is None else policy_kwargs)
    if name == "prefixserve":
        return Ours(view, seed, **config)
    if name == "prefixserve-replicate":
        # ours with hot-prefix replication on (router/replication.py, ReplicationConfig's defaults: the ingress's
        # --enable-hot-prefix-replication); the simulation runs the planner (sim.py). Not in ROUTERS (the published
        # rules and ours as deployed): name it in --routers
        router = Ours(view, seed, **config)
        router.name = name
        router.replication = ReplicationConfig()
        return router
    if name == "prefixserve-affinity":
        router = Ours(view, seed, **{**config, "enable_cost_model": False})
        router.name = name
        return router
    measured_variants = {
        # the router as deployed now: PolicyConfig's defaults (not the simulator's numbers) until the replicas'
        # measured costs arrive, and the replicas' eviction reports for residency ahead
        "prefixserve-measured": {},
        # the same, pricing the pages the shared tier holds as fetches (--route-on-tier-contents); without it the
        # tier still serves fetches, and the router prices those pages as recomputed
        "prefixserve-tier": {"enable_tier_routing": True},
        # the same, with residency aging on (PolicyConfig.enable_residency_aging)
        "prefixserve-residency": {"enable_residency_aging": True},
        # peer copy off (--no-enable-dp-cross-replica-prefix-copy): another replica's pages come only through the
        # shared tier; blind to the tier's contents, and pricing them
        "prefixserve-measured-nocopy": {"enable_peer_hint": False},
        "prefixserve-tier-nocopy": {"enable_peer_hint": False, "enable_tier_routing": True},
    }
    if name in measured_variants:
        router = Ours(view, seed, page_size=cost.page_size, max_num_batched_tokens=cost.max_num_batched_tokens,
                      **measured_variants[name])
        router.name = name
        router.uses_measured_costs = True
        router.uses_residency = True
        return router
    if name == "prefixserve-defaults":
        # the cost model with PolicyConfig's defaults only (what the router had before replicas measured anything)
        router = Ours(view, seed, page_size=cost.page_size, max_num_batched_tokens=cost.max_num_batched_tokens)
        router.name = name
        return router
    if name == "prefixserve-nocopy":
        router = Ours(view, seed, **{**config, "enable_peer_hint": False})
        router.name = name
        return router
    if name == "prefixserve-nowait":
        # the cost model without pricing a wait for a holder still computing the pages (holder_wait_s 0): a
        # candidate that would start before the holder is done is priced as recomputing them
        router = Ours(view, seed, **{**config, "holder_wait_s": 0.0})
        router.name = name
        return router
    classes = {cls.name: cls for cls in (RoundRobin, PowerOfTwo, SGLangCacheAware, LlmdScorers, RayPrefixAffinity,
                                         DynamoCost)}
    return classes[name](view, seed)


ROUTERS = ("prefixserve", "prefixserve-affinity", "round-robin", "pow2", "sglang-cache-aware", "llmd-scorers",
           "ray-prefix", "dynamo-cost")
