"""PrefixAwareRequestRouter driven the way Serve drives it, with stand-in replicas and no Ray cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from common.events import PagesStored  # noqa: E402
from common.routing_stats import encode_stream  # noqa: E402
from common.types import EngineRequest, EngineStats, PrefetchRequest, StreamLocation  # noqa: E402
from router.policy import PolicyConfig  # noqa: E402
from router.ray_router import PrefixAwareRequestRouter, router_config  # noqa: E402
from replica.event_log import ReplicaEventLog  # noqa: E402

DEPLOYMENT = DeploymentID(name="engine", app_name="prefixserve")


def key(name: str) -> bytes:
    return name.encode().ljust(32, b".")


PROMPT = [key("p0"), key("p1"), key("p2")]


def engine_stats(replica_id: str, num_waiting: int = 0) -> EngineStats:
    return EngineStats(replica_id, 0, 0, 64, 60, 4, 0, 0, 0, 0, num_waiting, 0, 128)


class StandInReplica:
    """The parts of RunningReplica the router touches."""

    max_ongoing_requests = 100

    def __init__(self, unique_id: str) -> None:
        self.replica_id = ReplicaID(unique_id, deployment_id=DEPLOYMENT)
        self.log = ReplicaEventLog(unique_id, epoch=f"epoch-{unique_id}")
        self.cached: list[bytes] = []
        self.routing_stats: dict = {}

    def store(self, keys: list[bytes]) -> None:
        self.cached += keys
        self.log.append([PagesStored(self.log.last_seq + 1, tuple(keys))])

    def publish(self, num_waiting: int = 0) -> None:
        stats = engine_stats(self.replica_id.unique_id, num_waiting)
        self.routing_stats = self.log.stats_payload(stats, lambda: self.cached)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def pending(request: EngineRequest, internal_request_id: str) -> PendingRequest:
    metadata = RequestMetadata(request_id=request.request_id, internal_request_id=internal_request_id)
    return PendingRequest(args=[request], kwargs={}, metadata=metadata)


def make_router(**policy_kwargs) -> PrefixAwareRequestRouter:
    router = PrefixAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**policy_kwargs)
    return router


def holder_and_other() -> tuple[PrefixAwareRequestRouter, StandInReplica, StandInReplica]:
    """A router over replicas "a" (holding ``PROMPT``) and "b" (empty), both reported."""
    router = make_router()
    a, b = StandInReplica("a"), StandInReplica("b")
    a.store(PROMPT)
    for replica in (a, b):
        replica.publish()
    router.update_replicas([a, b])
    return router, a, b


def ids(tiers) -> list[list[str]]:
    return [[replica.replica_id.unique_id for replica in tier] for tier in tiers]


def run(coroutine_fn):
    return asyncio.run(coroutine_fn())


def test_routes_to_holder_then_balances_away_with_peer_hint():
    async def scenario():
        router = make_router()
        a, b = StandInReplica("a"), StandInReplica("b")
        a.store(PROMPT)
        a.publish()
        b.publish()
        router.update_replicas([a, b])
        await asyncio.sleep(0)  # let Serve's queue-length probe task run

        request = EngineRequest("r1", list(range(300)), page_keys=PROMPT)
        first = pending(request, "internal-1")
        assert ids(await router.choose_replicas([a, b], first)) == [["a"], ["b"]]
        assert first.args[0].peer_hint == "a"  # the holder itself: the replica ignores it
        assert request.peer_hint is None  # the caller's object is not mutated

        a.publish(num_waiting=10)
        router.update_replicas([a, b])
        second = pending(EngineRequest("r2", list(range(300)), page_keys=PROMPT), "internal-2")
        assert ids(await router.choose_replicas([a, b], second)) == [["b"], ["a"]]
        assert second.args[0].peer_hint == "a"

    run(scenario)


def test_a_peer_hint_carries_the_holders_page_stream_from_its_stats_and_nothing_else_does():
    a_stream = StreamLocation("10.0.0.1", 4100, b"a" * 32, "node-a")
    forged = StreamLocation("203.0.113.9", 4100, b"f" * 32, "node-x")

    async def scenario():
        router = make_router()
        a, b = StandInReplica("a"), StandInReplica("b")
        pinned_keys, later_keys = [key("s0"), key("s1")], [key("t0"), key("t1")]
        a.store(PROMPT + pinned_keys + later_keys)
        a.publish(num_waiting=10)  # busy: the request goes to b with a as the peer hint
        a.routing_stats["stream"] = encode_stream(a_stream)
        b.publish()
        router.update_replicas([a, b])
        await asyncio.sleep(0)

        request = EngineRequest("r1", list(range(300)), page_keys=PROMPT, peer_stream=forged)
        first = pending(request, "internal-1")
        assert ids(await router.choose_replicas([a, b], first)) == [["b"], ["a"]]
        assert first.args[0].peer_hint == "a" and first.args[0].peer_stream == a_stream
        assert request.peer_stream is forged  # the caller's object is not mutated

        # pinned to b (operators, tests): the best holder and its stream all the same
        pinned = pending(EngineRequest("r2", list(range(300)), page_keys=pinned_keys, target_replica="b"),
                         "internal-2")
        assert ids(await router.choose_replicas([a, b], pinned)) == [["b"]]
        assert pinned.args[0].peer_hint == "a" and pinned.args[0].peer_stream == a_stream

        # a stream the request came with never travels on: no hint, or a holder that names none
        other = [key("q0"), key("q1")]
        alone = pending(EngineRequest("r3", list(range(300)), page_keys=other, peer_stream=forged), "internal-3")
        await router.choose_replicas([a, b], alone)
        assert alone.args[0].peer_hint is None and alone.args[0].peer_stream is None
        # pinned to a replica that left: any replica, with the request's own hint and the router's stream for it
        gone = pending(EngineRequest("r5", list(range(300)), page_keys=other, target_replica="z", peer_hint="a",
                                     peer_stream=forged), "internal-5")
        assert ids(await router.choose_replicas([a, b], gone)) == [["a", "b"]]
        assert gone.args[0].peer_hint == "a" and gone.args[0].peer_stream == a_stream
        lost = pending(EngineRequest("r6", list(range(300)), page_keys=other, target_replica="z", peer_hint="q",
                                     peer_stream=forged), "internal-6")
        await router.choose_replicas([a, b], lost)
        assert lost.args[0].peer_hint == "q" and lost.args[0].peer_stream is None

        # a hot-prefix copy pinned to b from a: a's stream, whatever the request came with
        for stream in (None, forged):
            copy = PrefetchRequest("c1", target_replica="b", peer_hint="a", token_ids=list(range(300)), num_pages=2,
                                   peer_stream=stream)
            prefetch = PendingRequest(args=[copy], kwargs={}, metadata=RequestMetadata(
                request_id="c1", internal_request_id="internal-c1"))
            assert ids(await router.choose_replicas([a, b], prefetch)) == [["b"]]
            assert prefetch.args[0].peer_hint == "a" and prefetch.args[0].peer_stream == a_stream

        a.publish(num_waiting=10)  # a stops serving its stream: its report no longer names one
        router.update_replicas([a, b])
        again = pending(EngineRequest("r4", list(range(300)), page_keys=later_keys, peer_stream=forged),
                        "internal-4")
        assert ids(await router.choose_replicas([a, b], again)) == [["b"], ["a"]]
        assert again.args[0].peer_hint == "a" and again.args[0].peer_stream is None

        a.routing_stats = {**a.log.stats_payload(engine_stats("a"), lambda: a.cached),
                           "stream": encode_stream(a_stream)}
        router.update_replicas([a, b])
        assert router._replica_id_to_stream == {"a": a_stream}
        router.update_replicas([b])  # a left: its stream (and token) is forgotten with it
        assert router._replica_id_to_stream == {}

    run(scenario)


def test_replica_leaving_is_dropped_from_index():
    async def scenario():
        router = make_router()
        a, b = StandInReplica("a"), StandInReplica("b")
        a.store(PROMPT)
        a.publish()
        router.update_replicas([a, b])
        assert router.index.replica_ids() == ["a", "b"]
        router.update_replicas([b])
        assert router.index.replica_ids() == ["b"]
        request = pending(EngineRequest("r1", [], page_keys=PROMPT), "internal-1")
        assert ids(await router.choose_replicas([b], request)) == [["b"]]
        assert request.args[0].peer_hint is None
        router.on_replica_actor_died(b.replica_id)
        assert router.index.replica_ids() == []

    run(scenario)


def test_unchanged_stats_are_not_applied_again():
    async def scenario():
        router = make_router()
        a = StandInReplica("a")
        a.store(PROMPT[:1])
        a.publish()
        calls = []
        original_sync = router.index.sync
        router.index.sync = lambda *args, **kwargs: calls.append(args) or original_sync(*args, **kwargs)
        router.update_replicas([a])
        a.routing_stats = dict(a.routing_stats)  # equal content, new object (as after a broadcast)
        router.update_replicas([a])
        assert len(calls) == 1
        a.publish()
        router.update_replicas([a])
        assert len(calls) == 2

    run(scenario)


def test_malformed_stats_are_ignored(caplog):
    async def scenario():
        router = make_router()
        a = StandInReplica("a")
        a.routing_stats = {"format": 99}
        with caplog.at_level(logging.WARNING, logger="router.ray_router"):
            router.update_replicas([a])
        assert "format 99" in caplog.text
        request = pending(EngineRequest("r1", [], page_keys=PROMPT), "internal-1")
        assert ids(await router.choose_replicas([a], request)) == [["a"]]

    run(scenario)


def test_inflight_follows_assignment_and_completion():
    async def scenario():
        router = make_router()
        a, b = StandInReplica("a"), StandInReplica("b")
        router.update_replicas([a, b])
        first = pending(EngineRequest("r1", [], page_keys=[key("x")]), "internal-1")
        tiers = await router.choose_replicas([a, b], first)
        chosen, fallback = tiers[0][0], tiers[1][0]
        assert router.policy.num_inflight(chosen.replica_id.unique_id) == 1
        first.future.set_result(fallback)  # Serve fell back to the second tier
        await asyncio.sleep(0)
        assert router.policy.num_inflight(chosen.replica_id.unique_id) == 0
        assert router.policy.num_inflight(fallback.replica_id.unique_id) == 1
        router.on_request_completed(fallback.replica_id, "internal-1")
        assert router.policy.num_inflight(fallback.replica_id.unique_id) == 0

        second = pending(EngineRequest("r2", [], page_keys=[key("y")]), "internal-2")
        tiers = await router.choose_replicas([a, b], second)
        second.future.cancel()  # the caller gave up before the request was sent
        await asyncio.sleep(0)
        assert router.policy.num_inflight("a") == router.policy.num_inflight("b") == 0

    run(scenario)


def test_requests_without_page_keys_still_route():
    async def scenario():
        router = make_router()
        a = StandInReplica("a")
        router.update_replicas([a])
        assert ids(await router.choose_replicas([a], None)) == [["a"]]
        plain = PendingRequest(args=["hello"], kwargs={}, metadata=RequestMetadata("r", "i"))
        assert ids(await router.choose_replicas([a], plain)) == [["a"]]
        assert plain.args == ["hello"]
        assert await router.choose_replicas([], plain) == []

    run(scenario)


def test_router_config_and_actor_name():
    config = router_config(balance_abs_threshold=8)
    assert isinstance(config, RequestRouterConfig)
    assert config.request_router_class == "router.ray_router.PrefixAwareRequestRouter"
    assert config.request_router_kwargs == {
        **dataclasses.asdict(PolicyConfig()),  # the cost model's fields keep their defaults
        "balance_abs_threshold": 8,
        "balance_rel_threshold": 1.5,
        "min_peer_copy_pages": 1,
        "enable_peer_hint": True,
    }
    assert config.request_routing_stats_period_s == 0.5
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        router_config(balance_rel_threshold=0.1)


# ---- issue 12 / 13: prompt length, measured costs, retained pages, decisions on /metrics ------------------------------
def test_prompt_length_costs_and_retention_reach_the_policy_and_decisions_reach_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from cluster.metrics import RouterDecisionsCollector
    from common.routing_stats import MeasuredCosts, RetainedPages
    from router import decision_metrics
    from router.ray_router import num_prompt_tokens_of

    async def scenario():
        router = make_router()
        a, b = StandInReplica("a"), StandInReplica("b")
        a.store(PROMPT)
        stats = engine_stats("a")
        a.routing_stats = a.log.stats_payload(stats, lambda: a.cached, costs=MeasuredCosts(prefill_token_ms=0.2),
                                              retained=[RetainedPages(30, None, tuple(PROMPT[:2]))])
        b.publish()
        router.update_replicas([a, b])
        load = router._load_of(a)
        assert load.costs == MeasuredCosts(prefill_token_ms=0.2)
        assert router.index.is_retained("a", PROMPT[0], 1e12) and not router.index.is_retained("a", PROMPT[2], 0.0)
        request = EngineRequest("r1", list(range(700)), page_keys=PROMPT)
        assert num_prompt_tokens_of(pending(request, "i0")) == 700
        seen = {}
        choose = router.policy.choose
        router.policy.choose = lambda *args, **kwargs: seen.update(kwargs) or choose(*args, **kwargs)
        before = decision_metrics.DECISIONS.snapshot()
        tiers = await router.choose_replicas([a, b], pending(request, "i1"))
        assert ids(tiers)[0] == ["a"] and seen["num_prompt_tokens"] == 700
        after = decision_metrics.DECISIONS.snapshot()
        grown = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        assert grown == {("engine", "a", "prefix_hit"): 1}
        registry = CollectorRegistry()
        registry.register(RouterDecisionsCollector())
        text = generate_latest(registry).decode()
        assert f'prefixserve_router_decisions_total{{reason="prefix_hit",replica="a"}} {float(after[("engine", "a", "prefix_hit")])}' \
            in text
        assert 'prefixserve_router_decisions_total{reason="cost_away",replica="a"}' in text  # every reason exported
        # the policy's session events (chats taken for ended, and those that went on) are exported the same way
        events_before = decision_metrics.SESSION_EVENTS.snapshot()
        router.policy.session_events.update({("a", "idle"): 2, ("b", "resumed"): 1})
        await router.choose_replicas([a, b], pending(request, "i2"))
        assert not router.policy.session_events  # drained into the process's table
        events = decision_metrics.SESSION_EVENTS.snapshot()
        assert {k: v - events_before.get(k, 0) for k, v in events.items() if v != events_before.get(k, 0)} == {
            ("engine", "a", "idle"): 2, ("engine", "b", "resumed"): 1}
        text = generate_latest(registry).decode()
        idle_a = float(events[("engine", "a", "idle")])
        assert f'prefixserve_router_session_events_total{{event="idle",replica="a"}} {idle_a}' in text
        assert 'prefixserve_router_session_events_total{event="resumed",replica="a"}' in text  # both events exported

    run(scenario)


# ---- issue 12: the cost model (--router-cost-model / --no-router-cost-model) and residency aging
# (--router-residency-aging) on / off from the command line ----


@pytest.mark.parametrize("flag, field, name, default", [
    ("router-cost-model", "router_cost_model", "enable_cost_model", True),
    ("router-residency-aging", "router_residency_aging", "enable_residency_aging", False),
])
@pytest.mark.parametrize("given", [None, True, False])
def test_router_switches_reach_the_policy(flag, field, name, default, given):
    from cluster.app import build_app, request_router_config
    from cluster.cli import build_parser, config_from_args
    from cluster.config import ServeConfig

    flags = [] if given is None else [f"--{flag}" if given else f"--no-{flag}"]
    expected = default if given is None else given
    config = config_from_args(build_parser().parse_args(["serve", "--devices", "cpu", *flags]))
    assert getattr(config, field) is expected
    assert getattr(ServeConfig.from_mapping({"devices": "cpu", flag: expected}), field) is expected
    router_kwargs = request_router_config(config).request_router_kwargs
    assert router_kwargs[name] is expected
    # the deployment that build_app makes carries it, and the router Serve builds from it uses it
    app = build_app(dataclasses.replace(config, data_parallel_degree=2, num_cpus_per_replica=0.5))
    deployed = app._bound_deployment.init_args[0]._bound_deployment._deployment_config.request_router_config
    assert deployed.request_router_kwargs[name] is expected
    router = make_router(**deployed.request_router_kwargs)
    assert getattr(router.policy.config, name) is expected
    assert router.policy._holds_keys is (expected if name == "enable_residency_aging" else False)


@pytest.mark.parametrize("flag, field, name, default, value", [
    ("--router-session-growth", "router_session_growth", "session_growth", 4.0, 2.5),
    ("--router-session-start-growth", "router_session_start_growth", "session_start_growth", 8.0, 12.0),
    ("--router-session-move-fill", "router_session_move_fill", "session_move_fill", 1.0, 0.8),
    ("--router-session-idle-factor", "router_session_idle_factor", "session_idle_factor", 1.5, 3.0),
])
def test_router_session_flags_reach_the_policy(flag, field, name, default, value):
    from cluster.app import build_app, request_router_config
    from cluster.cli import build_parser, config_from_args
    from cluster.config import ServeConfig

    for flags, expected in (([], default), ([flag, "0"], 0.0), ([flag, str(value)], value)):
        config = config_from_args(build_parser().parse_args(["serve", "--devices", "cpu", *flags]))
        assert getattr(config, field) == expected
        assert request_router_config(config).request_router_kwargs[name] == expected
        app = build_app(dataclasses.replace(config, data_parallel_degree=2, num_cpus_per_replica=0.5))
        deployed = app._bound_deployment.init_args[0]._bound_deployment._deployment_config.request_router_config
        assert getattr(make_router(**deployed.request_router_kwargs).policy.config, name) == expected
    with pytest.raises(ValueError, match=flag):
        ServeConfig.from_mapping({"devices": "cpu", flag[2:]: -1})


# ---- issues 11 / 12: a chat's next turn, sent before its answer is reported, goes where its own chat finished --------
def test_a_chat_s_next_turn_goes_where_its_own_turn_finished_through_the_adapter():
    """Two chats on one system prompt (two full pages) finished their turns on a and b, each prompt ending 50 tokens
    into the third page. Neither answer page is reported yet. Each chat's next turn is credited the third page only on
    the replica that finished its own turn, even where that replica is the busier one: the adapter hands the policy
    the request's partial page keys (``partial_key_of``, from its token ids), which tell the two tails apart. So the
    request's peer hint names that replica, whether it is sent there or (busier: ``cost_away``) to the other replica,
    which copies the page from it. Without partial keys both replicas are credited the page, the less loaded one
    wins and names itself (tests/test_router_policy.py)."""
    from common.page_keys import compute_page_keys
    from router.ray_router import partial_key_of

    system = list(range(1000, 1256))
    tails = {"a": list(range(5000, 5050)), "b": list(range(6000, 6050))}

    def request(name: str, tokens: list[int]) -> EngineRequest:
        return EngineRequest(name, tokens, page_keys=compute_page_keys(tokens, page_size=128, model_fingerprint="m"))

    async def scenario():
        router = make_router()
        a, b = StandInReplica("a"), StandInReplica("b")
        system_keys = compute_page_keys(system, page_size=128, model_fingerprint="m")
        for replica in (a, b):
            replica.store(system_keys)
            replica.publish()
        router.update_replicas([a, b])
        for name, replica in (("a", a), ("b", b)):
            turn = pending(request(f"{name}1", system + tails[name]), f"i-{name}1")
            assert partial_key_of(turn, 128) is not None
            assert ids(await router.choose_replicas([replica], turn)) == [[name]]
            router.on_request_completed(replica.replica_id, f"i-{name}1")
        for busier in ("a", "b"):
            for replica in (a, b):
                replica.publish(num_waiting=2 if replica.replica_id.unique_id == busier else 0)
            router.update_replicas([a, b])
            answer_and_question = list(range(7000, 7140))
            follow_up = pending(request(f"{busier}2", system + tails[busier] + answer_and_question), f"i-{busier}2")
            assert len(follow_up.args[0].page_keys) == 3
            await router.choose_replicas([a, b], follow_up)
            assert follow_up.args[0].peer_hint == busier
            follow_up.future.cancel()
            await asyncio.sleep(0)

    run(scenario)


def test_a_request_serve_retries_is_not_taken_for_a_chat_through_the_adapter():
    """Serve asks the router again for a request whose replica refused it (the rejection completes it first). The
    adapter passes the request's id to the policy, so the retry does not continue the session its first choice
    recorded: a one-off prompt does not count as a chat (router/policy.py "Sessions"). The retry goes to the other
    replica (the refusing one now reports a long queue), and the session moves there with it."""
    from common.page_keys import compute_page_keys

    tokens = list(range(1000, 1300))

    def sessions_by_home(router) -> dict:
        return {session.replica_id: session.request_id
                for tails in router.policy._sessions.values() for session in tails.values()}

    async def scenario():
        router = make_router()
        a, b = StandInReplica("a"), StandInReplica("b")
        for replica in (a, b):
            replica.publish()
        router.update_replicas([a, b])
        request = pending(EngineRequest("r", tokens, page_keys=compute_page_keys(tokens, page_size=128,
                                                                              model_fingerprint="m")), "i-r")
        first = ids(await router.choose_replicas([a, b], request))[0][0]
        assert sessions_by_home(router) == {first: "i-r"}
        refused, other = (a, b) if first == "a" else (b, a)
        router.on_request_completed(refused.replica_id, "i-r")
        refused.publish(num_waiting=9)
        router.update_replicas([a, b])
        assert ids(await router.choose_replicas([a, b], request))[0] == [other.replica_id.unique_id]  # the retry
        request.future.set_result(other)
        await asyncio.sleep(0)
        assert not any(router.policy._replica_id_to_num_sessions.values())
        new_sessions = router.policy._replica_id_to_num_new_sessions
        assert {replica_id: n for replica_id, n in new_sessions.items() if n} == {other.replica_id.unique_id: 1}
        assert sessions_by_home(router) == {other.replica_id.unique_id: "i-r"}

    run(scenario)


def test_an_open_output_channel_is_not_load_on_its_replica():
    """Serve's queue length counts an open output channel as an ongoing request on its replica (and tells the router
    it completed as soon as it was sent); the router takes the process's open channels back out, so a replica holding
    a prefix and a channel still gets the prefix's requests, and counts a queued request again once it closed."""
    from common.types import OutputChannelRequest
    from router import long_calls

    async def scenario():
        router, a, b = holder_and_other()
        channel = PendingRequest(args=[OutputChannelRequest("ingress-1", target_replica="a")], kwargs={},
                                 metadata=RequestMetadata(request_id="ch", internal_request_id="internal-ch"))
        assert ids(await router.choose_replicas([a, b], channel)) == [["a"]]
        long_calls.opened("a")  # cluster/output_channels.py opened it
        router.replica_queue_len_cache.update(a.replica_id, 1)  # Serve sent it: one ongoing request
        try:
            assert router._load_of(a).num_requests == 0
            request = pending(EngineRequest("r1", [], page_keys=PROMPT), "internal-1")
            assert ids(await router.choose_replicas([a, b], request))[0] == ["a"]
        finally:
            long_calls.closed("a")
        assert router._load_of(a).num_requests == 1

    run(scenario)


