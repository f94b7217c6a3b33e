"""Cross-replica prefix reuse over HTTP with the official openai client, DP=2 on real Ray Serve and a real
redis-server: a prefix computed on one replica is served on the other by peer copy (flag on) or from the shared
Redis tier (flag off), as the usage breakdown shows, with the same greedy output as a local hit."""

import time

import httpx
import openai
import pytest

from test_e2e_http import (
    API_KEY,
    MODEL,
    PAGE_SIZE,
    ROUTING_SETTLE_S,
    cached_of,
    code_prompt,
    deploy,
    make_config,
    metric_values,
)

pytestmark = pytest.mark.ray

TARGET = "x-prefixserve-target-replica"

AUTH = {"Authorization": f"Bearer {API_KEY}"}
"""/metrics needs the key when the app has one."""


def complete(client, prompt, target=None):
    headers = {TARGET: target} if target else None
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6,
                                                      extra_headers=headers)
    return raw.parse(), raw.headers["x-prefixserve-replica"]


def both_replicas(client, tag):
    """Ids of the two replicas (send distinct prompts until both answered)."""
    seen = set()
    for index in range(20):
        seen.add(complete(client, code_prompt(f"{tag}-probe-{index}", num_functions=12))[1])
        if len(seen) == 2:
            return sorted(seen)
    raise AssertionError(f"only saw replicas {seen}")


def wait_for_tier_writes(metrics_url: str, tier: str, num_pages: int, timeout_s: float = 60,
                         metric: str = "prefixserve_kv_tier_pages_stored_total") -> None:
    """Wait until the replicas' background writers have stored ``num_pages`` pages in ``tier`` (a loaded machine can
    take a while; a fixed sleep made the tier tests depend on the machine's speed), or, with ``metric`` the tiers'
    events counter, until the replicas have announced that many of the tier's pages to the router."""
    deadline = time.monotonic() + timeout_s
    while True:
        stored = metric_values(httpx.get(metrics_url, headers=AUTH).text, metric)
        num_stored = sum(value for labels, value in stored.items() if f'tier="{tier}"' in labels)
        if num_stored >= num_pages:
            return
        assert time.monotonic() < deadline, f"only {num_stored} of {num_pages} pages in the {tier} tier ({metric})"
        time.sleep(0.2)


def run_scenario(client, tag, metrics_url):
    """Compute a prefix on one replica, then ask the other replica for it; returns (remote usage, local usage)."""
    a, b = both_replicas(client, tag)
    prefix = code_prompt(f"{tag}-shared")
    first, home = complete(client, prefix + "\n# first question\n", target=a)
    assert home == a and cached_of(first.usage)[0] == 0
    if tag in ("host", "disk"):
        # the shared tiers take a page on its second use: ask again on the same replica (a local hit)
        again, _ = complete(client, prefix + "\n# first question\n", target=a)
        num_reused_pages = cached_of(again.usage)[1]["local"] // PAGE_SIZE
        assert num_reused_pages >= 2
        wait_for_tier_writes(metrics_url, tag, num_reused_pages)
        # peer copy is off, so routing on the tiers' contents is on by default: the replicas announce those pages
        wait_for_tier_writes(metrics_url, tag, num_reused_pages, metric="prefixserve_kv_tier_events_stored_total")
    time.sleep(ROUTING_SETTLE_S)  # routing stats reach the router
    question = prefix + "\n# second question\n"
    remote, replica = complete(client, question, target=b)
    assert replica == b
    local, replica = complete(client, question, target=a)
    assert replica == a
    return remote, local


@pytest.fixture(scope="module")
def http_base(ray_session, serve_http_port):
    return f"http://127.0.0.1:{serve_http_port}"


