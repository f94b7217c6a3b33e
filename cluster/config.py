"""Configuration of a whole prefixserve deployment: a frozen dataclass validated on construction, remedy in every message.

Flags are parsed only at the edge (cluster/cli.py) or read from a Serve config YAML's ``args`` (cluster/app.py); both
end here. ``ServeConfig.engine_config(replica_id)`` derives what one replica needs.

Memory sizes accept bytes or a suffixed string::

    "2GiB" -> 2 * 1024**3      "512MiB" -> 512 * 1024**2      "1.5GB" -> 1_500_000_000      "4096" -> 4096
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from replica.config import DEVICES, DTYPES, EngineConfig, KVEventsConfig, default_cache_dir, field_default
from router.policy import PolicyConfig
from router.replication import ReplicationConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
REPLICA_TRANSPORTS = ("grpc", "ray")
BUNDLED_MODEL_SERVED_NAME = "SmolLM2-135M-Instruct"

_MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_MEMORY_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")

# Serve config ``args`` keys that are spelled like the CLI flags rather than like the fields.
_KEY_ALIASES = {"kv_cache_page_size": "page_size"}


def parse_memory_size(value: int | str) -> int:
    """Bytes for ``value``: an int, or a string like "2GiB", "512MiB", "1.5GB", "4096". Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"a memory size must be a number of bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        return value
    match = _MEMORY_PATTERN.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError(
            f"cannot read the memory size {value!r}; write bytes or a number with a unit such as 2GiB, 512MiB, 1.5GB"
        )
    return int(float(match.group(1)) * _MEMORY_UNITS[unit])


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
"""Device files one of which a GPU driver creates (NVIDIA, ROCm, WSL's): without any, CUDA cannot be available."""


def gpu_driver_present() -> bool:
    """Whether a GPU driver's device file exists here. Asked first so that a machine without one does not import torch
    to learn it (~1 s of `prefixserve serve`'s start, before Ray)."""
    return any(os.path.exists(node) for node in GPU_DEVICE_NODES)