def test_a_request_the_ingress_sends_itself_is_routed_and_counted_as_one_serve_sends():
    """``route_for_lane`` (the ingress's request lanes): the same choice as ``choose_replicas``, a copy of the request
    carrying the hint and the holder's stream, in flight on the chosen replica until ``done()``; a lane's opening
    call goes to its replica only; the router is this process's router of its deployment."""
    from common.types import LaneOpen
    from router import local_routers

    async def scenario():
        router = make_router()
        assert local_routers.find(DEPLOYMENT.app_name, DEPLOYMENT.name) is router
        a, b = StandInReplica("a"), StandInReplica("b")
        a.store(PROMPT)
        a.publish()
        a.routing_stats["stream"] = encode_stream(StreamLocation("10.0.0.1", 7001, b"t" * 32, "node-a"))
        b.publish(num_waiting=0)
        router.update_replicas([a, b])
        assert sorted(router.replica_ids()) == ["a", "b"]
        request = EngineRequest("r1", list(range(384)), page_keys=PROMPT)
        replica_id, routed, done = await router.route_for_lane(request)
        assert replica_id == "a" and routed.peer_hint == "a" and routed.peer_stream.port == 7001
        assert request.peer_hint is None  # the caller's object is left alone
        await asyncio.sleep(0)
        assert router.policy.num_inflight("a") == 1
        done()
        assert router.policy.num_inflight("a") == 0
        lane = PendingRequest(args=[LaneOpen("b", "lane-1")], kwargs={},
                              metadata=RequestMetadata(request_id="lane", internal_request_id="internal-lane"))
        assert ids(await router.choose_replicas([a, b], lane)) == [["b"]]

    run(scenario)


