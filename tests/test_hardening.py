"""Hostile input, admission settings, fail-fast checks and the orphan reaper, without Ray (issue 10).

The HTTP-level and fault tests with real Ray Serve are in tests/test_e2e_faults.py; the SIGTERM drain of a real
``prefixserve serve`` process is in tests/test_cli_drain.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.config import ServeConfig
from cluster.protocol import (
    CHARS_PER_TOKEN_BOUND,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_prompt_chars,
    overloaded,
    parse_json_body,
    parse_request,
)


def parse(raw: bytes, model=CompletionRequest):
    return parse_request(model, parse_json_body(raw))


# ---- the three inputs that gave 500 -----------------------------------------------------------------------------------
def test_seed_out_of_64_bit_range_is_400_naming_seed():
    with pytest.raises(APIError) as error:
        parse(json.dumps({"prompt": "x", "seed": 2**70}).encode())
    assert (error.value.status, error.value.param) == (400, "seed")
    assert parse(json.dumps({"prompt": "x", "seed": 2**63 - 1}).encode()).seed == 2**63 - 1


@pytest.mark.parametrize("raw", [b'{"prompt": "a\\ud800b"}', b'{"prompt": "ok", "user": "\\udfff"}',
                                 b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}',
                                 b'{"prompt": "x", "\\ud800": 1}'])
def test_lone_surrogates_anywhere_are_400(raw):
    with pytest.raises(APIError, match="not valid Unicode") as error:
        parse_json_body(raw)
    assert error.value.status == 400


def test_a_valid_surrogate_pair_is_fine():
    assert parse(b'{"prompt": "smile \\ud83d\\ude00"}').prompt == "smile \U0001F600"


@pytest.mark.parametrize("depth", [33, 10_000, 100_000])
def test_deep_nesting_is_400(depth):
    raw = b'{"prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(APIError, match="too deeply") as error:
        parse_json_body(raw)
    assert error.value.status == 400


def test_nesting_within_the_limit_is_accepted():
    raw = b'{"prompt": "x", "extra": ' + b"[" * 30 + b"]" * 30 + b"}"
    assert parse_json_body(raw)["prompt"] == "x"


@pytest.mark.parametrize(
    ("body", "param"),
    [({"max_tokens": 2**40}, "max_tokens"), ({"top_k": 2**40}, "top_k"), ({"top_k": -5}, "top_k"),
     ({"stop_token_ids": [2**40]}, "stop_token_ids"), ({"temperature": 1e400}, "temperature"),
     ({"top_p": float("nan")}, "top_p"), ({"seed": -(2**64)}, "seed")],
)
def test_numeric_fields_are_range_checked(body, param):
    raw = json.dumps({"prompt": "x", **body}).encode()  # json writes 1e400 as Infinity, nan as NaN
    with pytest.raises(APIError) as error:
        parse(raw)
    assert (error.value.status, error.value.param) == (400, param)


def test_chat_max_completion_tokens_is_range_checked():
    raw = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**40}).encode()
    with pytest.raises(APIError) as error:
        parse(raw, ChatCompletionRequest)
    assert error.value.param == "max_completion_tokens"


def test_prompt_characters_are_checked_before_tokenizing():
    check_prompt_chars(100, max_chars=100, param="prompt")
    with pytest.raises(APIError, match="101 characters") as error:
        check_prompt_chars(101, max_chars=100, param="messages")
    assert (error.value.status, error.value.param) == (400, "messages")


def test_prompt_chars_counts_the_text_of_each_kind():
    """A chat message counts one token's worth of characters besides its text (the template renders it)."""
    from cluster.openai_api import prompt_chars

    assert prompt_chars(parse(b'{"prompt": "abcd"}'), "completion") == (4, "prompt")
    assert prompt_chars(parse(b'{"prompt": [1, 2, 3]}'), "completion") == (3, "prompt")
    chat = parse(b'{"messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": '
                 b'[{"type": "text", "text": "cde"}]}]}', ChatCompletionRequest)
    assert prompt_chars(chat, "chat") == (5 + 2 * CHARS_PER_TOKEN_BOUND, "messages")


