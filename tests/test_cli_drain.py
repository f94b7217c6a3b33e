"""SIGTERM drain of a real ``prefixserve serve`` process (issue 10), served by direct ingress (the ingress replica
listens on --port itself): in-flight requests complete, new ones are refused with 503, a stream still running at --shutdown-timeout ends with an error event and [DONE], the process exits 0 and
leaves none of the processes it started (its local Ray) running.

Its own local Ray (the CLI starts one), so it is marked slow: 90 s on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import find_free_port, port_was_taken
from cluster.reaper import live_descendants, live_start_time

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300
START_ATTEMPTS = 3
LONG_CONTEXT = 16384


def stream(base: str, max_tokens: int, out: dict) -> None:
    body = {"model": "tiny", "prompt": "def drained():", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        out["status"] = response.status_code
        out["lines"] = [line for line in response.iter_lines() if line]


def listener(port: int) -> tuple[int, str]:
    """(pid, process title: Ray sets ``ray::<actor>``) of the process listening on 127.0.0.1:``port``, from /proc
    ((0, "") if none)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(fields[9])
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes:
                    return int(fd_dir.parent.name), (fd_dir.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # a process gone, or not ours to read
            continue
    return 0, ""


def tiny_model(tmp_path: Path) -> Path:
    """The tiny Llama of conftest with a 16k context: a stream of 16000 tokens takes 15-40 s on any CPU here."""
    from bench.tiny_models import write_tiny_model

    model_dir = tmp_path / "tiny-llama-16k"
    write_tiny_model(model_dir, arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     vocab_size=1024, max_position_embeddings=LONG_CONTEXT)
    return model_dir


def start_server(tmp_path: Path, model_dir: Path):
    """``prefixserve serve`` in a session of its own (its pid is its process group), serving: (process, log, port)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    for attempt in range(1, START_ATTEMPTS + 1):
        # the port is found free here and bound by the server seconds later: if another process took it meanwhile,
        # the server exits saying so, and starts again on a fresh port
        port = find_free_port()
        log = open(tmp_path / "serve.log", "w")
        process = subprocess.Popen(
            [sys.executable, "-m", "cluster", "serve", "--model", str(model_dir), "--devices", "cpu", "--dtype",
             "float32", "--enforce-eager", "--port", str(port), "--served-model-name", "tiny", "--no-enable-disk-cache",
             "--kv-cache-memory", "16MiB", "--shutdown-timeout", "4", "--max-model-len", str(LONG_CONTEXT)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while "prefixserve: serving" not in (tmp_path / "serve.log").read_text() and process.poll() is None:
                assert time.monotonic() < deadline, "prefixserve serve did not start"
                time.sleep(1)
        except BaseException:
            process.kill()
            log.close()
            raise
        if process.poll() is None:
            return process, log, port
        log.close()
        output = (tmp_path / "serve.log").read_text()
        assert port_was_taken(output) and attempt < START_ATTEMPTS, output[-3000:]
    raise AssertionError("unreachable")


def assert_all_gone(started: dict[int, str], timeout_s: float = 30) -> None:
    """Every process of ``started`` (pid -> start time: a reused pid is not the same process) ends within
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {pid: t for pid, t in started.items() if live_start_time(pid) == t}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in left}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_sigterm_drains_then_exits_leaving_nothing_running(tmp_path):
    # the long stream is certain to be running when the 4 s drain timeout ends it
    model_dir = tiny_model(tmp_path)
    process, log, port = start_server(tmp_path, model_dir)
    base = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(f"{base}/health").status_code == 200
        # direct ingress (the default with a Ray started here): --port is the ingress replica's own server, which
        # has no Serve proxy routes; the proxy moved to the port the CLI names
        proxy_port = int(re.search(r"Serve's HTTP proxy at port (\d+)", (tmp_path / "serve.log").read_text()).group(1))
        ingress_pid, ingress_title = listener(port)
        assert "OpenAIIngress" in ingress_title
        # Ray's workers run at nice 15 unless told otherwise: the CLI's own Ray starts its replicas at nice 0
        assert os.getpriority(os.PRIO_PROCESS, ingress_pid) == 0
        assert "ProxyActor" in listener(proxy_port)[1]
        started = live_descendants(process.pid)
        assert len(started) >= 3  # gcs_server, raylet, workers ...

        short, long = {}, {}
        threads = [threading.Thread(target=stream, args=(base, 48, short)),
                   threading.Thread(target=stream, args=(base, LONG_CONTEXT - 384, long))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 120
        while "status" not in short or "status" not in long:  # both have their first token
            assert time.monotonic() < deadline, (short, long)
            assert all(thread.is_alive() or "status" in result for thread, result in zip(threads, (short, long))), (
                short, long)  # a stream thread that ended without a status failed: say so instead of waiting
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3  # the drain reaches the ingress (well inside the 4 s --shutdown-timeout)
        while httpx.get(f"{base}/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(f"{base}/health").status_code == 503
        for thread in threads:
            thread.join(60)

        # the short stream finished normally; the long one was ended at the timeout with an error event
        assert short["status"] == 200 and short["lines"][-1] == "data: [DONE]"
        assert json.loads(short["lines"][-2][6:])["choices"][0]["finish_reason"] == "length"
        assert long["status"] == 200 and long["lines"][-1] == "data: [DONE]"
        error = json.loads(long["lines"][-2][6:])["error"]
        assert error["code"] == "shutting_down" and "ended after" in error["message"]

        assert process.wait(timeout=120) == 0
        output = (tmp_path / "serve.log").read_text()
        # the short one may already be done when the drain call arrives: it is counted completed only if in flight
        assert re.search(r"prefixserve: drained: [01] request\(s\) completed, 1 ended at the timeout", output)
        assert_all_gone(started)
    finally:
        if process.poll() is None:
            process.kill()
        log.close()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_sigterm_to_the_whole_process_group_stops_at_once_leaving_nothing_running(tmp_path):
    """systemd's default stop (and ``kill -- -PGID``) signals every process of the group: the local Ray's agents and
    monitors die at once and its raylet soon after, so a drain would wait ~60 s for Ray to give up on them. The CLI
    sees one stop, gives the drain up, says so and exits; its reaper ends the replicas' workers (sessions of their own)."""
    process, log, _ = start_server(tmp_path, tiny_model(tmp_path))
    try:
        started = live_descendants(process.pid)
        os.killpg(process.pid, signal.SIGTERM)
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        output = (tmp_path / "serve.log").read_text()
        assert code == 0 and "got the signal too and stopped" in output, output[-3000:]
        assert_all_gone(started)
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
