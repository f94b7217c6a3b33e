"""Configuration of one replica's engine: a frozen dataclass validated on construction, remedy in every message."""

from __future__ import annotations

from dataclasses import dataclass, field

PAGE_SIZE_MULTIPLE = 128


@dataclass(frozen=True)
class EngineConfig:
    """Everything one replica needs to start. Flags are parsed at the CLI; this only validates."""

    model: str | None = None
    """Local Hugging Face folder, a .gguf file, a hub id, or None for the bundled SmolLM2-135M-Instruct."""
    devices: str = "cpu"
    """"cpu" or "gpu" (CUDA)."""
    dtype: str = "auto"
    """"auto" (bfloat16 on GPU, the checkpoint's dtype or float32 on CPU), "float32" or "bfloat16"."""
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
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters to serve. Not supported together with prefix caching (pages are not keyed by adapter)."""
    num_threads: int = 1
    """torch intra-op threads for this replica (one per replica on small CPU boxes)."""
    seed: int = 0
    cache_dir: str | None = None
    """Where converted models are kept (default ~/.cache/prefixserve)."""
    replica_id: str = "replica-0"
    enable_peer_copy: bool = True
    """Copy a prefix held by another replica (named by the router) instead of recomputing it."""
    redis_url: str | None = None
    """Shared host tier; None disables it."""
    disk_cache_dir: str | None = None
    """Shared disk tier (Arrow IPC files); None disables it."""
    disk_cache_budget_bytes: int = 8 << 30
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size % PAGE_SIZE_MULTIPLE:
            raise ValueError(
                f"--kv-cache-page-size must be a positive multiple of {PAGE_SIZE_MULTIPLE} tokens, got "
                f"{self.page_size}; use 128, 256, ..."
            )
        if self.devices not in ("cpu", "gpu"):
            raise ValueError(f"--devices must be 'cpu' or 'gpu', got {self.devices!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {self.num_pages}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("the KV cache memory budget must be positive; raise --kv-cache-memory")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be at least 1, got {self.max_model_len}")
        if self.lora_adapters and self.enable_prefix_caching:
            raise ValueError(
                "LoRA adapters cannot share prefix-cache pages (pages are not keyed by adapter); "
                "start with --no-enable-prefix-caching"
            )
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