def test_overloaded_is_openai_shaped_429_with_retry_after():
    error = overloaded("full", 2)
    assert (error.status, error.reason, error.headers()) == (429, "overloaded", {"Retry-After": "2"})
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    assert APIError("bad").reason == "invalid_request"
    assert APIError("big", status=413, code="request_too_large").reason == "request_too_large"


# ---- configuration: admission, keys, fail-fast ------------------------------------------------------------------------
def config(**overrides) -> ServeConfig:
    return ServeConfig(**{"model": "m", "devices": "cpu", **overrides})


def test_admission_bounds_each_replica_and_the_ingress_queue():
    from cluster.app import replica_admission

    assert replica_admission(config(max_num_seqs=8, max_queued_requests=4, data_parallel_degree=3)) == {
        "max_ongoing_requests": 14, "max_queued_requests": 12}  # + the ingress's output channel and request lane
    assert replica_admission(config(max_num_seqs=8, max_queued_requests=4, output_channels=False))[
        "max_ongoing_requests"] == 13
    assert replica_admission(config(max_num_seqs=8, max_queued_requests=4, output_channels=False,
                                    request_lanes=False))["max_ongoing_requests"] == 12
    assert replica_admission(config(max_num_seqs=8, max_queued_requests=0))["max_queued_requests"] == 1


def test_keys_for_metrics_and_admin():
    assert config().metrics_api_keys == () and config().effective_admin_api_key is None
    assert config(api_key="a").metrics_api_keys == ("a",) and config(api_key="a").effective_admin_api_key == "a"
    both = config(api_key="a", metrics_api_key="m", admin_api_key="z")
    assert both.metrics_api_keys == ("m", "a", "z") and both.effective_admin_api_key == "z"
    assert both.as_dict()["admin_api_key"] == "***" and both.as_dict()["metrics_api_key"] == "***"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"max_request_body_bytes": "1KB"}, "--max-request-body-bytes"), ({"max_prompt_chars": 0}, "--max-prompt-chars"),
     ({"max_queued_requests": -1}, "--max-queued-requests"), ({"shutdown_timeout_s": 0}, "--shutdown-timeout"),
     ({"request_timeout_s": -1}, "--request-timeout"), ({"admin_api_key": " "}, "--admin-api-key"),
     ({"require_redis": True}, "--require-redis needs --redis-url")],
)
def test_limit_settings_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_more_replicas_than_cpus_fails_with_the_remedy():
    from cluster.cli import check_cluster_resources

    problem = check_cluster_resources(config(data_parallel_degree=4, num_cpus_per_replica=1.0), {"CPU": 2.0})
    assert problem.startswith("--data-parallel-degree 4 x --num-cpus-per-replica 1 needs 4 CPUs but only 2")
    assert "--num-cpus-per-replica (e.g. 0.5)" in problem
    assert check_cluster_resources(config(data_parallel_degree=4, num_cpus_per_replica=0.5), {"CPU": 2.0}) is None
    assert check_cluster_resources(config(data_parallel_degree=4, num_cpus_per_replica=1.0), {"CPU": 2.0},
                                   local=False) is None


def test_kv_budget_below_two_pages_fails_with_the_size_needed(tiny_llama_dir):
    from cluster.cli import check_kv_budget

    # tiny Llama: 2 layers x 2 (K, V) x 128 tokens x 2 KV heads x 16 dims x 4 bytes = 65536 bytes per page
    problem = check_kv_budget(config(model=tiny_llama_dir, kv_cache_memory="100KiB", dtype="float32"),
                              Path(tiny_llama_dir))
    assert problem == ("--kv-cache-memory 102400 bytes holds 1 KV page(s) of this model (65536 bytes each at page "
                       "size 128); one request needs at least 2: raise --kv-cache-memory to 131072 bytes or more")
    assert check_kv_budget(config(model=tiny_llama_dir, kv_cache_memory="128KiB", dtype="float32"),
                           Path(tiny_llama_dir)) is None


