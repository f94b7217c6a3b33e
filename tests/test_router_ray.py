"""PrefixAwareRequestRouter inside real Ray Serve: routing stats reach the router, affinity and balancing hold, and
the ``peer_hint`` the router writes into the request reaches the replica.

Uses the session fixture ``ray_session`` (tests/conftest.py), whose workers import the repository via PYTHONPATH.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.ray

def make_app():
    """A two-replica stand-in engine: rank 0 holds chain A and is idle, rank 1 holds chain B with 50 waiting requests.

    Defined inside a function so cloudpickle ships the class by value; it only refers to importable modules.
    """
    from ray import serve

    from common.events import PagesStored
    from common.types import EngineStats
    from router.ray_router import router_config
    from replica.event_log import ReplicaEventLog

    @serve.deployment(
        num_replicas=2,
        ray_actor_options={"num_cpus": 0.1},
        request_router_config=router_config(stats_period_s=0.2),
    )
    class StandInEngine:
        def __init__(self, chain_a: list[bytes], chain_b: list[bytes]) -> None:
            context = serve.get_replica_context()
            self.replica_id = context.replica_id.unique_id
            self.rank = context.rank.rank
            self.keys = chain_a if self.rank == 0 else chain_b
            self.num_waiting = 0 if self.rank == 0 else 50
            self.log = ReplicaEventLog(self.replica_id)
            self.log.append([PagesStored(1, tuple(self.keys))])

        def record_routing_stats(self) -> dict:
            stats = EngineStats(self.replica_id, 0, 0, 64, 60, 3, 0, 0, 0, 0, self.num_waiting, 0, 128)
            return self.log.stats_payload(stats, lambda: self.keys)

        def __call__(self, request) -> dict:
            return {"replica_id": self.replica_id, "rank": self.rank, "peer_hint": request.peer_hint}

    return StandInEngine


def key(name: str) -> bytes:
    return name.encode().ljust(32, b".")


CHAIN_A = [key("a0"), key("a1"), key("a2")]
CHAIN_B = [key("b0"), key("b1")]


def test_router_in_serve(ray_session):
    from ray import serve

    from common.types import EngineRequest

    handle = serve.run(make_app().bind(CHAIN_A, CHAIN_B), name="router-check", route_prefix=None)
    try:
        deadline = time.monotonic() + 30
        results = None
        attempt = 0
        while time.monotonic() < deadline:
            attempt += 1
            # a never-seen prefix each time: the router expects a routed prefix on its replica from then on
            unknown = [key(f"c{attempt}")]
            results = [
                handle.remote(EngineRequest(f"{name}-{time.monotonic()}", [], page_keys=keys)).result()
                for name, keys in [("a", CHAIN_A), ("b", CHAIN_B), ("c", unknown)]
            ]
            if results[0]["peer_hint"] is not None and results[1]["peer_hint"] is not None:
                break  # the router has heard from both replicas
            time.sleep(0.2)
        # Requests routed so far made the router guess that their chains now live on the replica they went to (a real
        # engine would fetch or compute them there; this stand-in does not). The replicas' periodic snapshots (every 20
        # stats periods = 4 s) replace such guesses with the truth even though an idle replica's label never changes.
        deadline = time.monotonic() + 40
        attempt = 0
        while True:
            attempt += 1
            results = [
                handle.remote(EngineRequest(f"{name}-final-{attempt}", [], page_keys=keys)).result()
                for name, keys in [("a", CHAIN_A), ("b", CHAIN_B), ("c", [key(f"c-final-{attempt}")])]
            ]
            if results[1]["peer_hint"] not in (None, results[1]["replica_id"]) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        on_a, on_b, on_c = results
        # Chain A: held by idle rank 0 -> prefix hit; the hint names the chosen replica itself.
        assert (on_a["rank"], on_a["peer_hint"]) == (0, on_a["replica_id"])
        # Chain B: its holder (rank 1) is 50 requests behind -> balanced away, hint names rank 1.
        assert on_b["rank"] == 0
        assert on_b["peer_hint"] not in (None, on_b["replica_id"])
        # Unknown prefix: least loaded, no hint.
        assert (on_c["rank"], on_c["peer_hint"]) == (0, None)
    finally:
        serve.delete("router-check")
