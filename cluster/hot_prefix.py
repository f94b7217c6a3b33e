"""Hot-prefix replication, the ingress's part: run the planner's actions (router/replication.py) against the replicas.

    router (in this process) --observe--> HotPrefixPlanner <--tick-- HotPrefixCopier (a task on the ingress's loop)
                                                                      | StartCopy  -> replicas.prefetch_prefix.remote()
                                                                      | CancelCopy -> that response's cancel()
                                                                      '-> report_done / report_failed

The planner is registered per deployment so the router Serve builds inside the ingress's handle finds it. Copies are
fire and forget: nothing on the request path awaits them, and every failure is counted (planner stats), never raised.
A ``PrefetchRequest`` carries ``target_replica``: the prefix-aware router sends it to exactly that replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from cluster.detached import create_detached_task
from common.types import PrefetchRequest, PrefetchResult
from router.replication import CancelCopy, HotPrefixPlanner, ReplicationConfig, StartCopy, register_planner

logger = logging.getLogger(__name__)

TICK_S = 0.25
"""How often the planner is ticked when no copy was just planned (budget refill, cancellations, timeouts)."""


class HotPrefixCopier:
    """Owns the planner for the replica deployment behind ``replicas`` (a Serve handle) and carries out its actions."""

    def __init__(self, replicas: Any, config: ReplicationConfig, *, tick_s: float = TICK_S) -> None:
        self.replicas = replicas
        self.planner = HotPrefixPlanner(config)
        self.tick_s = tick_s
        self._copy_to_response: dict[str, Any] = {}
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        deployment_id = replicas.deployment_id
        self._deployment = (deployment_id.app_name, deployment_id.name)
        register_planner(*self._deployment, self.planner)

    def ensure_started(self) -> None:
        """Start the ticking task on the running loop (first request; idempotent)."""
        if self._task is not None and not self._task.done():
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.planner.listener = self._poke
        self._task = create_detached_task(self._run())  # its copies must not be cancelled with that first request

    def stop(self) -> None:
        register_planner(*self._deployment, None)
        self.planner.listener = None
        if self._task is not None:
            self._task.cancel()
        for response in self._copy_to_response.values():
            response.cancel()
        self._copy_to_response.clear()

    # ---- internals -------------------------------------------------------------------------------------------------
    def _poke(self) -> None:
        """Called by the planner (maybe from the router's own loop thread) when a copy was planned."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                for action in self.planner.tick():
                    if isinstance(action, StartCopy):
                        self._start(action)
                    elif isinstance(action, CancelCopy):
                        self._cancel(action)
            except Exception:  # noqa: BLE001 - the ticker must outlive any one bad action
                logger.exception("hot-prefix replication: a planner tick failed")

    def _start(self, action: StartCopy) -> None:
        request = PrefetchRequest(copy_id=action.copy_id, target_replica=action.target, peer_hint=action.source,
                                  token_ids=list(action.token_ids), num_pages=action.num_pages,
                                  cache_salt=action.cache_salt)
        response = self.replicas.prefetch_prefix.remote(request)
        self._copy_to_response[action.copy_id] = response
        asyncio.get_running_loop().create_task(self._await(action, response))
        logger.info("hot-prefix replication: copying %d page(s) from %s to %s (%s)", action.num_pages,
                    action.source, action.target, action.copy_id)

    async def _await(self, action: StartCopy, response: Any) -> None:
        try:
            result = await response
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - cancelled here, target gone, replica error: counted
            if self._copy_to_response.pop(action.copy_id, None) is not None:
                logger.warning("hot-prefix copy %s to %s failed: %r", action.copy_id, action.target, error)
                self.planner.report_failed(action.copy_id)
            return
        self._copy_to_response.pop(action.copy_id, None)
        if isinstance(result, PrefetchResult) and result.num_pages_copied + result.num_pages_present > 0 and (
                result.replica_id == action.target):
            self.planner.report_done(action.copy_id, result.num_pages_copied)
        else:
            logger.warning("hot-prefix copy %s to %s copied nothing: %s", action.copy_id, action.target,
                           getattr(result, "error", result))
            self.planner.report_failed(action.copy_id)

    def _cancel(self, action: CancelCopy) -> None:
        response = self._copy_to_response.pop(action.copy_id, None)
        if response is not None:
            response.cancel()
            logger.info("hot-prefix copy %s cancelled: %s", action.copy_id, action.reason)