def test_the_kv_budget_bound_is_never_below_the_exact_page(tiny_llama_dir, tmp_path):
    """``cluster.cli.kv_page_bytes_bound``: from config.json alone, at least the exact page size (so a budget that
    holds two pages at the bound holds them exactly); None where the file does not say enough."""
    from cluster.cli import kv_page_bytes_bound

    exact = 2 * 2 * 128 * 2 * 16 * 4  # the tiny Llama's page (above): 2 KV heads of its 4 attention heads
    bound = kv_page_bytes_bound(Path(tiny_llama_dir), 128, 4)
    assert bound >= exact and bound == exact * 2  # every attention head counted as a KV head

    def bound_of(raw):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        return kv_page_bytes_bound(tmp_path, 128, 2)

    no_head_dim = {"num_hidden_layers": 3, "num_attention_heads": 4}
    assert bound_of({**no_head_dim, "hidden_size": 64}) == 3 * 2 * 128 * 4 * 256 * 2  # at least 256 (Gemma's default)
    assert bound_of({**no_head_dim, "hidden_size": 4096}) == 3 * 2 * 128 * 4 * 1024 * 2
    assert bound_of({"text_config": {"num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8}}) == 8192
    assert bound_of({"num_attention_heads": 4, "head_dim": 8}) is None
    assert bound_of({"num_hidden_layers": 1, "num_attention_heads": 2}) is None
    assert bound_of([1, 2]) is None
    (tmp_path / "config.json").write_text("{not json")
    assert kv_page_bytes_bound(tmp_path, 128, 2) is None


def test_the_checks_before_ray_import_neither_torch_nor_transformers(tiny_llama_dir):
    """``prefixserve serve``'s checks before Ray starts (the device, the model, the KV budget, the port) read files:
    importing torch and transformers there took ~4 s of every start. On a machine without a GPU driver, and with a
    budget that holds the model's pages at their bound, neither is imported; nor by building the Serve application
    (``cluster.app``, whose replica class imports the engine's modules only where a replica is built: 2.4 s of the
    command's process, BENCHMARKS.md 0zr)."""
    from tests.conftest import find_free_port

    script = f"""
import sys
import cluster.config
cluster.config.GPU_DEVICE_NODES = ("/nonexistent/nvidiactl",)  # as on a machine without a GPU driver
from cluster import cli
config = cli.config_from_args(cli.build_parser().parse_args(
    ["serve", "--model", {tiny_llama_dir!r}, "--port", "{find_free_port()}", "--kv-cache-memory", "64MiB"]))
checked = cli.check_local_start(config)
from cluster.app import build_app
build_app(config)
print(config.devices, checked, "torch" in sys.modules, "transformers" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.split() == ["cpu", "None", "False", "False"], result.stderr


def test_unreachable_redis_warns_and_turns_the_tier_off_or_fails_when_required():
    from cluster.cli import check_redis
    from tests.conftest import find_free_port

    url = f"redis://:hunter2@127.0.0.1:{find_free_port()}/0"
    checked, problem = check_redis(config(redis_url=url))
    assert problem is None and checked.redis_url is None
    checked, problem = check_redis(config(redis_url=url, require_redis=True))
    assert checked.redis_url == url and "does not answer" in problem and "hunter2" not in problem


def test_start_up_failure_reports_the_replicas_cause():
    from cluster.cli import cause_of

    wrapped = RuntimeError(
        "Deploying application prefixserve failed: ...\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
        "ray.exceptions.RayTaskError(ValueError): ray::ServeReplica.initialize_and_get_metadata()\n"
        "ValueError: the KV budget of 1048576 bytes holds 0 page(s); raise --kv-cache-memory\n"
        "RuntimeError: replica failed to start")
    assert cause_of(wrapped) == "ValueError: the KV budget of 1048576 bytes holds 0 page(s); raise --kv-cache-memory"
    assert cause_of(RuntimeError("plain")) == "plain"


def test_loopback_host_makes_the_local_ray_listen_on_loopback(monkeypatch):
    from cluster import cli

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    assert cli.local_ray_options(config(host="0.0.0.0")) == {}
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    assert cli.local_ray_options(config(host="127.0.0.1", ray_address="auto")) == {}
    assert cli.local_ray_options(config(host="127.0.0.1")) == {"_node_ip_address": "127.0.0.1",
                                                               "dashboard_host": "127.0.0.1"}
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


# ---- the reaper: children die with a SIGKILLed parent ------------------------------------------------------------------
PARENT = r"""
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from cluster.reaper import start_reaper
# a daemon that starts its own child (like the raylet and its agents), then the reaper watching the daemon
daemon = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; c = subprocess.Popen(['sleep', '600']); print(c.pid, flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE)
grandchild = int(daemon.stdout.readline())
reaper = start_reaper([daemon.pid])
print(daemon.pid, grandchild, reaper.process.pid, flush=True)
if sys.argv[2] == "clean":
    time.sleep(1.5)
    reaper.dismiss()
    print("dismissed", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [pid for pid in pids if _alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper needs /proc")
def test_sigkill_of_the_parent_kills_the_watched_tree():
    root = str(Path(__file__).resolve().parent.parent)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, root, "kill"], stdout=subprocess.PIPE, text=True)
    daemon, grandchild, reaper = (int(x) for x in parent.stdout.readline().split())
    time.sleep(1.2)  # at least one of the reaper's walks of the tree
    assert all(_alive(pid) for pid in (daemon, grandchild, reaper))
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _wait_gone([daemon, grandchild, reaper]) == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper needs /proc")
def test_a_dismissed_reaper_kills_nothing():
    root = str(Path(__file__).resolve().parent.parent)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, root, "clean"], stdout=subprocess.PIPE, text=True)
    daemon, grandchild, reaper = (int(x) for x in parent.stdout.readline().split())
    try:
        assert parent.stdout.readline().strip() == "dismissed"
        assert _wait_gone([reaper]) == []
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        time.sleep(0.5)
        assert _alive(daemon) and _alive(grandchild)
    finally:
        for pid in (grandchild, daemon):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_a_stream_dropped_before_it_started_leaves_the_in_flight_count():
    """A client gone before its SSE generator ran: the response is dropped un-iterated, and the ingress's weakref
    finalizer does what the generator's finally would have (cancel, forget, leave) exactly once; a generator that ran
    cleans up itself and the finalizer then does nothing."""
    import asyncio
    import types
    import weakref

    from cluster.openai_api import OpenAIIngress

    ingress_class = getattr(OpenAIIngress, "func_or_class", OpenAIIngress)
    left, cancelled, aborted = [], [], []
    fake = types.SimpleNamespace(_request_to_stream={}, _request_to_cut={}, _leave=lambda: left.append(1),
                                 metrics=types.SimpleNamespace(
                                     observe_aborted=lambda reason, replica_id, key=None: aborted.append(reason)))
    end = ingress_class._end_unstarted_stream.__get__(fake)

    class Stream:
        def cancel(self):
            cancelled.append(1)

    async def events(key):
        try:
            yield "data"
        finally:
            fake._request_to_stream.pop(key, None)
            fake._leave()

    loop = asyncio.new_event_loop()
    timer = loop.call_later(3600, lambda: None)
    fake._request_to_stream["a"] = Stream()
    gen = events("a")
    weakref.finalize(gen, end, "a", fake._request_to_stream["a"], timer)
    del gen  # never iterated: only the finalizer can clean up
    assert (left, cancelled, aborted, fake._request_to_stream) == ([1], [1], ["client_gone"], {})
    assert timer.cancelled()

    left.clear(), cancelled.clear(), aborted.clear()
    fake._request_to_stream["b"] = Stream()
    gen = events("b")
    weakref.finalize(gen, end, "b", fake._request_to_stream["b"], loop.call_later(3600, lambda: None))
    assert loop.run_until_complete(gen.__anext__()) == "data"
    loop.run_until_complete(gen.aclose())
    del gen
    assert (left, cancelled, aborted) == ([1], [], [])
    loop.close()


def test_admin_prefix_routes_need_the_admin_key_when_only_an_admin_key_is_set():
    """With --admin-api-key and no --api-key, /v1 is open but the admin routes are not (they once checked the client
    key, which is no check at all without --api-key)."""
    import asyncio

    from starlette.requests import Request

    from cluster import admin_api
    from cluster.openai_api import OpenAIIngress

    # our class, under Serve's ASGI wrapper; the key checks need only its config
    ingress = object.__new__(OpenAIIngress.__mro__[1])
    ingress.config = config(admin_api_key="z")

    def request(method: str, headers: dict[str, str]) -> Request:
        async def receive():
            return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}

        scope = {"type": "http", "method": method, "path": "/admin/prefixes", "query_string": b"",
                 "headers": [(name.encode(), value.encode()) for name, value in headers.items()]}
        return Request(scope, receive)

    for handler, method in ((admin_api.list_prefixes, "GET"), (admin_api.pin_prefix, "POST"),
                            (admin_api.unpin_prefix, "POST")):
        for headers in ({}, {"authorization": "Bearer wrong"}):
            response = asyncio.run(handler(ingress, request(method, headers)))
            assert response.status_code == 401, (handler.__name__, headers, response.body)
    ingress._check_api_key(request("POST", {}))  # /v1 stays open in this configuration