def detect_devices() -> str:
    """"gpu" when CUDA is visible here, else "cpu"."""
    if not gpu_driver_present():
        return "cpu"
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def num_visible_gpus() -> int:
    if not gpu_driver_present():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``prefixserve serve`` needs. Every field mirrors one CLI flag (``page_size``: --kv-cache-page-size).

    Settings a replica's engine also has take their defaults from ``EngineConfig`` and are validated there, once:
    ``__post_init__`` builds the engine config every replica starts from (``engine_config``)."""

    model: str | None = None
    """Hugging Face folder, .gguf file, hub id, or None for the bundled SmolLM2-135M-Instruct."""
    devices: str = field(default_factory=detect_devices)
    """"cpu" or "gpu"; defaults to gpu when CUDA is visible where the config is built."""
    data_parallel_degree: int = 1
    """Number of replicas, each a full copy of the model with its own KV cache."""
    enable_prefix_caching: bool = field_default(EngineConfig, "enable_prefix_caching")
    page_size: int = field_default(EngineConfig, "page_size")
    """Tokens per KV page, a multiple of 128."""
    enable_dp_cross_replica_prefix_copy: bool | None = None
    """Copy cached pages from the replica the router names (None: on exactly when prefix caching is on)."""
    kv_cache_memory: int | str = field_default(EngineConfig, "kv_cache_memory_bytes")
    """Bytes of KV pages per replica; a string like "2GiB" is converted to bytes on construction."""
    dtype: str = field_default(EngineConfig, "dtype")
    max_num_seqs: int = field_default(EngineConfig, "max_num_seqs")
    max_model_len: int | None = field_default(EngineConfig, "max_model_len")
    max_num_batched_tokens: int = field_default(EngineConfig, "max_num_batched_tokens")
    enforce_eager: bool = field_default(EngineConfig, "enforce_eager")
    """No torch.compile / CUDA graphs: the model runs eagerly."""
    kv_cache_retention_budget: float = field_default(EngineConfig, "kv_cache_retention_budget")
    """Fraction of each replica's pages that may hold a retention (priority + TTL) at once."""
    kv_cache_protected_fraction: float = field_default(EngineConfig, "kv_cache_protected_fraction")
    """Segmented LRU: the share of each replica's pages that reused pages may keep ahead of pages never reused."""
    host: str = "127.0.0.1"
    port: int = 8000
    direct_ingress: bool = True
    """When the CLI starts Ray here: the ingress replica serves HTTP on ``port`` itself (Ray Serve's direct ingress),
    without Serve's HTTP proxy process in front of it (the proxy moves to a free port). One process hop less for every
    request and every streamed message (BENCHMARKS.md: 4-stream TPOT 40-52 -> 26-30 ms on 2 cores). On a cluster
    joined with ``--ray-address`` it is the cluster's setting (``RAY_SERVE_ENABLE_DIRECT_INGRESS`` at ``ray start``)."""
    output_channels: bool = True
    """Streamed outputs after a request's first come to the ingress on one output channel per replica, one message
    per engine step for all the requests there, instead of one message per request per step (cluster/
    output_channels.py). Off: every output on its request's own stream."""
    request_lanes: bool = True
    """The ingress sends requests to the replica its router chose over a TCP connection of its own to each replica
    (a request lane, replica/request_lane.py), instead of through Serve's handle and gRPC transport: ~1.4 ms less of
    a short request's ~7 ms on 2 cores (BENCHMARKS.md 0zj). Requests that cannot take one (no lane open yet, the
    replica full, a request pinned to a replica) go through the handle. Off: every request through the handle."""
    replica_transport: str = "grpc"
    """How the ingress's streaming calls to the replicas travel (each request's outputs, the output channels):
    "grpc" is Ray Serve's gRPC transport between deployments (every replica runs an inter-deployment gRPC server);
    "ray" is Ray actor calls with streaming generators. Routing, queue lengths, cancellation and errors are the same
    either way; gRPC skips Ray's per-message reporting thread and object plumbing (BENCHMARKS.md 0m: a short request
    took 11.0-12.5 ms against 16.3 over actor calls, on 2 cores)."""
    api_key: str | None = None
    """When set, /v1/*, /metrics and (unless ``admin_api_key`` is set) /reset_prefix_cache and /admin/* require
    ``Authorization: Bearer <api_key>``."""
    redis_url: str | None = None
    """Shared host-memory tier (redis://host:port/db); None disables it."""
    redis_timeout: float = field_default(EngineConfig, "redis_timeout_s")
    """Seconds each call to the host tier may take (connect, read) before Redis counts as unreachable."""
    enable_disk_cache: bool | None = None
    """Shared disk tier (Arrow IPC files) on or off (None: on exactly when prefix caching is on). It is what shares
    prefixes between replicas on one machine when no Redis is configured."""
    disk_cache_dir: str | None = None
    """Folder of the disk tier (None: <prefixserve cache dir>/kv-pages)."""
    disk_cache_budget: int | str = field_default(EngineConfig, "disk_cache_budget_bytes")
    """Size budget of the disk tier; least recently used pages are deleted beyond it."""
    start_redis: bool = False
    """Start a local redis-server for the host tier (the CLI does: loopback only, a generated password; sets
    ``redis_url``)."""
    kv_tier_key_file: str | None = field_default(EngineConfig, "kv_tier_key_file")
    """File holding the cluster key that names, seals and authenticates shared-tier pages (None: this machine's
    ``<cache dir>/kv-tier.key``, created on first use)."""
    ray_address: str | None = None
    """Existing Ray cluster to join ("auto", "ray://...", "host:port"); None starts a local one."""
    log_level: str = "info"
    num_cpus_per_replica: float | None = None
    """Ray CPUs reserved per replica; its torch thread count is this rounded down (at least 1). None: this machine's
    CPUs but one shared out among the replicas when Ray is started here (``default_cpus_per_replica``), else 1."""
    num_prefill_threads: int | None = None
    """torch threads of a replica's long steps (prefill chunks of 64 tokens or more; decode steps keep the replica's
    own count). None: when Ray is started here and ``num_cpus_per_replica`` is not given either, the machine's CPUs
    shared out among the replicas (the core left to the HTTP processes is idle enough during a long step); else (a
    cluster, an explicit CPU count, GPU replicas) the replica's own thread count."""
    served_model_name: str | None = None
    """Name clients put in ``model``; defaults to the model folder's name (or SmolLM2-135M-Instruct)."""
    peer_copy_stream: bool = True
    """Peer copy between nodes over the holder's page stream (TCP, replica/page_stream.py), which the router names
    with its peer hint (else the first copy through Ray names it); off: every copy between nodes goes through Ray's
    object store."""
    route_on_tier_contents: bool | None = None
    """Replicas report the pages they stored in the shared tiers that the tiers still hold (routing stats ``tiers``),
    and the router prices them as tier fetches (router/policy.py ``enable_tier_routing``). Only with a shared tier.
    None (the default): on exactly when cross-replica prefix copy is off and a shared tier (Redis or disk) is on. Then
    the tiers are the only way one replica gets another's pages, and pricing them lowered the simulated p99 TTFT
    (BENCHMARKS.md 0t). With copy on, the router already prices the same move as a peer copy, and pricing the tiers
    too cost p99 (0b, 0s), so it stays off."""
    kv_events_config: KVEventsConfig | str | Mapping[str, Any] | None = None
    """vLLM-schema KV events over ZMQ (--kv-events-config): vLLM's JSON object, a mapping, or None (off)."""
    # ---- limits, admission, shutdown, access (issue 10) -------------------------------------------------------------
    max_request_body_bytes: int | str = "8MiB"
    """Largest request body the ingress reads; a bigger one is a 413 before it is parsed."""
    max_prompt_chars: int | None = None
    """Longest prompt in characters, checked before tokenizing (400). None: max_model_len * 16."""
    max_pending_tokenizations: int = 64
    """Requests waiting for the ingress's tokenizer thread at once; beyond them a 429."""
    request_timeout_s: float = 600.0
    """Deadline of one request from arrival to its last token; past it the request ends with a timeout error."""
    max_queued_requests: int = 64
    """Requests a replica holds waiting beyond its --max-num-seqs running ones (Serve lets max_num_seqs + this
    into a replica); up to this many per replica more may wait in the ingress for a free replica; beyond that new
    requests get 429 with Retry-After (Serve may refuse a little early when many arrive at once)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM: how long requests in flight may run to completion before they are ended with an error event."""
    metrics_api_key: str | None = None
    """A key that reads /metrics only (for scrapers). /metrics also accepts --api-key; with neither it is open."""
    admin_api_key: str | None = None
    """A key for /reset_prefix_cache, /admin/* and the x-prefixserve-target-replica pin header. None: --api-key
    (when set) is also the admin key."""
    metrics_cache_s: float = 1.0
    """/metrics is rendered at most once per this many seconds (scrapers share the result)."""
    require_redis: bool = False
    """Fail at start when --redis-url does not answer (default: a warning and the host tier off)."""
    router_cost_model: bool = True
    """The router picks the replica with the least estimated time to first token (router/policy.py, cost model);
    False: pure affinity with fallback (the replica holding the most leading pages among those not overloaded)."""
    router_residency_aging: bool = field_default(PolicyConfig, "enable_residency_aging")
    """The router counts a replica's pages as gone once its LRU eviction has likely reached them, except retained pages
    (until their TTL) and those of running requests (router/policy.py, "Residency ahead"); off by default: every
    reported page counts until its eviction is reported. Only with the cost model."""
    router_session_growth: float = field_default(PolicyConfig, "session_growth")
    """A chat's next turn moves to a replica whose cache its sessions would outgrow this many times over only to even
    the sessions out (router/policy.py, "Sessions"); 0: off. Only with the cost model (``router_cost_model``)."""
    router_session_start_growth: float = field_default(PolicyConfig, "session_start_growth")
    """A new chat whose leading pages (at least half its prompt) a replica holds starts there when that replica's
    sessions would outgrow its cache this many times over (router/policy.py, "Sessions"); 0: off. Only with the
    session rule on (``router_session_growth`` > 0)."""
    router_session_move_fill: float = field_default(PolicyConfig, "session_move_fill")
    """A chat leaves a replica whose sessions' prompts fill more than this fraction of its cache for one where they and
    the chat fit within it (router/policy.py, "Sessions"); 0: off. Only with the session rule on."""
    router_session_idle_factor: float = field_default(PolicyConfig, "session_idle_factor")
    """A chat whose latest answer finished longer ago than this many times the 99th percentile of the recent gaps
    between an answer and the chat's next turn no longer counts on its replica until its next turn (router/policy.py,
    "Sessions"); 0: off. Only with the session rule on."""
    # ---- hot-prefix replication (issue 12; router/replication.py) ---------------------------------------------------
    enable_hot_prefix_replication: bool = False
    """Copy a prefix whose holders are all busy to a less loaded replica ahead of need. Off by default: the router's
    reactive spread (busy holder -> peer copy on the moved request's path) already replicates it; simulated at DP
    4-64 the proactive copies changed neither median nor p99 TTFT, and on DP=2 sharing two CPU cores they cut p99 at
    a median cost (BENCHMARKS.md sections 0o, 0p)."""
    hot_prefix_min_requests: int = field_default(ReplicationConfig, "min_requests")
    """Requests of one prefix within the demand window (5 s) before it counts as hot."""
    hot_prefix_busy_requests: int = field_default(ReplicationConfig, "busy_requests")
    """Load (running + waiting requests) at which every holder of a hot prefix counts as busy: copy it elsewhere."""
    hot_prefix_copy_budget: int = field_default(ReplicationConfig, "budget_pages")
    """Pages copied ahead of need per 10 s, all prefixes together."""

    def __post_init__(self) -> None:
        def set_field(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        set_field("kv_cache_memory", parse_memory_size(self.kv_cache_memory))
        set_field("kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        cpus_defaulted = self.num_cpus_per_replica is None
        if cpus_defaulted:
            set_field("num_cpus_per_replica", default_cpus_per_replica(self.data_parallel_degree, self.ray_address))
        if self.num_prefill_threads is None:
            own = self.num_threads_per_replica if isinstance(self.num_cpus_per_replica, (int, float)) else 1
            shared_out = cpus_defaulted and self.devices != "gpu"  # an explicit CPU count, or a GPU: the replica's own
            set_field("num_prefill_threads", default_prefill_threads(self.data_parallel_degree, self.ray_address, own)
                      if shared_out else own)
        if self.enable_dp_cross_replica_prefix_copy is None:
            set_field("enable_dp_cross_replica_prefix_copy", self.enable_prefix_caching)
        if self.enable_disk_cache is None:
            set_field("enable_disk_cache", self.enable_prefix_caching)
        if self.route_on_tier_contents is None:
            set_field("route_on_tier_contents", bool(self.enable_prefix_caching and not
                                                     self.enable_dp_cross_replica_prefix_copy and
                                                     (self.redis_url or self.start_redis or
                                                      self.enable_disk_cache)))
        set_field("disk_cache_budget", parse_memory_size(self.disk_cache_budget))
        set_field("max_request_body_bytes", parse_memory_size(self.max_request_body_bytes))
        if self.served_model_name is None:
            set_field("served_model_name", default_served_model_name(self.model))
        self._validate()
        object.__setattr__(self, "_engine_template", self.engine_config("replica-0"))

    def _validate(self) -> None:
        if self.devices not in DEVICES:
            raise ValueError(f"--devices must be one of {', '.join(DEVICES)}, got {self.devices!r}")
        if not isinstance(self.data_parallel_degree, int) or self.data_parallel_degree < 1:
            raise ValueError(f"--data-parallel-degree must be an integer >= 1, got {self.data_parallel_degree!r}")
        if self.devices == "gpu" and self.ray_address is None:
            num_gpus = num_visible_gpus()
            if self.data_parallel_degree > num_gpus:
                raise ValueError(
                    f"--data-parallel-degree {self.data_parallel_degree} needs {self.data_parallel_degree} GPUs but "
                    f"{num_gpus} are visible; lower --data-parallel-degree, use --devices cpu, or join a cluster "
                    "with --ray-address"
                )
        if self.enable_dp_cross_replica_prefix_copy and not self.enable_prefix_caching:
            raise ValueError(
                "--enable-dp-cross-replica-prefix-copy copies prefix-cache pages, so it needs prefix caching; "
                "drop it or drop --no-enable-prefix-caching"
            )
        if self.enable_hot_prefix_replication and not self.enable_dp_cross_replica_prefix_copy:
            raise ValueError(
                "--enable-hot-prefix-replication copies prefixes between replicas, so it needs "
                "--enable-dp-cross-replica-prefix-copy (and prefix caching); drop it or turn copying on"
            )
        self.replication_config()  # raises with the flag's rule
        if self.replica_transport not in REPLICA_TRANSPORTS:
            raise ValueError(f"--replica-transport must be one of {', '.join(REPLICA_TRANSPORTS)}, "
                             f"got {self.replica_transport!r}")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port!r}")
        if not self.host:
            raise ValueError("--host must not be empty; use 127.0.0.1 (local) or 0.0.0.0 (all interfaces)")
        for flag, growth in (("--router-session-growth", self.router_session_growth),
                             ("--router-session-start-growth", self.router_session_start_growth),
                             ("--router-session-move-fill", self.router_session_move_fill),
                             ("--router-session-idle-factor", self.router_session_idle_factor)):
            if isinstance(growth, bool) or not (isinstance(growth, (int, float)) and 0 <= growth < 1e6):
                raise ValueError(f"{flag} must be a number >= 0 (0: off), got {growth!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty; omit it to serve without authentication")
        if self.redis_url is not None and not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ValueError(
                f"--redis-url must start with {', '.join(_REDIS_SCHEMES)}, got {self.redis_url!r}; "
                "e.g. redis://127.0.0.1:6379/0"
            )
        if self.start_redis and self.redis_url:
            raise ValueError("--start-redis starts its own redis-server; drop --redis-url or --start-redis")
        if not self.enable_prefix_caching:
            for flag, value in (("--redis-url", self.redis_url), ("--disk-cache-dir", self.disk_cache_dir),
                                ("--enable-disk-cache", self.enable_disk_cache), ("--start-redis", self.start_redis)):
                if value:
                    raise ValueError(
                        f"{flag} shares prefix-cache pages, so it needs prefix caching; drop {flag} or drop "
                        "--no-enable-prefix-caching"
                    )
        if self.kv_tier_key_file is not None and self.enable_prefix_caching:
            problem = key_file_problem(self.kv_tier_key_file)
            if problem:
                raise ValueError(f"--kv-tier-key-file {self.kv_tier_key_file}: {problem}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if not isinstance(self.num_cpus_per_replica, (int, float)) or self.num_cpus_per_replica <= 0:
            raise ValueError(f"--num-cpus-per-replica must be positive, got {self.num_cpus_per_replica!r}")
        if (not isinstance(self.num_prefill_threads, int) or isinstance(self.num_prefill_threads, bool)
                or self.num_prefill_threads < 1):
            raise ValueError(f"--num-prefill-threads must be an integer >= 1, got {self.num_prefill_threads!r}")
        if not self.served_model_name:
            raise ValueError("--served-model-name must not be empty; omit it to use the model folder's name")
        self._validate_limits()

    def _validate_limits(self) -> None:
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"--max-request-body-bytes must be at least 1024, got {self.max_request_body_bytes}")
        if self.max_prompt_chars is not None and (not isinstance(self.max_prompt_chars, int)
                                                  or self.max_prompt_chars < 1):
            raise ValueError(f"--max-prompt-chars must be a positive integer, got {self.max_prompt_chars!r}")
        for flag, value, low in (("--max-pending-tokenizations", self.max_pending_tokenizations, 1),
                                 ("--max-queued-requests", self.max_queued_requests, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
        for flag, value in (("--request-timeout", self.request_timeout_s),
                            ("--shutdown-timeout", self.shutdown_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{flag} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.metrics_cache_s, (int, float)) or self.metrics_cache_s < 0:
            raise ValueError(f"--metrics-cache-s must be >= 0 seconds, got {self.metrics_cache_s!r}")
        for flag, value in (("--metrics-api-key", self.metrics_api_key), ("--admin-api-key", self.admin_api_key)):
            if value is not None and not value.strip():
                raise ValueError(f"{flag} must not be empty; omit it instead")
        if self.require_redis and not (self.redis_url or self.start_redis):
            raise ValueError("--require-redis needs --redis-url (or --start-redis)")

    # ---- access ----------------------------------------------------------------------------------------------------
    @property
    def effective_admin_api_key(self) -> str | None:
        """The key admin routes and the pin header need (None: open)."""
        return self.admin_api_key or self.api_key

    @property
    def metrics_api_keys(self) -> tuple[str, ...]:
        """Keys /metrics accepts (empty: open)."""
        return tuple(key for key in (self.metrics_api_key, self.api_key, self.admin_api_key) if key)

    # ---- derived ---------------------------------------------------------------------------------------------------
    def replication_config(self) -> ReplicationConfig:
        """The hot-prefix planner's settings (ValueError naming the flag when one is out of range)."""
        try:
            return ReplicationConfig(min_requests=self.hot_prefix_min_requests,
                                     busy_requests=self.hot_prefix_busy_requests,
                                     budget_pages=self.hot_prefix_copy_budget)
        except ValueError as error:
            raise ValueError(f"--hot-prefix-min-requests, --hot-prefix-busy-requests and --hot-prefix-copy-budget "
                             f"must be integers >= 1 ({error})") from None

    @property
    def num_threads_per_replica(self) -> int:
        """torch intra-op threads of one replica: its reserved CPUs rounded down, at least one."""
        return max(1, int(self.num_cpus_per_replica))

    def engine_config(self, replica_id: str) -> EngineConfig:
        """What the replica named ``replica_id`` builds its engine from (validated when this config was built)."""
        template = getattr(self, "_engine_template", None)
        if template is not None:
            return dataclasses.replace(template, replica_id=replica_id)
        return EngineConfig(
            model=self.model,
            devices=self.devices,
            dtype=self.dtype,
            page_size=self.page_size,
            kv_cache_memory_bytes=int(self.kv_cache_memory),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            enforce_eager=self.enforce_eager,
            num_threads=self.num_threads_per_replica,
            num_prefill_threads=self.num_prefill_threads,
            replica_id=replica_id,
            enable_peer_copy=bool(self.enable_dp_cross_replica_prefix_copy),
            redis_url=self.redis_url,
            redis_timeout_s=self.redis_timeout,
            disk_cache_dir=self.resolved_disk_cache_dir,
            disk_cache_budget_bytes=int(self.disk_cache_budget),
            kv_tier_key_file=self.kv_tier_key_file,
            kv_cache_retention_budget=float(self.kv_cache_retention_budget),
            kv_cache_protected_fraction=float(self.kv_cache_protected_fraction),
            kv_events_config=self.kv_events_config,
            route_on_tier_contents=bool(self.route_on_tier_contents),
            peer_copy_stream=bool(self.peer_copy_stream),
        )

    @property
    def resolved_disk_cache_dir(self) -> str | None:
        """The disk tier's folder, or None when the disk tier is off."""
        if not self.enable_disk_cache:
            return None
        if self.disk_cache_dir:
            return self.disk_cache_dir
        return str(default_cache_dir() / "kv-pages")

    @classmethod
    def from_mapping(cls, args: Mapping[str, Any] | None) -> "ServeConfig":
        """Build from a Serve config YAML's ``args`` (keys as field names or flag names, '-' or '_').

        ``ray_address`` defaults to "auto" (the app is built inside a cluster). Raises ValueError naming unknown keys.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw_key, value in (args or {}).items():
            key = str(raw_key).lstrip("-").replace("-", "_")
            key = _KEY_ALIASES.get(key, key)
            if key not in names:
                raise ValueError(f"unknown prefixserve setting {raw_key!r}; known settings: {', '.join(sorted(names))}")
            kwargs[key] = value
        # A Serve config is always applied inside a running Ray cluster: its GPUs, not this process's, are the limit.
        kwargs.setdefault("ray_address", "auto")
        return cls(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain values (the api key masked), for logs."""
        values = dataclasses.asdict(self)
        for name in ("api_key", "metrics_api_key", "admin_api_key"):
            if values.get(name):
                values[name] = "***"
        if values["redis_url"]:
            values["redis_url"] = redact_url(values["redis_url"])
        return values


MIN_KEY_FILE_BYTES = 32  # replica.tiers.seal.MIN_SECRET_BYTES (not imported: the ingress imports no torch)


def key_file_problem(path: str) -> str | None:
    """Why ``path`` cannot be the cluster key file (missing, not a regular file, too short), or None."""
    import stat as stat_module

    try:
        info = os.stat(os.path.expanduser(path))
    except OSError as error:
        return f"cannot read it ({error.strerror}); create one with `python -c 'import secrets; " \
               f"print(secrets.token_hex(32))' > {path}; chmod 600 {path}`"
    if not stat_module.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_size < MIN_KEY_FILE_BYTES:
        return f"it holds {info.st_size} bytes; a key needs at least {MIN_KEY_FILE_BYTES} (e.g. secrets.token_hex(32))"
    return None


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ***, for logs and messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def default_served_model_name(model: str | None) -> str:
    """The name clients use when --served-model-name is not given: the folder or file stem, or the hub id."""
    if model is None:
        return BUNDLED_MODEL_SERVED_NAME
    path = Path(model).expanduser()
    if path.exists():
        return path.stem if path.is_file() else (path.resolve().name or str(model))
    return str(model)


def default_prefill_threads(data_parallel_degree: int, ray_address: str | None, num_threads: int) -> int:
    """Threads of a replica's long steps when not given: when Ray starts here, this machine's CPUs shared out among
    the replicas (with DP=1 on 2 cores: 2, against 1 for decode steps; a 256-token chunk over a cached 1536-token
    prefix took half the time); on a cluster, or when that is fewer, the replica's own count."""
    if ray_address is not None or not isinstance(data_parallel_degree, int) or data_parallel_degree < 1:
        return num_threads
    return max(num_threads, (os.cpu_count() or 1) // data_parallel_degree)


def default_cpus_per_replica(data_parallel_degree: int, ray_address: str | None) -> float:
    """CPUs per replica when not given and Ray starts here: this machine's CPUs but one (the HTTP proxy, the ingress
    and Serve's own actors need a core: with DP=1 on 2 cores, 2 engine threads made every request slower than 1,
    benchmarks/serving_overhead.py in BENCHMARKS.md) shared out among the replicas, at least 1; on a cluster, 1."""
    if ray_address is not None or not isinstance(data_parallel_degree, int) or data_parallel_degree < 1:
        return 1.0
    return float(max(1, ((os.cpu_count() or 1) - 1) // data_parallel_degree))
