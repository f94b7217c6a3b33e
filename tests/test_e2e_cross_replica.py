"""Cross-replica prefix reuse over HTTP with the official openai client, DP=2 on real Ray Serve and a real
redis-server: a prefix computed on one replica is served on the other by peer copy (flag on) or from the shared
Redis tier (flag off), as the usage breakdown shows, with the same greedy output as a local hit."""

import time

import httpx
import openai
import pytest

from test_e2e_http import API_KEY, MODEL, PAGE_SIZE, ROUTING_SETTLE_S, cached_of, code_prompt, make_config, metric_values

pytestmark = pytest.mark.ray

TARGET = "x-prefixserve-target-replica"


def deploy(config, name):
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    return name


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


def run_scenario(client, tag):
    """Compute a prefix on one replica, then ask the other replica for it; returns (remote usage, outputs equal)."""
    a, b = both_replicas(client, tag)
    prefix = code_prompt(f"{tag}-shared")
    first, home = complete(client, prefix + "\n# first question\n", target=a)
    assert home == a and cached_of(first.usage)[0] == 0
    time.sleep(ROUTING_SETTLE_S)  # the router learns that `a` holds the prefix; async tier writes land
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


def test_prefix_on_another_replica_is_copied_from_the_peer(http_base, tiny_llama_dir):
    from ray import serve

    name = deploy(make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=True), "peercopy")
    try:
        client = make_client(http_base, name)
        remote, local = run_scenario(client, "peer")
        cached, by_source = cached_of(remote.usage)
        assert cached >= 2 * PAGE_SIZE
        assert by_source == {"local": 0, "peer": cached, "host": 0, "disk": 0}
        details = remote.usage.prompt_tokens_details.model_extra
        assert details["computed_tokens"] == remote.usage.prompt_tokens - cached
        assert remote.choices[0].text == local.choices[0].text
        assert cached_of(local.usage)[1]["local"] == cached
        metrics = httpx.get(f"{http_base}/{name}/metrics").text
        peer_pages = metric_values(metrics, "prefixserve_kv_fetch_pages_total")
        assert sum(v for labels, v in peer_pages.items() if 'source="peer"' in labels) == cached // PAGE_SIZE
        peer_bytes = metric_values(metrics, "prefixserve_kv_fetch_bytes_total")
        assert sum(v for labels, v in peer_bytes.items() if 'source="peer"' in labels) > 0
    finally:
        serve.delete(name)


def test_copy_off_reuses_the_prefix_through_redis(http_base, tiny_llama_dir, redis_server):
    from ray import serve

    config = make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=False, redis_url=redis_server[:-1] + "3")
    name = deploy(config, "hosttier")
    try:
        client = make_client(http_base, name)
        remote, local = run_scenario(client, "host")
        cached, by_source = cached_of(remote.usage)
        assert cached >= 2 * PAGE_SIZE
        assert by_source == {"local": 0, "peer": 0, "host": cached, "disk": 0}
        assert remote.choices[0].text == local.choices[0].text
    finally:
        serve.delete(name)


def test_embedded_default_shares_through_the_disk_tier(http_base, tiny_llama_dir, tmp_path):
    from ray import serve

    config = make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=False, enable_disk_cache=True,
                         disk_cache_dir=str(tmp_path / "kv"))
    name = deploy(config, "disktier")
    try:
        client = make_client(http_base, name)
        remote, local = run_scenario(client, "disk")
        cached, by_source = cached_of(remote.usage)
        assert cached >= 2 * PAGE_SIZE
        assert by_source == {"local": 0, "peer": 0, "host": 0, "disk": cached}
        assert remote.choices[0].text == local.choices[0].text
    finally:
        serve.delete(name)