def test_the_ingress_warm_up_belongs_to_no_request():
    """/health starts the warm-up (the replicas' info) when start-up's did not finish. Started from the health
    request's code, its replica call carried that request's context, and a load balancer hanging up its health check
    cancelled the call every waiting request shared. It now runs in an empty context (cluster/detached.py)."""
    import asyncio
    import types

    import ray.serve.context as serve_context

    from cluster.openai_api import OpenAIIngress

    ingress_class = getattr(OpenAIIngress, "func_or_class", OpenAIIngress)
    seen = []

    async def replica_info():
        seen.append(serve_context._get_serve_request_context()._internal_request_id)
        fake._info = "info"

    fake = types.SimpleNamespace(_warm_task=None, _info=None, _draining=False, _replica_info=replica_info)
    fake._warm_up = ingress_class._warm_up.__get__(fake)
    start = ingress_class._start_warm_up.__get__(fake)

    async def scenario():
        serve_context._serve_request_context.set(serve_context._RequestContext(
            route="/health", request_id="health-1", _internal_request_id="internal-health-1"))
        start()
        await fake._warm_task

    asyncio.run(scenario())
    assert len(seen) == 1 and seen[0] != "internal-health-1"
    start()  # no running loop: nothing is started, nothing raises
    assert fake._warm_task.done()


