"""The ``prefixserve`` command line (also ``python -m cluster``).

    prefixserve serve [flags]            start Ray (or join --ray-address), deploy the app, serve until Ctrl-C / SIGTERM
    prefixserve make-tiny-model [flags]  write a tiny random-weight model (bench.tiny_models)
    prefixserve bench [flags]            benchmark client (the bench package, when installed)

Flags are parsed here and nowhere else; they become a ``ServeConfig``, whose validation messages name the remedy. A bad
flag or combination prints one line, ``prefixserve serve: error: ...``, and exits with status 2 before Ray starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn, Sequence

from cluster.config import DTYPES, LOG_LEVELS, REPLICA_TRANSPORTS, ServeConfig, parse_memory_size, redact_url
from cluster.reaper import live_start_time
from replica.config import field_default

APP_NAME = "prefixserve"
EXIT_USAGE = 2
EXIT_FAILED = 1
DELEGATED_COMMANDS = {
    "make-tiny-model": ("bench.tiny_models", "write a tiny random-weight model and tokenizer (for tests)"),
    "bench": ("bench.cli", "benchmark a running server (shared-prefix workloads, TTFT, throughput)"),
}

logger = logging.getLogger("cluster.cli")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit status 2), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or action.default in (None, (), argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action)


def memory_size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def default(name: str):
    """The default of ``ServeConfig.<name>``: flags restate no default of their own."""
    return field_default(ServeConfig, name)


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every ``serve`` flag; dests are ServeConfig field names, defaults are ServeConfig's."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="Hugging Face folder, .gguf file or hub id; default: the bundled SmolLM2-135M-Instruct")
    model.add_argument("--served-model-name", default=None,
                       help="name clients send as 'model' (default: the model folder's name)")
    model.add_argument("--dtype", choices=DTYPES, default=default("dtype"),
                       help="weights and KV dtype; auto = bfloat16 on GPU and on CPUs with native bf16 matmuls "
                            "(AMX / AVX512-BF16), else float32")
    model.add_argument("--enforce-eager", action="store_true", default=default("enforce_eager"),
                       help="run the model eagerly: no torch.compile, no CUDA graphs")
    model.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's max_position_embeddings)")

    parallel = parser.add_argument_group("devices and replicas")
    parallel.add_argument("--devices", choices=("cpu", "gpu"), default=None,
                          help="where replicas run (default: gpu when CUDA is visible here, else cpu)")
    parallel.add_argument("--data-parallel-degree", type=int, default=default("data_parallel_degree"),
                          help="number of replicas, each a full model copy with its own KV cache (one GPU each)")
    parallel.add_argument("--num-cpus-per-replica", type=float, default=default("num_cpus_per_replica"),
                          help="Ray CPUs reserved per replica; its torch thread count is this rounded down "
                               "(default: this machine's CPUs but one, shared out among the replicas; 1 on a cluster)")
    parallel.add_argument("--num-prefill-threads", type=int, default=default("num_prefill_threads"),
                          help="torch threads of a replica's steps of 64 tokens or more (prefill chunks); decode steps "
                               "keep --num-cpus-per-replica's count (default: this machine's CPUs shared out among "
                               "the replicas when --num-cpus-per-replica is not given either; otherwise, and on a "
                               "cluster, the replica's own count)")

    cache = parser.add_argument_group("KV cache and prefix caching")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=default("enable_prefix_caching"),
                       help="reuse the KV pages of earlier prompts that share a prefix (on by default)")
    cache.add_argument("--kv-cache-page-size", dest="page_size", type=int, default=default("page_size"),
                       help="tokens per KV page; a multiple of 128")
    cache.add_argument("--kv-cache-memory", type=memory_size, default=default("kv_cache_memory"),
                       help="KV page memory per replica: bytes or e.g. 2GiB, 512MiB")
    cache.add_argument("--kv-cache-retention-budget", type=float, default=default("kv_cache_retention_budget"),
                       help="fraction of each replica's KV pages that retained prefixes (retention priority + TTL, "
                            "admin pins) may hold at once; the rest stays at priority 0 (default 0.5)")
    cache.add_argument("--kv-cache-protected-fraction", type=float, default=default("kv_cache_protected_fraction"),
                       help="segmented LRU: cached pages that were reused (hit by a later request, or copied or "
                            "fetched for one) are evicted after pages never reused, up to this fraction of each "
                            "replica's KV pages; a flood of one-off prompts then cannot push out shared prefixes "
                            "(default 0.7; 0: plain LRU)")
    cache.add_argument("--enable-dp-cross-replica-prefix-copy", action=argparse.BooleanOptionalAction, default=None,
                       help="copy cached pages from the replica that holds them instead of recomputing "
                            "(default: on with prefix caching)")
    cache.add_argument("--router-cost-model", action=argparse.BooleanOptionalAction,
                       default=default("router_cost_model"),
                       help="route each request to the replica with the least estimated time to first token "
                            "(cached pages, queued work, copy vs recompute); --no-router-cost-model: pure prefix "
                            "affinity with a load-balance fallback")
    cache.add_argument("--router-residency-aging", action=argparse.BooleanOptionalAction,
                       default=default("router_residency_aging"),
                       help="with the cost model: count a replica's cached pages as gone once its LRU eviction has "
                            "likely reached them, except pages held under a retention (until their TTL) and pages "
                            "of running requests (default off: every reported page counts until its eviction is "
                            "reported)")
    cache.add_argument("--router-session-growth", type=float, default=default("router_session_growth"),
                       help="a chat's next turn stays with its session: where a replica's cache is too small for "
                            "the sessions there to grow this many times, the router moves a turn to it only to "
                            "even out the sessions per replica; there a chat's busy home stays a candidate and a "
                            "new chat starts where its system prompt is (default 4; 0: all off; needs the router's "
                            "cost model)")
    cache.add_argument("--router-session-start-growth", type=float,
                       default=default("router_session_start_growth"),
                       help="with the session rule on: a new chat whose leading pages (at least half its prompt) a "
                            "replica holds starts there when that replica's sessions would outgrow its cache this "
                            "many times (default 8; 0: off)")
    cache.add_argument("--router-session-move-fill", type=float, default=default("router_session_move_fill"),
                       help="with the session rule on: a chat leaves a replica whose chats' prompts fill more than "
                            "this fraction of its cache for one where they and the chat fit within it (default 1; "
                            "0: off)")
    cache.add_argument("--router-session-idle-factor", type=float, default=default("router_session_idle_factor"),
                       help="with the session rule on: a chat whose latest answer finished longer ago than this many "
                            "times the 99th percentile of the recent gaps between an answer and the next turn no "
                            "longer counts on its replica until its next turn (default 1.5; 0: a chat counts until "
                            "its session window ends)")
    cache.add_argument("--enable-hot-prefix-replication", action=argparse.BooleanOptionalAction,
                       default=default("enable_hot_prefix_replication"),
                       help="copy a prefix whose holders are all busy to a less loaded replica ahead of need, by peer "
                            "copy (needs cross-replica prefix copy; off by default)")
    cache.add_argument("--hot-prefix-min-requests", type=int, default=default("hot_prefix_min_requests"),
                       help="requests of one prefix within 5 s before it counts as hot")
    cache.add_argument("--hot-prefix-busy-requests", type=int, default=default("hot_prefix_busy_requests"),
                       help="running + waiting requests at which a holder of a hot prefix is busy")
    cache.add_argument("--hot-prefix-copy-budget", type=int, default=default("hot_prefix_copy_budget"),
                       help="KV pages copied ahead of need per 10 s, all prefixes together")
    cache.add_argument("--redis-url", default=None,
                       help="shared host-memory KV tier, e.g. redis://:PASSWORD@127.0.0.1:6379/0, or rediss://... "
                            "for TLS (default: off)")
    cache.add_argument("--redis-timeout", type=float, default=default("redis_timeout"),
                       help="seconds a call to the Redis tier may take (connect, read) before Redis counts as "
                            "unreachable and requests recompute instead (default: 0.5; raise it for a Redis far away)")
    cache.add_argument("--start-redis", action="store_true",
                       help="start a local redis-server for the host tier (loopback only, a generated password, "
                            "bounded, LRU); it is stopped on exit and dies with this process")
    cache.add_argument("--kv-tier-key-file", default=None,
                       help="file with the cluster key (>= 32 bytes, e.g. `python -c 'import secrets; "
                            "print(secrets.token_hex(32))'`) that names, encrypts and authenticates shared-tier pages; "
                            "every node sharing a tier needs the same file (default: <cache dir>/kv-tier.key, "
                            "created on first use)")
    cache.add_argument("--enable-disk-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="shared disk KV tier (Arrow IPC files) that replicas on one machine share "
                            "(default: on with prefix caching)")
    cache.add_argument("--disk-cache-dir", default=None,
                       help="disk KV tier folder (default: ~/.cache/prefixserve/kv-pages)")
    cache.add_argument("--disk-cache-budget", type=memory_size, default=default("disk_cache_budget"),
                       help="disk KV tier size budget; least recently used pages are deleted beyond it")
    cache.add_argument("--peer-copy-stream", action=argparse.BooleanOptionalAction,
                       default=default("peer_copy_stream"),
                       help="copy a prefix from a replica on another node over a TCP connection to it, straight out "
                            "of its page pool, instead of through Ray's object store (default: on; needs a port "
                            "between the nodes: each replica listens on an ephemeral port of its node's address)")
    cache.add_argument("--route-on-tier-contents", action=argparse.BooleanOptionalAction,
                       default=default("route_on_tier_contents"),
                       help="replicas report which of their pages the shared tiers (Redis, disk) hold, and the router "
                            "prices those pages at the measured fetch cost instead of recomputing them (default: on exactly "
                            "when --no-enable-dp-cross-replica-prefix-copy leaves the tiers as the only way between "
                            "replicas; it enables Redis keyspace notifications for evictions)")
    cache.add_argument("--kv-events-config", default=None,
                       help="publish KV events in vLLM's schema over ZMQ, vLLM's JSON object, e.g. "
                            "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                            "\"replay_endpoint\": \"tcp://*:5558\"}' (replica r: ports + r; default: off)")

    sched = parser.add_argument_group("scheduling")
    sched.add_argument("--max-num-seqs", type=int, default=default("max_num_seqs"),
                       help="most requests running at once per replica")
    sched.add_argument("--max-num-batched-tokens", type=int, default=default("max_num_batched_tokens"),
                       help="token budget of one engine step (prefill chunks plus decode tokens)")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default=default("host"), help="HTTP bind address (0.0.0.0: all interfaces)")
    server.add_argument("--port", type=int, default=default("port"), help="HTTP port")
    server.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=default("direct_ingress"),
                        help="with a Ray started here, the ingress replica serves --port itself, with no Serve HTTP "
                             "proxy hop in front (on by default)")
    server.add_argument("--output-channels", action=argparse.BooleanOptionalAction, default=default("output_channels"),
                        help="a replica sends the ingress one message per engine step with the outputs of all its "
                             "requests, instead of one per request per step (on by default)")
    server.add_argument("--request-lanes", action=argparse.BooleanOptionalAction, default=default("request_lanes"),
                        help="the ingress sends requests to the chosen replica over a TCP connection of its own, "
                             "not through Serve's handle (on by default)")
    server.add_argument("--replica-transport", choices=REPLICA_TRANSPORTS, default=default("replica_transport"),
                        help="how the ingress's streaming calls reach the replicas: Ray Serve's gRPC transport between "
                             "deployments (default) or Ray actor calls")
    server.add_argument("--api-key", default=os.environ.get("PREFIXSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/*, /metrics and the admin routes "
                             "(default: $PREFIXSERVE_API_KEY, else none)")
    server.add_argument("--metrics-api-key", default=os.environ.get("PREFIXSERVE_METRICS_API_KEY"),
                        help="a key that reads /metrics only, for scrapers (default: $PREFIXSERVE_METRICS_API_KEY)")
    server.add_argument("--admin-api-key", default=os.environ.get("PREFIXSERVE_ADMIN_API_KEY"),
                        help="a separate key for /reset_prefix_cache, /admin/* and the x-prefixserve-target-replica "
                             "header (default: $PREFIXSERVE_ADMIN_API_KEY, else --api-key)")
    server.add_argument("--metrics-cache-s", type=float, default=default("metrics_cache_s"),
                        help="render /metrics at most once per this many seconds")
    limits = parser.add_argument_group("limits, admission and shutdown")
    limits.add_argument("--max-request-body-bytes", type=memory_size, default=default("max_request_body_bytes"),
                        help="largest request body (413 beyond): bytes or e.g. 8MiB")
    limits.add_argument("--max-prompt-chars", type=int, default=None,
                        help="longest prompt in characters, checked before tokenizing (default: max model len x 16)")
    limits.add_argument("--max-pending-tokenizations", type=int, default=default("max_pending_tokenizations"),
                        help="requests waiting for the tokenizer at once (429 beyond)")
    limits.add_argument("--request-timeout", dest="request_timeout_s", type=float,
                        default=default("request_timeout_s"), help="seconds one request may take in all")
    limits.add_argument("--max-queued-requests", type=int, default=default("max_queued_requests"),
                        help="requests waiting per replica beyond --max-num-seqs (429 with Retry-After beyond)")
    limits.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float,
                        default=default("shutdown_timeout_s"),
                        help="on SIGTERM, seconds requests in flight get to finish before they are ended")
    limits.add_argument("--require-redis", action="store_true", default=default("require_redis"),
                        help="exit at start when --redis-url does not answer (default: warn and run without it)")
    server.add_argument("--ray-address", default=None,
                        help="join this Ray cluster ('auto', 'host:6379', 'ray://...'); default: start a local one")
    server.add_argument("--log-level", choices=LOG_LEVELS, default=default("log_level"), help="log verbosity")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="prefixserve",
        description="Data-parallel LLM serving on Ray Serve with prefix caching and an OpenAI-compatible API.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    add_serve_arguments(commands.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI API)",
        description="Serve a model over an OpenAI-compatible HTTP API with data-parallel replicas on Ray Serve.",
        formatter_class=DefaultsHelpFormatter,
    ))
    for name, (_, summary) in DELEGATED_COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """A ServeConfig from parsed ``serve`` flags (raises ValueError with the remedy)."""
    kwargs = {key: value for key, value in vars(args).items() if key != "command"}
    if kwargs.get("devices") is None:
        kwargs.pop("devices", None)
    for key in ("model", "disk_cache_dir", "kv_tier_key_file"):  # replicas may run in another working directory
        if kwargs.get(key) and Path(kwargs[key]).expanduser().exists():
            kwargs[key] = str(Path(kwargs[key]).expanduser().resolve())
    return ServeConfig(**kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefixserve``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED_COMMANDS:
        return run_delegated(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        return fail(f"prefixserve serve: error: {error}", EXIT_USAGE)
    return run_serve(config)


def run_delegated(command: str, argv: list[str]) -> int:
    module_name, _ = DELEGATED_COMMANDS[command]
    if importlib.util.find_spec(module_name) is None:
        return fail(f"prefixserve {command}: error: this installation has no {module_name} module", EXIT_USAGE)
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


def fail(message: str, status: int) -> int:
    print(message, file=sys.stderr)
    return status


# ---- serve ------------------------------------------------------------------------------------------------------------
def run_serve(config: ServeConfig) -> int:
    """Start (or join) Ray, deploy the app, block until SIGINT / SIGTERM, drain, then shut down cleanly."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    local = config.ray_address is None
    if local:
        problem = check_local_start(config)
        if problem:
            return fail(f"prefixserve serve: error: {problem}", EXIT_USAGE)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    ray_options = local_ray_options(config)  # before importing ray: it reads its environment at import
    proxy_port = config.port
    if local and config.direct_ingress:
        proxy_port = enable_direct_ingress(config)

    import ray
    from ray import serve

    from cluster.app import build_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if local:
        expose_project_to_workers()
        # Ray starts its workers at nice 15 (its worker_niceness) to keep its own daemons responsive. Here the workers
        # are the replicas' engines and the HTTP ingress: at nice 15, any ordinary process on the machine (a load
        # generator, a monitoring agent) takes their core first. On a cluster, `ray start` decides (deploy/cluster.yaml).
        os.environ.setdefault("RAY_worker_niceness", "0")
    started = False
    deployed = False
    redis = None
    reaper = None
    ray_pids: dict[int, str | None] = {}  # the local Ray's own processes, with their start times
    ray_lost = False
    try:
        if config.start_redis:
            redis = start_local_redis()
            config = dataclasses.replace(config, redis_url=redis.url, start_redis=False)
            print(f"prefixserve: started redis-server for the host tier at {redis.redacted_url}", flush=True)
        elif config.redis_url:
            config, problem = check_redis(config)
            if problem:
                return fail(f"prefixserve serve: error: {problem}", EXIT_USAGE)
        ray.init(address=config.ray_address, logging_level=config.log_level.upper(), **ray_options)
        started = True
        if local:
            from cluster.reaper import local_ray_pids, start_reaper

            ray_pids = {pid: live_start_time(pid) for pid in local_ray_pids()}
            reaper = start_reaper(ray_pids)
        # ray.init installs a SIGTERM handler that aborts the process; take SIGTERM back for a clean shutdown.
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        problem = check_cluster_resources(config, ray.cluster_resources(), local=local)
        if problem:
            return fail(f"prefixserve serve: error: {problem}", EXIT_USAGE)
        serve.start(http_options={"host": config.host, "port": proxy_port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        deployed = True
        path = (f"direct ingress; Serve's HTTP proxy at port {proxy_port}" if proxy_port != config.port
                else "through Serve's HTTP proxy")
        print(
            f"prefixserve: serving {config.served_model_name!r} at http://{config.host}:{config.port}/v1 with "
            f"{config.data_parallel_degree} replica(s) on {config.devices} ({path}); Ctrl-C to stop",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("prefixserve: shutting down", file=sys.stderr, flush=True)
        # A signal sent to the whole process group (systemd's default stop, a kill of the group) reaches the local
        # Ray's own processes too: its agents and monitors die within a second or so, its raylet ~10 s later, and a
        # drain then waits ~60 s for Ray to give up on them. Seen stopping, the drain is given up; the reaper ends
        # what is left (the replicas' workers run in sessions of their own) at the exit.
        running = {pid: started for pid, started in ray_pids.items() if live_start_time(pid) == started}
        ray_lost = drain_watching(running, config.shutdown_timeout_s) if deployed else ray_stopped(running, 0.5)
        if ray_lost:
            print("prefixserve: the local Ray's own processes got the signal too and stopped: not draining",
                  file=sys.stderr, flush=True)
        return 0
    except Exception as error:  # noqa: BLE001 - start-up failures become one line
        return fail(f"prefixserve serve: error: the application failed to start: {cause_of(error)}", EXIT_FAILED)
    finally:
        if started and not ray_lost:
            shut_down(local)
        if reaper is not None and not ray_lost:
            reaper.dismiss()
        if redis is not None:
            redis.stop()
        if ray_lost:  # Ray's exit handler would wait for the GCS too; the closed pipe sets the reaper off
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def ray_stopped(pids: dict[int, str | None], wait_s: float = 0.0) -> bool:
    """Whether one of ``pids`` (pid -> start time) has stopped, or stops within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        if any(live_start_time(pid) != started for pid, started in pids.items()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def drain_watching(ray_pids: dict[int, str | None], timeout_s: float) -> bool:
    """``drain_app`` on a thread while this one watches the local Ray's own processes (pid -> start time, those
    running when the signal came): True, and the drain given up, once one stops. A second signal skips the wait."""
    import threading

    drain = threading.Thread(target=drain_app, args=(timeout_s,), name="prefixserve-drain", daemon=True)
    drain.start()
    try:
        while drain.is_alive():
            if ray_stopped(ray_pids):
                return True
            drain.join(0.1)
    except KeyboardInterrupt:
        print("prefixserve: drain skipped", file=sys.stderr, flush=True)
    return False


def drain_app(timeout_s: float) -> None:
    """SIGTERM / Ctrl-C while serving: the ingress turns new requests away (503, /health unready), lets those in
    flight finish for up to ``timeout_s``, then ends the rest with an SSE error event and [DONE]. Runs on
    ``drain_watching``'s thread, which takes a second signal (the signal handler runs on the main thread)."""
    from ray import serve

    print(f"prefixserve: draining: new requests get 503; requests in flight get up to {timeout_s:g} s "
          "(signal again to stop now)", file=sys.stderr, flush=True)
    try:
        handle = serve.get_app_handle(APP_NAME)
        result = handle.drain.remote(timeout_s).result(timeout_s=timeout_s + 30)
    except Exception as error:  # noqa: BLE001 - shut down anyway
        print(f"prefixserve: drain failed ({last_line(error)}); shutting down", file=sys.stderr, flush=True)
        return
    print(f"prefixserve: drained: {result['completed']} request(s) completed, {result['aborted']} ended at the "
          "timeout", file=sys.stderr, flush=True)


def local_ray_options(config: ServeConfig) -> dict:
    """``ray.init`` keywords for a Ray started here: with a loopback --host, Ray's own servers (GCS, raylet, workers,
    agents) listen on loopback too. Ray binds its gRPC servers to the node address, and only keeps 127.0.0.1 as that
    address when its cluster mode is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, inherited by every Ray process)."""
    if config.ray_address is not None:
        return {}
    if not is_loopback(config.host):
        return {}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return {"_node_ip_address": "127.0.0.1", "dashboard_host": "127.0.0.1"}


def enable_direct_ingress(config: ServeConfig) -> int:
    """Environment of a Ray started here (every Ray process inherits it) for Serve's direct ingress: the ingress
    replica's own HTTP server takes ``--port`` (the port range is that one port), Serve's proxy gets a spare port
    (returned), and the replica is not held open after a drain (``drain_app`` already waited for requests)."""
    proxy_port = spare_port(config.host, exclude=(config.port,))
    os.environ.update({
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(config.port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(config.port + 1),  # range(min, max): max is excluded
        "RAY_SERVE_DIRECT_INGRESS_PORT_RETRY_COUNT": "3",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    })
    return proxy_port


SPARE_PORT_FLOOR = 20000
"""The lowest port ``spare_port`` picks: above Ray's worker ports (10002-19999 by default) and its fixed ones."""


def spare_port(host: str, *, exclude: Sequence[int] = (), ceiling: int | None = None, tries: int = 64) -> int:
    """A port free on ``host`` now, for a server that binds it later (Serve's proxy, after Ray has started), picked at
    random below the kernel's ephemeral range (``ephemeral_port_floor``; ``ceiling`` overrides). A port from that
    range (a bind to port 0) can be taken meanwhile: the Ray processes that start before the proxy bind their own
    servers to port 0 and open connections from ephemeral ports, and one start in four failed that way on a 2-core
    box. Ports in ``exclude`` are never picked; with none free below the range, any free port."""
    import random

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    top = ephemeral_port_floor() if ceiling is None else ceiling
    candidates = [port for port in range(SPARE_PORT_FLOOR, top) if port not in exclude]
    for port in random.sample(candidates, min(tries, len(candidates))):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def ephemeral_port_floor(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, where the file can't be read)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_redis(config: ServeConfig) -> tuple[ServeConfig, str | None]:
    """Ping --redis-url once. Unreachable: with --require-redis a problem to exit on; else a warning and the host
    tier off (the config without redis_url)."""
    try:
        import redis as redis_client

        timeout = max(3.0, config.redis_timeout)  # a slow Redis the replicas were told to wait for is not a down one
        client = redis_client.Redis.from_url(config.redis_url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            client.ping()
        finally:
            client.close()
        return config, None
    except Exception as error:  # noqa: BLE001 - any failure means the tier cannot be used now
        cause = f"{type(error).__name__}: {last_line(error)}"
    if config.require_redis:
        return config, (f"--redis-url {redact_url(config.redis_url)} does not answer ({cause}); start Redis, fix the "
                        "URL, or drop --require-redis to serve without the host tier")
    print(f"prefixserve: warning: --redis-url {redact_url(config.redis_url)} does not answer ({cause}); serving "
          "without the host tier (pass --require-redis to make this an error)", file=sys.stderr, flush=True)
    return dataclasses.replace(config, redis_url=None), None


def cause_of(error: BaseException) -> str:
    """The most specific error line in ``error``'s text: Serve wraps a replica's exception (with its traceback) in its
    own deploy failure, whose last line is often not the cause."""
    import re

    pattern = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception)): (.+)$")
    wrappers = ("RayTaskError", "RayActorError", "ActorDiedError", "RuntimeError", "DeploymentUnavailableError",
                "RayServeException")
    causes = []
    for line in str(error).splitlines():
        match = pattern.match(line.strip())
        if match and match.group(1) not in wrappers and not match.group(1).startswith("RayTaskError"):
            causes.append(f"{match.group(1)}: {match.group(2).strip()}")
    return causes[-1] if causes else last_line(error)


class LocalRedis:
    """A redis-server this CLI started: loopback only, a generated password, no persistence, bounded memory with LRU
    eviction (what the host tier needs). It dies with the process that started it, even on SIGKILL."""

    def __init__(self, port: int, password: str, process: subprocess.Popen) -> None:
        self.port = port
        self.password = password
        self.process = process

    @property
    def url(self) -> str:
        """The URL replicas connect with (holds the password: do not log it; ``redacted_url`` is for logs)."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def redacted_url(self) -> str:
        return f"redis://:***@127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """In a child between fork and exec: ask the kernel to SIGKILL this process when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; the signal fires when the *thread* that forked exits, so start children from the
    main thread). Exits at once if the parent is already gone."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(126)
    if os.getppid() != parent_pid:
        os._exit(0)


def redis_config(port: int, password: str, maxmemory: str) -> str:
    """The redis-server configuration of ``start_local_redis`` (fed on stdin: the password never shows in ``ps``)."""
    return "\n".join([
        f"port {port}",
        "bind 127.0.0.1 -::1",
        "protected-mode yes",
        f"requirepass {password}",
        'save ""',
        "appendonly no",
        f"maxmemory {maxmemory}",
        "maxmemory-policy volatile-lru",  # only pages with an expiry (not retained) are evicted
        "",
    ])


def start_local_redis(maxmemory: str = "2gb", timeout_s: float = 10.0) -> LocalRedis:
    """Start redis-server on a free loopback port with a fresh random password; it dies with this process."""
    import secrets

    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("--start-redis needs redis-server: apt-get install -y redis-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    password = secrets.token_hex(24)
    parent_pid = os.getpid()
    process = subprocess.Popen(
        [binary, "-"],  # "-": read the configuration from stdin
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: die_with_parent(parent_pid),
    )
    process.stdin.write(redis_config(port, password, maxmemory).encode())
    process.stdin.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(f"AUTH {password}\r\nPING\r\n".encode())
                if b"+PONG" in sock.recv(64) or b"+PONG" in sock.recv(64):
                    return LocalRedis(port, password, process)
        except OSError:
            time.sleep(0.05)
    process.kill()
    process.wait()
    raise RuntimeError(f"redis-server did not start on port {port}")


def check_local_start(config: ServeConfig) -> str | None:
    """Problems found before starting anything locally: the model can't be found, or the port is taken."""
    from replica.model_loader import resolve_model_dir

    try:
        model_dir = resolve_model_dir(config.model)
    except ValueError as error:
        return str(error)
    problem = check_kv_budget(config, model_dir) or check_cluster_resources(
        config, {"CPU": os.cpu_count() or 1, "GPU": config_gpus(config)}, local=True)
    if problem:
        return problem
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((config.host, config.port))
        except OSError as error:
            return f"cannot listen on {config.host}:{config.port} ({error.strerror}); pick another --port or --host"
    return None


def config_gpus(config: ServeConfig) -> int:
    """GPUs visible here (only asked when replicas run on GPUs; ServeConfig already checked that count)."""
    if config.devices != "gpu":
        return 0
    from cluster.config import num_visible_gpus

    return num_visible_gpus()


def check_kv_budget(config: ServeConfig, model_dir: Path) -> str | None:
    """The KV budget must hold at least two pages (what the engine needs to serve one request); said here in one line
    instead of after the replicas failed to start. A budget below max_model_len is only a warning (the engine serves
    shorter contexts)."""
    min_dtype_bytes = 4 if config.dtype == "float32" else 2
    bound = kv_page_bytes_bound(model_dir, config.page_size, min_dtype_bytes)
    if bound is not None:
        pages = int(config.kv_cache_memory) // bound
        if pages >= 2 and pages * config.page_size >= (config.max_model_len or 0):
            return None  # enough at the bound, so enough at the exact size (transformers not imported: ~2.5 s)
    from replica.model_runner import kv_geometry

    try:
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(str(model_dir))
        geometry = kv_geometry(model_config)
    except Exception:  # noqa: BLE001 - an unusual config: the replica will say what is wrong
        return None
    per_page = kv_page_bytes(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, config.page_size,
                             min_dtype_bytes)
    num_pages = int(config.kv_cache_memory) // per_page
    if num_pages < 2:
        return (f"--kv-cache-memory {int(config.kv_cache_memory)} bytes holds {num_pages} KV page(s) of this model "
                f"({per_page} bytes each at page size {config.page_size}); one request needs at least 2: raise "
                f"--kv-cache-memory to {2 * per_page} bytes or more")
    capacity = num_pages * config.page_size
    if config.max_model_len and capacity < config.max_model_len:
        print(f"prefixserve: warning: --kv-cache-memory holds {capacity} tokens, less than --max-model-len "
              f"{config.max_model_len}; the longest request will be {capacity} tokens", file=sys.stderr, flush=True)
    return None


def kv_page_bytes_bound(model_dir: Path, page_size: int, dtype_bytes: int) -> int | None:
    """At least the bytes of one KV page of the model in ``model_dir``, from its config.json alone (no transformers,
    no torch): every attention head counted as a KV head, and a head size of at least 256 where the file gives none
    (a model class's default, Gemma's, can exceed hidden size / heads). None where the file does not say enough;
    ``check_kv_budget`` then asks transformers for the exact geometry."""
    from replica.model_loader import read_config_json

    raw = read_config_json(model_dir)
    if raw is None:
        return None
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    layers, heads, head_dim, hidden = (text.get(key) for key in
                                       ("num_hidden_layers", "num_attention_heads", "head_dim", "hidden_size"))
    if not all(isinstance(value, int) and value > 0 for value in (layers, heads)):
        return None
    if not (isinstance(head_dim, int) and head_dim > 0):
        if not (isinstance(hidden, int) and hidden > 0):
            return None
        head_dim = max(hidden // heads, 256)
    return kv_page_bytes(layers, heads, head_dim, page_size, dtype_bytes)


def kv_page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype_bytes: int) -> int:
    """One KV page's bytes: keys and values of every layer (``replica.page_pool.bytes_per_page``, without torch)."""
    return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype_bytes


def check_cluster_resources(config: ServeConfig, resources: dict, *, local: bool = True) -> str | None:
    """Replicas the cluster cannot place would leave the app half deployed (or waiting forever): say so at start.
    CPUs are checked for a Ray started here only (a joined cluster may add CPU nodes on demand)."""
    num_replicas = config.data_parallel_degree
    if config.devices == "gpu":
        num_gpus = int(resources.get("GPU", 0))
        if num_replicas > num_gpus:
            return (f"--data-parallel-degree {num_replicas} needs {num_replicas} GPUs "
                    f"but the Ray cluster has {num_gpus}; lower --data-parallel-degree or add GPU nodes")
    num_cpus = float(resources.get("CPU", 0))
    needed = num_replicas * float(config.num_cpus_per_replica)
    if local and needed > num_cpus + 1e-9:
        return (f"--data-parallel-degree {num_replicas} x --num-cpus-per-replica {config.num_cpus_per_replica:g} "
                f"needs {needed:g} CPUs but only {num_cpus:g} are available; lower --data-parallel-degree or "
                f"--num-cpus-per-replica (e.g. {max(0.1, round(num_cpus / num_replicas, 2)):g})")
    return None


def expose_project_to_workers() -> None:
    """Let Ray workers import cluster/replica/router when prefixserve runs from a source tree (not pip-installed)."""
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


def shut_down(local: bool) -> None:
    """Local: stop Serve and the Ray we started. Joined cluster: delete our app only and disconnect."""
    import ray
    from ray import serve

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    except Exception:  # noqa: BLE001 - best effort while exiting
        logger.warning("Serve did not shut down cleanly", exc_info=True)
    finally:
        ray.shutdown()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _raise_keyboard_interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())
