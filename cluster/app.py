"""The Ray Serve application: the replica deployment (data-parallel, prefix-aware router) behind the OpenAI ingress.

    HTTP -> Serve proxy -> OpenAIIngress (1 replica) --handle--> ServeReplica x data_parallel_degree
                                                      (PrefixAwareRequestRouter picks the replica by page keys)

Two entry points:

- ``build_app(config)`` for Python (the CLI, tests): ``serve.run(build_app(ServeConfig(...)))``;
- ``app_builder(args)`` for a Serve config YAML (``import_path: cluster.app:app_builder``, ``args:`` a mapping of
  ServeConfig settings spelled as fields or flags), following Serve's application-builder convention.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ray import serve
from ray.serve import Application

from cluster.config import ServeConfig
from cluster.openai_api import OpenAIIngress
from replica.serve_replica import ServeReplica
from router import ray_router
from router.policy import eviction_weight_for

logger = logging.getLogger(__name__)

REPLICA_DEPLOYMENT_NAME = "PrefixServeReplica"
INGRESS_DEPLOYMENT_NAME = "OpenAIIngress"
INGRESS_NUM_REPLICAS = 1
INGRESS_MAX_ONGOING_REQUESTS = 4096
REPLICA_HEALTH_CHECK_PERIOD_S = 10.0
SHUTDOWN_MARGIN_S = 10.0
"""Serve's graceful-shutdown wait for a replica is the drain timeout plus this (the drain ends every stream first)."""
SERVE_LATENCY_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}
"""Ray Serve settings for both deployments' processes: our methods never block their event loop (engine work runs
on the engine thread, tokenization on a tokenizer thread), so Serve's extra user-code thread and router loop only add
cross-thread hops to every request and every streamed message. Measured with benchmarks/serving_overhead.py
(BENCHMARKS.md): they cut TTFT and the time per streamed token by a third on 2 cores."""


def request_router_config(config: ServeConfig) -> Any:
    """The prefix-aware router's config. The router names a peer holding more of the prompt's pages (``peer_hint``)
    only when cross-replica prefix copy is on; ``--no-router-cost-model`` turns its cost model off;
    ``--route-on-tier-contents`` makes it price the pages the shared tiers hold as fetches. It counts tokens in the
    replicas' pages and steps (``--kv-cache-page-size``, ``--max-num-batched-tokens``), prices the cached pages a
    request would push out by the replicas' eviction (plain LRU with ``--kv-cache-protected-fraction 0``), and keeps a
    chat's turns with its session where caches are tight (``--router-session-growth``)."""
    return ray_router.router_config(enable_peer_hint=bool(config.enable_dp_cross_replica_prefix_copy),
                                    enable_cost_model=config.router_cost_model,
                                    enable_tier_routing=bool(config.route_on_tier_contents),
                                    enable_residency_aging=bool(config.router_residency_aging),
                                    page_size=config.page_size,
                                    max_num_batched_tokens=config.max_num_batched_tokens,
                                    eviction_weight=eviction_weight_for(config.kv_cache_protected_fraction),
                                    session_growth=float(config.router_session_growth),
                                    session_start_growth=float(config.router_session_start_growth),
                                    session_move_fill=float(config.router_session_move_fill),
                                    session_idle_factor=float(config.router_session_idle_factor))


def replica_actor_options(config: ServeConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica,
                               "runtime_env": {"env_vars": dict(SERVE_LATENCY_ENV)}}
    if config.devices == "gpu":
        options["num_gpus"] = 1
    return options


def replica_admission(config: ServeConfig) -> dict[str, int]:
    """Bounded queues (admission control). Serve lets ``max_num_seqs + max_queued_requests`` requests into one replica
    (the engine runs max_num_seqs, the rest wait in its scheduler); when every replica is that full, up to
    ``max_queued_requests * data_parallel_degree`` more wait in the ingress's handle for a free one; beyond that
    Serve raises BackPressureError, which the ingress answers with 429 and Retry-After. So a replica that dies does not
    push an unbounded queue onto the survivors: the excess is shed. With output channels on, one slot more: the
    ingress's channel to the replica is an ongoing call to Serve (cluster/output_channels.py); with request lanes,
    one more for the lane's call (cluster/request_lanes.py; requests on the lane are bounded by the replica, which
    answers "busy" from ``max_num_seqs + max_queued_requests`` requests on)."""
    long_calls = bool(config.output_channels) + bool(config.request_lanes)
    return {
        "max_ongoing_requests": config.max_num_seqs + config.max_queued_requests + INGRESS_NUM_REPLICAS * long_calls,
        "max_queued_requests": max(1, config.max_queued_requests * config.data_parallel_degree),
    }


def build_app(config: ServeConfig, router_config: Any = None) -> Application:
    """The bound application for ``config`` (not yet running: pass it to ``serve.run``).

    ``router_config`` (a ``RequestRouterConfig``) replaces the replica deployment's prefix-aware router, e.g. to
    compare routers in a benchmark; None keeps the default from ``request_router_config(config)``.
    """
    replica_options: dict[str, Any] = dict(
        name=REPLICA_DEPLOYMENT_NAME,
        num_replicas=config.data_parallel_degree,
        ray_actor_options=replica_actor_options(config),
        health_check_period_s=REPLICA_HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=config.shutdown_timeout_s + SHUTDOWN_MARGIN_S,
        **replica_admission(config),
    )
    router = router_config if router_config is not None else request_router_config(config)
    if router is not None:
        replica_options["request_router_config"] = router
    replicas = serve.deployment(ServeReplica, **replica_options)
    ingress = serve.deployment(
        OpenAIIngress,
        name=INGRESS_DEPLOYMENT_NAME,
        num_replicas=INGRESS_NUM_REPLICAS,
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        graceful_shutdown_timeout_s=config.shutdown_timeout_s + SHUTDOWN_MARGIN_S,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": dict(SERVE_LATENCY_ENV)}},
    )
    # The template's replica id is replaced by each replica's Serve id in ServeReplica.__init__.
    lane_capacity = config.max_num_seqs + config.max_queued_requests if config.request_lanes else 0
    return ingress.bind(replicas.bind(config.engine_config("replica-0"), config.served_model_name,
                                      lane_capacity=lane_capacity), config)


def app_builder(args: Mapping[str, Any] | None = None) -> Application:
    """Serve application builder: ``args`` is the ``args:`` mapping of a Serve config YAML (see ServeConfig)."""
    return build_app(ServeConfig.from_mapping(dict(args or {})))
