"""Page keys: the one identity of a page of KV, shared by the replica cache, the router index and every shared tier.

A page holds ``page_size`` tokens. Only full pages are keyed::

    tokens   | t0 ... t127 | t128 ... t255 | t256 ... t300 |
    pages    |   page 0    |    page 1     | (partial: no key)
    keys     |     k0      |      k1       |

    k0 = H(KEY_FORMAT_VERSION, model_fingerprint, salt,  page_size, b"",  tokens of page 0)
    k1 = H(KEY_FORMAT_VERSION, model_fingerprint, None,  page_size, k0,   tokens of page 1)

H is blake2b (32-byte digest) over a canonical msgpack encoding, never Python's ``hash()``, so keys agree across
processes and machines. Because each key folds in its parent, equal keys mean equal whole prefixes (up to a hash
collision, which the shared tiers rule out by comparing stored token ids before reuse).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import msgpack

KEY_FORMAT_VERSION = 1
"""Bump whenever the byte encoding below changes; shared tiers record it and refuse other versions."""

PageKey = bytes
"""A 32-byte blake2b digest."""

KEY_NUM_BYTES = 32


def hash_page(
    parent_key: PageKey | None,
    token_ids: Sequence[int],
    *,
    page_size: int,
    model_fingerprint: str,
    salt: str | None = None,
) -> PageKey:
    """Key of one full page given its parent's key (None for page 0). ``salt`` only matters for page 0."""
    if len(token_ids) != page_size:
        raise ValueError(f"only full pages are keyed: got {len(token_ids)} tokens, page_size is {page_size}")
    payload = msgpack.packb(
        [
            KEY_FORMAT_VERSION,
            model_fingerprint,
            salt if parent_key is None else None,
            page_size,
            parent_key or b"",
            list(token_ids),
        ],
        use_bin_type=True,
    )
    return hashlib.blake2b(payload, digest_size=KEY_NUM_BYTES).digest()


def compute_page_keys(
    token_ids: Sequence[int],
    *,
    page_size: int,
    model_fingerprint: str,
    salt: str | None = None,
    parent_keys: Sequence[PageKey] = (),
) -> list[PageKey]:
    """Keys of every full page of ``token_ids``.

    ``parent_keys`` are keys already known for the leading pages (they are reused, not recomputed), so a growing
    sequence can extend its chain one page at a time.
    """
    num_full_pages = len(token_ids) // page_size
    keys = list(parent_keys[:num_full_pages])
    for page_index in range(len(keys), num_full_pages):
        start = page_index * page_size
        keys.append(
            hash_page(
                keys[-1] if keys else None,
                token_ids[start : start + page_size],
                page_size=page_size,
                model_fingerprint=model_fingerprint,
                salt=salt,
            )
        )
    return keys


def prefix_id_of(keys: Sequence[PageKey]) -> str:
    """The name of the prefix whose page keys are ``keys``: the hex of its last key, which depends on every page
    before it, the salt and the model (retained prefixes, the admin routes)."""
    return keys[-1].hex()[:32]
