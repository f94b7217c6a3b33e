"""Shared KV tiers behind a replica's own page pool: Redis host memory (``redis_tier``) and Arrow files on disk
(``disk_tier``), both behind the ``KVTier`` interface of ``base``. Import the tier modules directly; this package
only re-exports the interface types so that importing it needs neither redis nor pyarrow."""

from replica.tiers.base import KVTier, StoredPage

__all__ = ["KVTier", "StoredPage"]