def make_client(http_base, name):
    return openai.OpenAI(base_url=f"{http_base}/{name}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def serve_from_other_replica(http_base, config, name, source):
    """Deploy ``config`` as ``name``, compute a prefix on one replica, ask the other replica for it, and check that
    all its cached tokens came from ``source`` with the same output as a local hit.
    Returns (remote completion, local completion, remote cached tokens, /metrics text)."""
    from ray import serve

    deploy(config, name)
    try:
        client = make_client(http_base, name)
        remote, local = run_scenario(client, source, f"{http_base}/{name}/metrics")
        cached, by_source = cached_of(remote.usage)
        assert cached >= 2 * PAGE_SIZE
        assert by_source == {**{"local": 0, "peer": 0, "host": 0, "disk": 0}, source: cached}
        assert remote.choices[0].text == local.choices[0].text
        assert cached_of(local.usage)[1]["local"] == cached
        metrics = httpx.get(f"{http_base}/{name}/metrics", headers=AUTH).text
        return remote, local, cached, metrics
    finally:
        serve.delete(name)


def test_prefix_on_another_replica_is_copied_from_the_peer(http_base, tiny_llama_dir):
    config = make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=True)
    remote, local, cached, metrics = serve_from_other_replica(http_base, config, "peercopy", "peer")
    details = remote.usage.prompt_tokens_details.model_extra
    assert details["computed_tokens"] == remote.usage.prompt_tokens - cached
    # every page copied from a peer is counted: the remote request's, plus any page the local request then copied
    # back from the remote replica (which computed the question's last full page)
    num_peer_tokens = cached + cached_of(local.usage)[1]["peer"]
    peer_pages = metric_values(metrics, "prefixserve_kv_fetch_pages_total")
    assert sum(v for labels, v in peer_pages.items() if 'source="peer"' in labels) == num_peer_tokens // PAGE_SIZE
    # CPU replicas of one node: straight from the holder's shared pool, not through the object store
    by_transport = metric_values(metrics, "prefixserve_kv_peer_pages_total")
    assert sum(v for labels, v in by_transport.items() if 'transport="shared_memory"' in labels) == \
        num_peer_tokens // PAGE_SIZE
    assert sum(v for labels, v in by_transport.items() if 'transport="host"' in labels) == 0
    assert sum(v for labels, v in by_transport.items() if 'transport="cuda_ipc"' in labels) == 0
    peer_bytes = metric_values(metrics, "prefixserve_kv_fetch_bytes_total")
    assert sum(v for labels, v in peer_bytes.items() if 'source="peer"' in labels) > 0
    # the first call to a holder goes through Serve's handle and names the holder's export socket; none failed
    calls = metric_values(metrics, "prefixserve_kv_peer_export_calls_total")
    assert sum(v for labels, v in calls.items() if 'path="handle"' in labels) >= 1
    assert sum(v for labels, v in calls.items() if 'path="socket_failed"' in labels) == 0


def test_a_second_prefix_from_the_same_holder_is_asked_over_its_socket(http_base, tiny_llama_dir):
    """After one copy from a holder, the next asks the holder's export socket instead of Serve's handle, and gives the
    same tokens as a local hit."""
    from ray import serve

    config = make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=True)
    deploy(config, "peersocket")
    try:
        client = make_client(http_base, "peersocket")
        run_scenario(client, "socket-1", f"{http_base}/peersocket/metrics")
        remote, local = run_scenario(client, "socket-2", f"{http_base}/peersocket/metrics")
        assert cached_of(remote.usage)[1]["peer"] >= 2 * PAGE_SIZE
        assert remote.choices[0].text == local.choices[0].text
        metrics = httpx.get(f"{http_base}/peersocket/metrics", headers=AUTH).text
        calls = metric_values(metrics, "prefixserve_kv_peer_export_calls_total")
        assert sum(v for labels, v in calls.items() if 'path="socket"' in labels) >= 1
        assert sum(v for labels, v in calls.items() if 'path="socket_failed"' in labels) == 0
    finally:
        serve.delete("peersocket")


def test_copy_off_reuses_the_prefix_through_redis(http_base, tiny_llama_dir, redis_server):
    config = make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=False, redis_url=redis_server[:-1] + "3")
    serve_from_other_replica(http_base, config, "hosttier", "host")


def test_embedded_default_shares_through_the_disk_tier(http_base, tiny_llama_dir, tmp_path):
    config = make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=False, enable_disk_cache=True,
                         disk_cache_dir=str(tmp_path / "kv"))
    serve_from_other_replica(http_base, config, "disktier", "disk")
