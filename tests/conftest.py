"""Shared pytest fixtures: real external services the tests start themselves."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

REDIS_SERVER_BINARY = shutil.which("redis-server")


def find_free_port() -> int:
    """A free port on 127.0.0.1 between Ray's worker ports (10002-19999 by default) and the kernel's ephemeral range,
    so that no process binding port 0 meanwhile (Ray starts dozens) is handed it before the server the test starts
    binds it. (A port found by binding 0 can be handed out again: CI once saw a multinode case's Serve proxy fail
    with "Failed to bind to address".) Where the range cannot be read, or leaves no room, any free port."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(100 if low > 20100 else 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", random.randrange(20000, low)))
            except OSError:
                continue
            return sock.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PORT_TAKEN_MARKERS = ("address already in use", "failed to bind to address", "noavailableporterror")
"""How ``prefixserve serve`` says, as it exits, that its port was taken: its own check before starting Ray, or Serve's
direct ingress failing to bind it later."""


def port_was_taken(output: str) -> bool:
    """Whether a server's output says it exited because its port was taken (by another process, after the test found
    it free): the test may start it again on a fresh port."""
    return any(marker in output.lower() for marker in PORT_TAKEN_MARKERS)


class RedisProcess:
    """A private redis-server on 127.0.0.1: no persistence, 256 MB with LRU eviction (``extra_args`` override, e.g.
    ``("--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru")``). Can be stopped and restarted on the same port."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or find_free_port()
        self.extra_args = tuple(extra_args)
        self._process: subprocess.Popen | None = None
        self._may_change_port = port is None
        """Until the first start: a port found free here can be taken by another process before redis-server binds
        it; that start is then tried again on a fresh port (a restart keeps the port the test knows)."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        for _ in range(4 if self._may_change_port else 1):
            self._process = subprocess.Popen(
                [REDIS_SERVER_BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                 "no", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru", *self.extra_args],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout_s
            # ours answers, not another process on the port: the server that answers has our process id
            while not self._answers_as(self._process.pid):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            else:
                self._may_change_port = False
                return
            exited = self._process.poll() is not None
            self.stop()
            if not exited:  # it runs but does not answer: not a port clash
                break
            if self._may_change_port:
                self.port = find_free_port()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def _answers_as(self, pid: int) -> bool:
        """Whether a redis-server answers on the port and reports ``pid`` as its process id."""
        try:
            info = redis.Redis(port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2).info("server")
        except (redis.RedisError, OSError):
            return False
        return info.get("process_id") == pid


def _require_redis_server() -> None:
    if REDIS_SERVER_BINARY is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")


@pytest.fixture(scope="session")
def redis_server():
    """URL of a redis-server shared by the whole session. Tests isolate themselves with their own key prefix."""
    _require_redis_server()
    server = RedisProcess()
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_process_factory():
    """Start private redis-servers (``factory(port=None, extra_args=()) -> RedisProcess``) that a test may stop and
    restart; all are stopped at the end of the test."""
    _require_redis_server()
    started: list[RedisProcess] = []

    def start(port: int | None = None, extra_args: tuple[str, ...] = ()) -> RedisProcess:
        server = RedisProcess(port, extra_args)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# ---- Ray and Ray Serve, started once per session ----------------------------------------------------------------------
RAY_NUM_CPUS = 4
"""Logical CPUs of the session's local Ray (replicas reserve 0.5 each; the box has 2 real cores)."""


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray started once for the whole session (no usage stats, no auth token); shut down at the end.

    Workers inherit PYTHONPATH, so they import the repository's packages even when prefixserve is not installed.
    Yields the ``ray`` module.
    """
    import os
    from pathlib import Path

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=RAY_NUM_CPUS, include_dashboard=False, logging_level="warning")
    yield ray
    if started_here:
        try:
            from ray import serve

            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def serve_http_port(ray_session) -> int:
    """Ray Serve on the session's Ray, its HTTP proxy on a free 127.0.0.1 port (returned). Apps deployed by tests
    share it and must use their own route prefix; Serve is shut down with the session's Ray."""
    import ray
    from ray.serve.context import _get_global_client

    start_serve_on_a_free_port()
    # If Serve was already running (another test's serve.run), its proxy keeps its own port: ask the controller.
    return ray.get(_get_global_client()._controller.get_http_config.remote()).port


def start_serve_on_a_free_port(attempts: int = 3) -> None:
    """``serve.start`` with its HTTP proxy on a port found free; if another process took that port before the proxy
    bound it (serve.start raises "Failed to bind to address"), Serve is shut down and started on a fresh one."""
    from ray import serve

    for attempt in range(1, attempts + 1):
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": find_free_port()})
            return
        except Exception as error:  # noqa: BLE001 - a port clash is tried again, anything else raised
            if attempt == attempts or not port_was_taken(str(error)):
                raise
            serve.shutdown()


@pytest.fixture(autouse=True)
def weight_copies_whatever_the_free_memory(monkeypatch):
    """The packed and pair weight copies are made whatever memory this machine has free, so that the tests of the
    paths that use them do not depend on it (``cpu_kernels.weight_copies_fit``; its own tests clear this)."""
    monkeypatch.setenv("PREFIXSERVE_WEIGHT_COPY_SHARE", "1e12")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama (hidden 64, 2 layers, GQA 4/2 heads, vocab 1024) with a chat template, written once."""
    from bench.tiny_models import write_tiny_model

    out = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_model(out, arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=1024,
                     max_position_embeddings=2048)
    return str(out)
