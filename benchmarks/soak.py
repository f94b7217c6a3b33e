"""Soak under faults (issue 10): N streaming clients for T seconds; at T/2 Redis is killed and one replica is killed
through Ray. Records requests and errors by kind, TTFT p50/p99 per phase, RSS of the app's processes before/after,
KV pages after, and whether anything the run started is left running after shutdown.

    python benchmarks/soak.py --clients 200 --duration 60 --out benchmarks/results/soak.json

Everything is real and started here: a local Ray, the prefixserve app (DP replicas of a tiny random Llama unless
--model is given), a private redis-server as the host tier. Phases: "before" = [0, T/2), "after" = [T/2, T); a
request belongs to the phase it started in. Error kinds: HTTP status for refusals (429 = shed, 503), the SSE error
event's code for streams cut mid-way (replica_lost, shutting_down ...), the exception class for client-side
failures. The expected errors are the streams running on the killed replica (replica_lost) and 429s while the
survivor is full; everything else is a defect.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.reaper import live_descendants, live_start_time  # noqa: E402 - after the path is set


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def rss_mib(pids) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return round(total / 1024, 1)


def serve_pids() -> list[int]:
    """The app's processes: Serve replicas (engine + ingress), proxy and controller of THIS Ray (raylet descendants)."""
    import ray._private.worker as ray_worker

    raylets = [info.process.pid for info in ray_worker._global_node.all_processes.get("raylet", [])]
    pids = []
    for raylet in raylets:
        for pid in live_descendants(raylet):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"ServeReplica" in cmd or b"ServeController" in cmd or b"ProxyActor" in cmd:
                pids.append(pid)
    comm = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids if live_start_time(pid)}
    return [pid for pid, name in comm.items() if name.startswith("ray::Serve") or name.startswith("ray::Proxy")]


class Redis:
    def __init__(self) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# ---- load ---------------------------------------------------------------------------------------------------------
SYSTEM_PROMPTS = [f"# project {index}: shared helpers\n" + "\n".join(
    f"def helper_{index}_{n}(value):\n    return value * {n} + {index}\n" for n in range(20)) for index in range(4)]


async def client_loop(client, base: str, stop_at: float, t0: float, records: list, rng: random.Random) -> None:
    import httpx

    while time.monotonic() < stop_at:
        prompt = rng.choice(SYSTEM_PROMPTS) + f"\n# request {rng.random()}\ndef task():"
        body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randint(8, 32), "temperature": 0,
                "stream": True, "ignore_eos": True}
        started = time.monotonic()
        record = {"start": started - t0, "ttft": None, "kind": "ok"}
        try:
            async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    record["kind"] = f"http_{response.status_code}"
                    await response.aread()
                    if response.status_code in (429, 503):
                        await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                else:
                    last = ""
                    async for line in response.aiter_lines():
                        if not line:
                            continue
                        last = line
                        if record["ttft"] is None:
                            record["ttft"] = time.monotonic() - started
                        if line.startswith('data: {"error"'):
                            record["kind"] = "sse_" + (json.loads(line[6:])["error"].get("code") or "error")
                    if record["kind"] == "ok" and last != "data: [DONE]":
                        record["kind"] = "no_done"
        except httpx.HTTPError as error:
            record["kind"] = type(error).__name__
        record["end"] = time.monotonic() - t0
        records.append(record)


async def run_load(base: str, clients: int, duration: float, faults, t0: float) -> list[dict]:
    import httpx

    records: list[dict] = []
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        stop_at = t0 + duration
        tasks = [asyncio.create_task(client_loop(client, base, stop_at, t0, records, random.Random(index)))
                 for index in range(clients)]
        await asyncio.sleep(max(0.0, t0 + duration / 2 - time.monotonic()))
        faults["at"] = time.monotonic() - t0
        await asyncio.get_running_loop().run_in_executor(None, faults["run"])
        await asyncio.gather(*tasks)
    return records