def test_a_request_sent_on_after_a_busy_answer_avoids_that_replica_and_is_not_counted_twice():
    """A lane's "busy" sends the request on through the handle naming the busy replica (``avoid_replica``): the
    router picks another replica even over the prefix's holder (the busy one would refuse it with a 429), with a peer
    hint to copy the prefix from the busy holder, keeps it when it is the only one; the request's demand for hot-prefix
    replication is not counted again, the busy replica is not taken for having answered it, and the second choice is
    the policy's retry of the first (its session moves; no chat is counted for it continuing itself)."""
    import types

    from router import replication

    observed = []
    recorder = types.SimpleNamespace(config=types.SimpleNamespace(max_prefix_pages=8),
                                     observe=lambda keys, *rest: observed.append(len(keys)),
                                     forget_replica=lambda replica_id: None)

    async def scenario():
        router, a, b = holder_and_other()
        replication.register_planner(DEPLOYMENT.app_name, DEPLOYMENT.name, recorder)
        try:
            request = EngineRequest("r1", list(range(3 * 128 + 20)), page_keys=PROMPT)  # 20 tokens after its pages
            replica_id, _, done = await router.route_for_lane(request)
            assert replica_id == "a" and len(observed) == 1
            done(False)  # "busy"
            assert not router.policy._answered  # a did not answer it
            busy = dataclasses.replace(request, avoid_replica="a")
            sent_on = pending(busy, "internal-2")
            assert ids(await router.choose_replicas([a, b], sent_on)) == [["b"]]
            assert sent_on.args[0].peer_hint == "a"  # copy the prefix from the busy holder
            assert router.policy._replica_id_to_num_sessions.get("b", 0) == 0  # not a chat continuing itself
            assert router.policy._replica_id_to_num_new_sessions == {"a": 0, "b": 1}  # its session moved to b
            assert router.policy.num_inflight("b") == 1
            router.on_request_completed(b.replica_id, "internal-2")  # Serve's id: the policy's is the lane's
            assert router.policy.num_inflight("b") == 0 and [r for r, _ in router.policy._answered] == ["b"]
            (session,) = next(iter(router.policy._sessions.values())).values()
            assert session.replica_id == "b" and session.finished_s is not None  # its turn ended there
            # a replica that refused it (Serve sends it on to the next tier) completing after that: the live
            # attempt keeps counting
            c = StandInReplica("c")
            c.publish()
            router.update_replicas([a, b, c])
            retried = pending(busy, "internal-5")
            await router.choose_replicas([a, b, c], retried)
            first = router.policy.counted_on("lane-r1")
            (other,) = {"b", "c"} - {first}
            await router.choose_replicas([r for r in (b, c) if r.replica_id.unique_id == other], retried)
            router.on_request_completed(ReplicaID(first, deployment_id=DEPLOYMENT), "internal-5")
            assert router.policy.counted_on("lane-r1") == other
            router.on_request_completed(ReplicaID(other, deployment_id=DEPLOYMENT), "internal-5")
            assert router.policy.counted_on("lane-r1") is None and not router._serve_id_to_policy_id
            router.update_replicas([a, b])
            dropped = pending(busy, "internal-4")
            await router.choose_replicas([a, b], dropped)
            dropped.future.cancel()  # never sent: stops counting, and Serve's id is forgotten
            await asyncio.sleep(0)
            assert router.policy.num_inflight("b") == 0 and not router._serve_id_to_policy_id
            assert ids(await router.choose_replicas([a], pending(busy, "internal-3"))) == [["a"]]
            assert len(observed) == 1
            fresh = EngineRequest("r2", list(range(3 * 128)), page_keys=[key("n0"), key("n1"), key("n2")])
            replica_id, _, done = await router.route_for_lane(fresh)
            done(False)  # "busy": the index now expects the new prefix there, but it never held it
            sent_on = pending(dataclasses.replace(fresh, avoid_replica=replica_id), "internal-6")
            await router.choose_replicas([a, b], sent_on)
            assert sent_on.args[0].peer_hint is None
        finally:
            replication.register_planner(DEPLOYMENT.app_name, DEPLOYMENT.name, None)

    run(scenario)


def test_a_lane_request_is_not_pushed_off_its_prefix_by_serve_s_queue_length_of_handle_requests():
    """Serve's queue-length cache sees only requests through the handle; with request lanes an entry is what one
    pinned request saw when sent, kept for seconds. ``choose_replicas`` (handle requests) still raises a replica's
    load to it; ``route_for_lane`` does not, so the prefix's holder keeps its request."""

    async def scenario():
        router, a, b = holder_and_other()
        router.replica_queue_len_cache.update(a.replica_id, 50)
        request = EngineRequest("r1", list(range(384)), page_keys=PROMPT)
        assert ids(await router.choose_replicas([a, b], pending(request, "internal-1")))[0] == ["b"]
        router.on_request_completed(b.replica_id, "internal-1")
        replica_id, _, done = await router.route_for_lane(request)
        done()
        assert replica_id == "a"

    run(scenario)