# ---- Serve's proxy port: below the ephemeral range, where the Ray processes starting meanwhile take theirs -----------
def test_spare_port_is_free_below_the_ephemeral_range_and_never_an_excluded_one():
    import socket

    from cluster import cli

    floor = cli.ephemeral_port_floor()
    for _ in range(20):
        port = cli.spare_port("127.0.0.1", exclude=(cli.SPARE_PORT_FLOOR,), ceiling=cli.SPARE_PORT_FLOOR + 2)
        assert port == cli.SPARE_PORT_FLOOR + 1 or port >= floor  # the one candidate, unless something holds it
    port = cli.spare_port("127.0.0.1")
    assert cli.SPARE_PORT_FLOOR <= port < floor
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))  # free, as promised


def test_spare_port_skips_a_taken_port_and_falls_back_to_any_free_one():
    import socket

    from cluster import cli

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # the only candidate is taken: a port from the kernel instead, not the taken one
        port = cli.spare_port("127.0.0.1", ceiling=taken + 1, exclude=range(cli.SPARE_PORT_FLOOR, taken))
        assert port != taken


def test_ephemeral_port_floor_reads_the_kernel_range(tmp_path):
    from cluster import cli

    good = tmp_path / "range"
    good.write_text("40000\t60999\n")
    assert cli.ephemeral_port_floor(str(good)) == 40000
    bad = tmp_path / "bad"
    bad.write_text("not a range")
    assert cli.ephemeral_port_floor(str(bad)) == 32768
    assert cli.ephemeral_port_floor(str(tmp_path / "missing")) == 32768
