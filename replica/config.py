"""Configuration of one replica's engine: a frozen dataclass validated on construction, remedy in every message.

The defaults written here are the only ones: ``cluster.config.ServeConfig`` and the CLI read them from this class.
Messages name the CLI flag, since that is where a user sets the value.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

PAGE_SIZE_MULTIPLE = 128
PREFILL_THREADS_MIN_TOKENS = 64
"""Steps of at least this many tokens run on ``EngineConfig.num_prefill_threads`` (CPU). A 256-token chunk over a
1536-token cached prefix took 94-126 ms on one thread and 48-69 ms on two (tiny Llama, bf16, AMX Xeon), while decode
steps on a second thread slowed serving: the HTTP proxy needs that core between tokens (BENCHMARKS.md section 0)."""
PREFILL_THREADS_MIN_KEYS = 65536
"""Steps whose rows attend at least this many keys in all (context plus new tokens, summed over the step's requests)
run on ``num_prefill_threads`` too, however few their tokens. Session 19 set it at 4096 (a decode batch of 4 rows of
~1800 keys is bound by reading its KV, and took 0.6x the time on two threads in process). With the serving path
lighter (session 21: Serve's gRPC transport, output channels), a second thread for those steps cost more than it gave
on a 2-core Zen 4 box: vLLM's prefix_repetition client measured higher request throughput and lower median TPOT in
4 of 4 bf16 pairs with such steps on one thread (BENCHMARKS.md section 0m), fp32 level or better. Steps of 16 or more
long contexts (64k keys) still take the prefill thread count; that size was not measured here."""
STEP_HELPER_MIN_TOKENS = 1
"""CPU, a replica that owns a second core (decode steps on one thread, ``num_prefill_threads`` >= 2, a CPU with the
pair kernel): every step of at least this many tokens that runs on one thread arms the step helper
(``replica.cpu_kernels.arm_step_helper``), a second thread that takes chunks of the pair kernel's output columns and
the decode attention kernel's items (row group, kv head) while the step runs, and sleeps between steps. Armed, the pair
kernel also takes steps of 17-64 rows (``cpu_kernels.max_shared_pair_rows``), which one thread's oneDNN GEMM ran
otherwise: decode batches of 17-63 requests. Over HTTP on the 2-core Zen 5 box (BENCHMARKS.md 0zf) it cut the float32
12-token request's prefill by 0.8 ms and the 4-stream TPOT by 5-16%, where OpenMP's second thread had made short steps
slower (``PREFILL_THREADS_MIN_TOKENS``); in process a decode step of 4 requests over 1792-token contexts took
0.70-0.75x the time. With 32 streams (0zg), the 17-64-row steps took vLLM's client's median TPOT from 40.6 to 34.3 ms
(bfloat16) and 59.3 to 41.6 ms (float32). ``PREFIXSERVE_STEP_HELPER=0``
(``STEP_HELPER_ENV``) in the replicas' environment turns it off, for a machine whose second core other work needs."""
STEP_HELPER_ENV = "PREFIXSERVE_STEP_HELPER"
DEVICES = ("cpu", "gpu")
DTYPES = ("auto", "float32", "bfloat16")
KV_EVENT_PUBLISHERS = ("null", "zmq")
BLOCK_HASH_FORMATS = ("int", "bytes")
CACHE_DIR_ENV = "PREFIXSERVE_CACHE_DIR"


def default_cache_dir() -> Path:
    """The folder for converted models and the disk tier: ``$PREFIXSERVE_CACHE_DIR``, else ``~/.cache/prefixserve``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "prefixserve"


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config``: vLLM's ``KVEventsConfig`` (same keys, defaults and meaning) plus ``block_hash_format``;
    the publisher is replica/kv_event_publisher.py."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    """"zmq" or "null"; None: "zmq" when events are enabled, else "null" (vLLM's rule)."""
    endpoint: str = "tcp://*:5557"
    """PUB address; one with "*", "::", ipc:// or inproc:// is bound, any other is connected to (vLLM's rule)."""
    replay_endpoint: str | None = None
    """ROUTER address answering replay requests (bound); None: no replay."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """ZMQ send high-water mark of the PUB socket."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; more are dropped (``num_dropped``)."""
    topic: str = ""
    block_hash_format: str = "int"
    """prefixserve's addition: "int" (a key's low 64 bits, vLLM's default) or "bytes" (the 32-byte page key)."""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"--kv-events-config: enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"--kv-events-config: publisher must be one of {', '.join(KV_EVENT_PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"--kv-events-config: {name} must be a string, got {getattr(self, name)!r}")
        if self.enabled and not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events-config: endpoint must be a tcp://, ipc:// or inproc:// address, "
                             f"got {self.endpoint!r}; e.g. tcp://*:5557")
        if self.replay_endpoint is not None and (
                not isinstance(self.replay_endpoint, str)
                or not self.replay_endpoint.startswith(("tcp://", "ipc://", "inproc://"))):
            raise ValueError(f"--kv-events-config: replay_endpoint must be a tcp://, ipc:// or inproc:// address or "
                             f"null, got {self.replay_endpoint!r}; e.g. tcp://*:5558")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= 1, got {value!r}")
        if self.block_hash_format not in BLOCK_HASH_FORMATS:
            raise ValueError(f"--kv-events-config: block_hash_format must be one of {', '.join(BLOCK_HASH_FORMATS)}, "
                             f"got {self.block_hash_format!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: "str | Mapping[str, Any] | KVEventsConfig | None") -> "KVEventsConfig | None":
        """From the flag's JSON text, a mapping (a Serve config YAML) or a config; None stays None. Unknown keys and
        bad JSON raise ValueError naming the problem."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"--kv-events-config must be a JSON object, e.g. "
                                 f"'{{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}}': {error}")
        if not isinstance(value, Mapping):
            raise ValueError(f"--kv-events-config must be a JSON object, got {type(value).__name__}")
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**dict(value))


@dataclass(frozen=True)
class EngineConfig:
    """Everything one replica needs to start. Flags are parsed at the CLI; this only validates."""

    model: str | None = None
    """Local Hugging Face folder, a .gguf file, a hub id, or None for the bundled SmolLM2-135M-Instruct."""
    devices: str = "cpu"
    """"cpu" or "gpu" (CUDA)."""
    dtype: str = "auto"
    """"auto" (bfloat16 on GPU and on CPUs with native bf16 matmuls (AMX / AVX512-BF16), else float32), "float32"
    or "bfloat16"."""
    page_size: int = 128
    """Tokens per KV page; a multiple of 128."""
    kv_cache_memory_bytes: int = 1 << 30
    """Memory budget of the page pool; the number of pages is derived from it unless ``num_pages`` is set."""
    num_pages: int | None = None
    """Exact number of pages (overrides ``kv_cache_memory_bytes``); used by tests to force eviction."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks plus decode tokens)."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's ``max_position_embeddings``."""
    enable_prefix_caching: bool = True
    num_threads: int = 1
    """torch intra-op threads for this replica (the CPUs it owns)."""
    num_prefill_threads: int | None = None
    """CPU: torch threads for steps of at least ``PREFILL_THREADS_MIN_TOKENS`` tokens (prefill chunks), which are
    compute-bound and scale with cores, or attending at least ``PREFILL_THREADS_MIN_KEYS`` keys in all; other decode
    steps keep ``num_threads``. None: ``num_threads``."""
    enforce_eager: bool = False
    """Run the model eagerly: no torch.compile, no CUDA graphs (debugging, or when compilation is unavailable)."""
    cache_dir: str | None = None
    """Where converted models are kept (default ~/.cache/prefixserve)."""
    replica_id: str = "replica-0"
    enable_peer_copy: bool = True
    """Copy a prefix held by another replica (named by the router) instead of recomputing it."""
    share_kv_pool: bool = True
    """With peer copy on a CPU: keep the page pool in shared memory, so that peers on this node copy pages straight
    out of it (replica/shared_pool.py) instead of through Ray's object store."""
    peer_copy_stream: bool = True
    """With the pool in shared memory, inside Ray: also send pages to peers on other nodes over TCP, straight out of
    the pool (replica/page_stream.py), instead of through Ray's object store; and ask peers on other nodes over
    theirs, as the router or their first answer through Ray names it."""
    redis_url: str | None = None
    """Shared host tier; None disables it."""
    redis_timeout_s: float = 0.5
    """Connect and read timeout of every call to the host tier: a Redis that does not answer within it counts as
    unreachable (misses are answered and writes dropped while it backs off; see replica/tiers/redis_tier.py)."""
    disk_cache_dir: str | None = None
    """Shared disk tier (Arrow IPC files); None disables it."""
    disk_cache_budget_bytes: int = 8 << 30
    kv_tier_key_file: str | None = None
    """The cluster key that names, seals and authenticates shared-tier pages (``replica.tiers.seal``); None: this
    machine's ``<cache dir>/kv-tier.key``, created on first use."""
    kv_cache_retention_budget: float = 0.5
    """Fraction of the page pool that may hold a retention (priority + TTL) at once, so that retained prefixes can
    never fill the pool: at least the rest is always in the default eviction order (priority 0)."""
    kv_cache_protected_fraction: float = 0.7
    """Segmented LRU (replica/page_pool.py): cached pages that were reused (a later request hit them, or they were
    copied or fetched for a request) are evicted only after the pages never reused, up to this fraction of the pool;
    0 is plain LRU."""
    kv_events_config: KVEventsConfig | None = None
    """Publish KV events in vLLM's schema over ZMQ (replica/kv_event_publisher.py); None: off."""
    route_on_tier_contents: bool = False
    """Report the pages this replica stored in the shared tiers that they still hold, in the routing stats
    (replica/event_log.py ``TierEventRelay``), so routers price them as tier fetches."""

    @property
    def prefill_threads(self) -> int:
        """``num_prefill_threads``, or ``num_threads`` when it is not set."""
        return self.num_prefill_threads or self.num_threads

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size <= 0 or self.page_size % PAGE_SIZE_MULTIPLE:
            raise ValueError(
                f"--kv-cache-page-size must be a positive multiple of {PAGE_SIZE_MULTIPLE} tokens, got "
                f"{self.page_size!r}; use 128, 256, ..."
            )
        if self.devices not in DEVICES:
            raise ValueError(f"--devices must be one of {', '.join(DEVICES)}, got {self.devices!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {self.num_pages}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory_bytes}; try 1GiB")
        for flag, value in (("--max-num-seqs", self.max_num_seqs),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"--max-model-len must be an integer >= 2, got {self.max_model_len!r}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.num_prefill_threads is not None and (
                not isinstance(self.num_prefill_threads, int) or isinstance(self.num_prefill_threads, bool)
                or self.num_prefill_threads < 1):
            raise ValueError(f"--num-prefill-threads must be an integer >= 1, got {self.num_prefill_threads!r}")
        if not isinstance(self.kv_cache_retention_budget, (int, float)) or not (
                0.0 <= self.kv_cache_retention_budget <= 1.0):
            raise ValueError(f"--kv-cache-retention-budget must be a fraction in [0, 1], got "
                             f"{self.kv_cache_retention_budget!r}; try 0.5")
        if (isinstance(self.kv_cache_protected_fraction, bool)
                or not isinstance(self.kv_cache_protected_fraction, (int, float))
                or not 0.0 <= self.kv_cache_protected_fraction <= 1.0):
            raise ValueError(f"--kv-cache-protected-fraction must be a fraction in [0, 1], got "
                             f"{self.kv_cache_protected_fraction!r}; try 0.7 (0: plain LRU)")
        if self.disk_cache_budget_bytes <= 0:
            raise ValueError(f"--disk-cache-budget must be positive, got {self.disk_cache_budget_bytes}; try 8GiB")
        if (isinstance(self.redis_timeout_s, bool) or not isinstance(self.redis_timeout_s, (int, float))
                or not 0 < self.redis_timeout_s <= 300):
            raise ValueError(f"--redis-timeout must be a number of seconds in (0, 300], got {self.redis_timeout_s!r}")


def field_default(config_class: type, name: str) -> Any:
    """The default of ``config_class.<name>`` (a dataclass), so that ServeConfig and the CLI do not restate it."""
    for item in fields(config_class):
        if item.name == name:
            return item.default
    raise KeyError(name)