def summarize(records: list[dict], split_at: float) -> dict:
    phases = {}
    for phase, chosen in (("before", [r for r in records if r["start"] < split_at]),
                          ("after", [r for r in records if r["start"] >= split_at])):
        ttfts = [r["ttft"] for r in chosen if r["ttft"] is not None and r["kind"] == "ok"]
        phases[phase] = {
            "requests": len(chosen),
            "ok": sum(1 for r in chosen if r["kind"] == "ok"),
            "errors_by_kind": dict(Counter(r["kind"] for r in chosen if r["kind"] != "ok")),
            "ttft_p50_s": percentile(ttfts, 50) and round(percentile(ttfts, 50), 3),
            "ttft_p99_s": percentile(ttfts, 99) and round(percentile(ttfts, 99), 3),
        }
    return phases


def metric_values(text: str, name: str) -> dict[str, float]:
    values = {}
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        values[match.group(1)] = float(match.group(2))
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--data-parallel-degree", type=int, default=2)
    parser.add_argument("--model", default=None, help="model folder (default: a tiny random Llama written here)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]])
    scratch = Path(tempfile.mkdtemp(prefix="prefixserve-soak-"))
    model = args.model
    if model is None:
        from bench.tiny_models import write_tiny_model

        model = str(scratch / "tiny")
        write_tiny_model(model, arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         vocab_size=1024, max_position_embeddings=2048)
    redis = Redis()
    import httpx
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ServeConfig

    port = free_port()
    for attempt in range(3):  # Ray gives its raylet 30 s to register: a loaded shared machine can miss that
        try:
            ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, logging_level="error")
            break
        except Exception:  # noqa: BLE001 - retried, then raised
            ray.shutdown()
            if attempt == 2:
                raise
    ray_pids = [info.process.pid for infos in ray._private.worker._global_node.all_processes.values()
                for info in infos]
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(model=model, devices="cpu", data_parallel_degree=args.data_parallel_degree,
                             num_cpus_per_replica=0.5, served_model_name="tiny", dtype="float32", enforce_eager=True,
                             kv_cache_memory="64MiB", max_model_len=2048, redis_url=redis.url,
                             enable_disk_cache=False)
        serve.run(build_app(config), name="soak", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "warm up", "max_tokens": 2},
                   timeout=120).raise_for_status()
        pids_before = serve_pids()
        rss_before = rss_mib(pids_before)

        killed = {}

        def faults():
            redis.kill()
            text = httpx.get(f"{base}/metrics", timeout=30).text
            victim = sorted(metric_values(text, "prefixserve_kv_pages"))[0].split('"')[1]
            names = [a for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(f"#{victim}")]
            ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
            killed["replica"] = victim

        fault_info = {"run": faults}
        t0 = time.monotonic()
        records = asyncio.run(run_load(base, args.clients, args.duration, fault_info, t0))
        time.sleep(3)  # let cancelled streams and the replacement replica settle
        text = httpx.get(f"{base}/metrics", timeout=30).text
        rss_after = rss_mib(serve_pids())
        pages = metric_values(text, "prefixserve_kv_pages")
        result = {
            "command": " ".join([sys.executable, *sys.argv]),
            "machine": {"cpu": platform.processor() or cpu_model(), "cores": os.cpu_count(),
                        "load_avg_at_end": os.getloadavg()},
            "clients": args.clients, "duration_s": args.duration, "data_parallel_degree": args.data_parallel_degree,
            "faults_at_s": round(fault_info["at"], 1), "killed_replica": killed.get("replica"),
            "phases": summarize(records, fault_info["at"]),
            "rss_mib": {"before": rss_before, "after": rss_after, "processes_before": len(pids_before)},
            "kv_pages_after": pages,
            "ingress_counters": {name: metric_values(text, f"prefixserve_{name}_total") for name in
                                 ("rejected_requests", "aborted_requests", "drained_requests")},
            "retried_requests": re.findall(r"^prefixserve_retried_requests_total (\S+)$", text, re.M),
        }
    finally:
        serve.shutdown()
        ray.shutdown()
        redis.kill()
    time.sleep(5)
    left = [pid for pid in ray_pids if live_start_time(pid)]
    result["left_running_after_shutdown"] = left
    shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
