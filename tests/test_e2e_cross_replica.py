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


def run_scenario(client, tag, metrics_url, replicas=None):
    """Compute a prefix on one replica, then ask the other replica for it; returns (remote usage, local usage).
    ``replicas``: the app's two replica ids, when known (else found with ``both_replicas``)."""
    a, b = replicas or both_replicas(client, tag)
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


def reuse_from_other_replica(http_base, name, source, tag=None, replicas=None):
    """On the app ``name``: compute a prefix on one replica, ask the other replica for it, and check that all its
    cached tokens came from ``source`` with the same output as a local hit.
    Returns (remote completion, local completion, remote cached tokens, /metrics text)."""
    client = make_client(http_base, name)
    remote, local = run_scenario(client, tag or source, f"{http_base}/{name}/metrics", replicas)
    cached, by_source = cached_of(remote.usage)
    assert cached >= 2 * PAGE_SIZE
    assert by_source == {**{"local": 0, "peer": 0, "host": 0, "disk": 0}, source: cached}
    assert remote.choices[0].text == local.choices[0].text
    assert cached_of(local.usage)[1]["local"] == cached
    return remote, local, cached, httpx.get(f"{http_base}/{name}/metrics", headers=AUTH).text


def serve_from_other_replica(http_base, config, name, source):
    """Deploy ``config`` as ``name``, run ``reuse_from_other_replica`` on it, delete it."""
    from ray import serve

    deploy(config, name)
    try:
        return reuse_from_other_replica(http_base, name, source)
    finally:
        serve.delete(name)


@pytest.fixture(scope="module")
def peer_app(http_base, tiny_llama_dir):
    """One app with cross-replica copy on for the peer tests (a deploy costs half a minute on a slow CI box), and its
    two replica ids, found while both are empty (later, load balance may keep choosing one for new prompts). The tests
    read its counters as differences, so either may run first."""
    from ray import serve

    try:
        deploy(make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=True), "peercopy")
        yield "peercopy", both_replicas(make_client(http_base, "peercopy"), "peercopy")
    finally:
        serve.delete("peercopy")


def labelled_sum(metrics_text, name, label):
    return sum(v for labels, v in metric_values(metrics_text, name).items() if label in labels)


def test_prefix_on_another_replica_is_copied_from_the_peer(http_base, peer_app):
    name, replicas = peer_app
    before = httpx.get(f"{http_base}/{name}/metrics", headers=AUTH).text
    remote, local, cached, metrics = reuse_from_other_replica(http_base, name, "peer", replicas=replicas)

    def added(metric, label):
        return labelled_sum(metrics, metric, label) - labelled_sum(before, metric, label)

    details = remote.usage.prompt_tokens_details.model_extra
    assert details["computed_tokens"] == remote.usage.prompt_tokens - cached
    # every page copied from a peer is counted: the remote request's, plus any page the local request then copied
    # back from the remote replica (which computed the question's last full page)
    num_peer_pages = (cached + cached_of(local.usage)[1]["peer"]) // PAGE_SIZE
    assert added("prefixserve_kv_fetch_pages_total", 'source="peer"') == num_peer_pages
    # CPU replicas of one node: straight from the holder's shared pool, not through the object store
    assert added("prefixserve_kv_peer_pages_total", 'transport="shared_memory"') == num_peer_pages
    assert added("prefixserve_kv_peer_pages_total", 'transport="host"') == 0
    assert added("prefixserve_kv_peer_pages_total", 'transport="cuda_ipc"') == 0
    assert added("prefixserve_kv_fetch_bytes_total", 'source="peer"') > 0
    # the app's first call to a holder went through Serve's handle and named the holder's export socket; none failed
    assert labelled_sum(metrics, "prefixserve_kv_peer_export_calls_total", 'path="handle"') >= 1
    assert labelled_sum(metrics, "prefixserve_kv_peer_export_calls_total", 'path="socket_failed"') == 0


def test_a_second_prefix_from_the_same_holder_is_asked_over_its_socket(http_base, peer_app):
    """After one copy from a holder, the next asks the holder's export socket instead of Serve's handle, and gives the
    same tokens as a local hit."""
    name, replicas = peer_app
    reuse_from_other_replica(http_base, name, "peer", tag="socket-1", replicas=replicas)
    before = httpx.get(f"{http_base}/{name}/metrics", headers=AUTH).text
    _, _, _, metrics = reuse_from_other_replica(http_base, name, "peer", tag="socket-2", replicas=replicas)
    calls = "prefixserve_kv_peer_export_calls_total"
    assert labelled_sum(metrics, calls, 'path="socket"') - labelled_sum(before, calls, 'path="socket"') >= 1
    assert labelled_sum(metrics, calls, 'path="socket_failed"') == 0


def test_copy_off_reuses_the_prefix_through_redis(http_base, tiny_llama_dir, redis_server):
    config = make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=False, redis_url=redis_server[:-1] + "3")
    serve_from_other_replica(http_base, config, "hosttier", "host")


def test_embedded_default_shares_through_the_disk_tier(http_base, tiny_llama_dir, tmp_path):
    config = make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=False, enable_disk_cache=True,
                         disk_cache_dir=str(tmp_path / "kv"))
    serve_from_other_replica(http_base, config, "disktier", "disk")
