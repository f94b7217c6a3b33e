"""What a page of KV at rest must match before a replica may reuse it, and the KV dtype table (no torch import).

The KV of one page has shape ``[num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.page_keys import KEY_FORMAT_VERSION

DTYPE_NAME_TO_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_NAME_TO_NUMPY: dict[str, str] = {"float32": "<f4", "bfloat16": "<u2", "float16": "<f2"}
"""The numpy dtype that holds a page's values in memory (numpy has no bfloat16: its bits, viewed back by torch)."""
"""The KV dtypes pages may be stored in (by torch's name, without "torch.": ``getattr(torch, name)`` is the dtype), and
their bytes per element."""


@dataclass(frozen=True)
class PageFormat:
    """Everything that must match before a stored page may be reused by this replica.

    The page key already folds in ``key_format_version``, ``model_fingerprint`` and ``page_size``; ``dtype`` is not
    part of the key, so tiers keep one namespace per dtype. The KV of one page has shape ``kv_shape``:
    ``[num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]``.
    """

    model_fingerprint: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    key_format_version: int = KEY_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAME_TO_ITEMSIZE:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; use one of {sorted(DTYPE_NAME_TO_ITEMSIZE)}")
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"PageFormat.{name} must be at least 1, got {getattr(self, name)}")
        if not self.model_fingerprint:
            raise ValueError("PageFormat.model_fingerprint must be non-empty; pass the loaded model's fingerprint")

    @property
    def kv_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)


    @property
    def page_num_bytes(self) -> int:
        """Bytes of KV in one page (headers not included)."""
        num_elements = 1
        for dim in self.kv_shape:
            num_elements *= dim
        return num_elements * DTYPE_NAME_TO_ITEMSIZE[self.dtype]


def dtype_name(dtype) -> str:
    """The name of a ``torch.dtype`` ("bfloat16"); ValueError for dtypes pages are not stored in."""
    name = str(dtype).removeprefix("torch.")
    if name in DTYPE_NAME_TO_ITEMSIZE:
        return name
    raise ValueError(f"unsupported KV dtype {dtype}; use one of {sorted(DTYPE_NAME_TO_ITEMSIZE)}")
