"""End to end over HTTP: retention (priority + TTL) survives a flood of unique prompts and expires; admin pins.

One replica of the tiny random Llama with a 16-page pool (2048 tokens), retention budget 8 pages. Prompts are token
ids, so page counts are exact: a 2-page prefix retained three ways (the ``prompt_cache_retention`` extension field with
a TTL, an admin pin without one, a chat ``cache_control`` breakpoint), then a flood of unique 2-page prompts (more than
the pool holds) evicts everything else. The TTL's two sides use two prefixes, so that no timing decides the outcome: one
whose TTL is far longer than a flood survives it, one whose short TTL the test waits out before a flood is evicted.
"""

from __future__ import annotations

import math
import random
import re
import sqlite3
import time

import httpx
import pytest

from multinode_cases import wait_until

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")

API_KEY = "retention-secret"
MODEL = "tiny"
PAGE = 128
NUM_PAGES = 16
BYTES_PER_PAGE = 2 * 2 * PAGE * 2 * 16 * 4  # layers x (K, V) x page x kv heads x head dim x float32


def retention_config(tiny_llama_dir: str, **overrides):
    """The retention apps' config: one replica of the tiny Llama with a 16-page pool, eager (a compile of the forward
    costs each start 10-30 s on a slow CI box; the compiled path is tested in process and by test_e2e_http.py)."""
    from cluster.config import ServeConfig

    settings = dict(model=tiny_llama_dir, devices="cpu", data_parallel_degree=1, page_size=PAGE,
                    kv_cache_memory=NUM_PAGES * BYTES_PER_PAGE, num_cpus_per_replica=0.5, served_model_name=MODEL,
                    max_model_len=2048, api_key=API_KEY, enable_disk_cache=False, dtype="float32", enforce_eager=True)
    settings.update(overrides)
    return ServeConfig(**settings)
SURVIVING_TTL_S = 120.0
"""TTL of the request retention that must outlive a flood: far longer than the flood and its checks take, even on a
loaded box, so the flood's duration decides nothing."""
RETENTION_AGE_S = 4.0
"""How old that retention is, at least, when the flood starts: a TTL much shorter than asked (read as milliseconds, or
30 times too short) has passed by then, and the flood evicts the prefix."""
EXPIRING_TTL_S = 2.0
"""TTL of the request retention that must end: waited out from the moment the request that set it was answered."""


@pytest.fixture(scope="module")
def base_url(ray_session, serve_http_port, tiny_llama_dir):
    from ray import serve

    from cluster.app import build_app

    # retention alone, on plain LRU (the segmented LRU: below)
    config = retention_config(tiny_llama_dir, kv_cache_retention_budget=0.5, kv_cache_protected_fraction=0.0)
    serve.run(build_app(config), name="e2e-retention", route_prefix="/e2e-retention")
    yield f"http://127.0.0.1:{serve_http_port}/e2e-retention"
    serve.delete("e2e-retention")


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def admin(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as session:
        yield session


def token_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(length)]


def usage_of(client, prompt, **extra):
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                           extra_body=extra or None)
    details = completion.usage.prompt_tokens_details
    return details.cached_tokens, details.cache_write_tokens


def flood(client, first_seed: int, count: int = 10) -> None:
    for seed in range(first_seed, first_seed + count):
        usage_of(client, token_prompt(seed, 2 * PAGE + 1))


def test_admin_endpoints_refuse_without_the_key(base_url):
    for method, path in (("GET", "/admin/prefixes"), ("POST", "/admin/prefixes/pin"),
                         ("POST", "/admin/prefixes/unpin")):
        response = httpx.request(method, base_url + path, json={"prompt": [1] * 200},
                                 headers={"Authorization": "Bearer wrong"})
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.request(method, base_url + path, json={}).status_code == 401


def test_retained_prefixes_survive_a_flood_and_the_ttl_expires(client, admin):
    system = token_prompt(1, 2 * PAGE)
    pinned = token_prompt(2, 2 * PAGE)
    expiring = token_prompt(3, 2 * PAGE)
    # 1. retention by the extension field; the request wrote its two full pages into the cache
    retention = {"priority": 80, "ttl": SURVIVING_TTL_S}
    assert usage_of(client, system + [5, 6, 7], prompt_cache_retention=retention) == (0, 2 * PAGE)
    retained_by = time.monotonic()  # the pages took the retention before the request was answered
    # 2. an admin pin (no TTL), computed now on the replica ("warm")
    response = admin.post("/admin/prefixes/pin", json={"prompt": pinned, "priority": 100})
    assert response.status_code == 200, response.text
    pin = response.json()
    assert (pin["num_pages"], pin["warmed"]) == (2, True)
    assert [(where["num_pages_resident"], where["num_pages_retained"]) for where in pin["replicas"]] == [(2, 2)]
    # 3. once the retention is RETENTION_AGE_S old, a flood of unique prompts: 20 pages of plain LRU traffic through a
    # 16-page pool
    time.sleep(max(0.0, retained_by + RETENTION_AGE_S - time.monotonic()))
    flood(client, 1000)
    assert usage_of(client, token_prompt(1000, 2 * PAGE + 1))[0] == 0  # the flood's own first prompt was evicted
    assert usage_of(client, system + [8, 9])[0] == 2 * PAGE
    assert usage_of(client, pinned + [8, 9])[0] == 2 * PAGE
    # 4. per-prefix stats: both listed, resident and retained, with their hits
    listing = {entry["prefix_id"]: entry for entry in admin.get("/admin/prefixes").json()["data"]}
    admin_entry = listing[pin["prefix_id"]]
    assert (admin_entry["source"], admin_entry["priority"], admin_entry["num_hits"]) == ("admin", 100, 1)
    assert admin_entry["cached_tokens"] == 2 * PAGE
    [where] = admin_entry["replicas"]
    assert (where["num_pages_resident"], where["num_pages_retained"]) == (2, 2)
    request_entries = [entry for entry in listing.values() if entry["source"] == "request"]
    assert [(entry["priority"], entry["num_hits"]) for entry in request_entries] == [(80, 1)]
    # 5. a retention whose TTL passes without a hit: the next flood evicts it (reason "ttl"), not the admin pin nor the
    # retention whose TTL holds
    retention = {"priority": 60, "ttl": EXPIRING_TTL_S}
    assert usage_of(client, expiring + [5, 6, 7], prompt_cache_retention=retention) == (0, 2 * PAGE)
    retained_by = time.monotonic()
    time.sleep(max(0.0, retained_by + EXPIRING_TTL_S + 0.5 - time.monotonic()))
    flood(client, 2000)
    assert usage_of(client, expiring + [8, 9])[0] == 0
    assert usage_of(client, system + [10])[0] == 2 * PAGE
    assert usage_of(client, pinned + [10])[0] == 2 * PAGE
    metrics = admin.get("/metrics").text
    assert 'prefixserve_kv_page_evictions_total{priority="60",reason="ttl"' in metrics
    assert 'reason="capacity"' in metrics and "prefixserve_kv_page_lifetime_seconds_bucket" in metrics
    # 6. unpin: the pages become plain LRU and leave with the next flood (the request retention too, which the admin
    # route ends like a pin; the module's next test starts without it)
    assert admin.post("/admin/prefixes/unpin", json={"prefix_id": pin["prefix_id"]}).status_code == 200
    assert admin.post("/admin/prefixes/unpin", json={"prefix_id": pin["prefix_id"]}).status_code == 404
    assert admin.post("/admin/prefixes/unpin", json={"prompt": system}).status_code == 200
    flood(client, 3000)
    assert usage_of(client, pinned + [11])[0] == 0
    assert usage_of(client, system + [11])[0] == 0


def test_a_failed_re_pin_keeps_the_earlier_pin(admin):
    """A prefix longer than the retention budget (8 pages), pinned without warming it, is listed. Pinned again with a
    warm-up, the replica refuses to compute it (the budget): the endpoint reports that and takes the new pin back, and
    the earlier pin stays as it was instead of being unpinned with it."""
    long_prefix = token_prompt(31, 9 * PAGE)
    first = admin.post("/admin/prefixes/pin", json={"prompt": long_prefix, "priority": 70, "warm": False})
    assert first.status_code == 200, first.text
    prefix_id = first.json()["prefix_id"]
    again = admin.post("/admin/prefixes/pin", json={"prompt": long_prefix, "priority": 90})
    assert again.status_code == 400 and "not pinned" in again.json()["error"]["message"], again.text
    [entry] = [entry for entry in admin.get("/admin/prefixes").json()["data"] if entry["prefix_id"] == prefix_id]
    assert (entry["source"], entry["priority"], entry["num_pages"]) == ("admin", 70, 9)
    assert admin.post("/admin/prefixes/unpin", json={"prefix_id": prefix_id}).status_code == 200


def test_admin_pins_by_messages_and_by_text_hold_through_a_flood_and_a_pin_ttl_ends(client, admin):
    """The admin routes take a prefix as chat messages (rendered by the chat template, as a chat request's prompt
    starts) or as prompt text. A chat request that continues the pinned messages reuses the pin after a flood; a
    text pin with a TTL is listed with it, reused while it lasts, and once its TTL passes without a hit the next
    flood evicts it. The replicas' eviction histograms are exported on /metrics."""
    system = [{"role": "system", "content": " ".join(f"term{index}" for index in range(70))}]
    by_messages = admin.post("/admin/prefixes/pin", json={"messages": system, "priority": 90})
    assert by_messages.status_code == 200, by_messages.text
    messages_pin = by_messages.json()
    assert messages_pin["num_pages"] >= 2 and messages_pin["warmed"]
    text = " ".join(f"fact{index}" for index in range(70))
    by_text = admin.post("/admin/prefixes/pin", json={"prompt": text, "priority": 90, "ttl": EXPIRING_TTL_S})
    assert by_text.status_code == 200, by_text.text
    text_pin = by_text.json()
    assert text_pin["num_pages"] >= 2 and text_pin["prefix_id"] != messages_pin["prefix_id"]
    listing = {entry["prefix_id"]: entry for entry in admin.get("/admin/prefixes").json()["data"]}
    assert listing[text_pin["prefix_id"]]["ttl_s"] == EXPIRING_TTL_S
    assert listing[messages_pin["prefix_id"]]["ttl_s"] is None
    # the text pin, while it lasts: a completion that continues the text reuses its pages (a hit restarts its TTL)
    hit = client.completions.create(model=MODEL, prompt=text + " and more", max_tokens=1, temperature=0)
    last_hit = time.monotonic()
    assert hit.usage.prompt_tokens_details.cached_tokens == text_pin["num_pages"] * PAGE
    # its TTL passes without a hit; then a flood of unique prompts through the whole pool
    time.sleep(max(0.0, last_hit + EXPIRING_TTL_S + 0.5 - time.monotonic()))
    flood(client, 6000)
    chat = client.chat.completions.create(model=MODEL, messages=system + [{"role": "user", "content": "hello"}],
                                          max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens_details.cached_tokens >= messages_pin["num_pages"] * PAGE
    again = client.completions.create(model=MODEL, prompt=text + " and more", max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    metrics = admin.get("/metrics").text
    # the text pin's pages went because their TTL ended (the messages pin, also priority 90, is still cached)
    assert 'prefixserve_kv_page_evictions_total{priority="90",reason="ttl"' in metrics
    for name in ("kv_page_idle_before_evict_seconds", "kv_page_reuse_gap_seconds"):
        counts = re.findall(rf'prefixserve_{name}_count{{replica="[^"]+"}} ([0-9.e+]+)', metrics)
        assert counts and float(counts[0]) > 0, name
    assert admin.post("/admin/prefixes/unpin", json={"messages": system}).status_code == 200
    # the text pin's TTL ended: the replica may already have let it go (404) or still list it (200)
    assert admin.post("/admin/prefixes/unpin", json={"prefix_id": text_pin["prefix_id"]}).status_code in (200, 404)


def test_the_default_segmented_lru_keeps_a_reused_system_prompt_through_a_flood(ray_session, serve_http_port,
                                                                               tiny_llama_dir):
    """No retention asked: a system prompt that one request reused is protected by the replica's segmented LRU (the
    default ``--kv-cache-protected-fraction``), so a flood of one-off prompts through the whole pool evicts the
    flood's own pages and not it; a prompt seen only once before the flood is evicted, as under plain LRU."""
    from ray import serve

    from cluster.app import build_app

    config = retention_config(tiny_llama_dir)
    serve.run(build_app(config), name="e2e-segmented", route_prefix="/e2e-segmented")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_http_port}/e2e-segmented/v1", api_key=API_KEY,
                               max_retries=0, timeout=60)
        system, once = token_prompt(21, 2 * PAGE), token_prompt(22, 2 * PAGE)
        assert usage_of(client, system + [5, 6]) == (0, 2 * PAGE)
        assert usage_of(client, system + [7, 8])[0] == 2 * PAGE  # reused: protected
        assert usage_of(client, once + [5, 6]) == (0, 2 * PAGE)
        flood(client, 5000)  # 10 one-off prompts of 2 full pages through a 16-page pool
        assert usage_of(client, system + [9])[0] == 2 * PAGE
        assert usage_of(client, once + [9])[0] == 0
        metrics = httpx.get(f"http://127.0.0.1:{serve_http_port}/e2e-segmented/metrics",
                            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60).text
        assert re.search(r'prefixserve_kv_protected_pages\{kind="max",replica="[^"]+"\} 11\.0', metrics), metrics
        # the system prompt's 2 pages, and once's 2: evicted by the flood, then computed again (the ghost list)
        assert re.search(r'prefixserve_kv_protected_pages\{kind="protected",replica="[^"]+"\} 4\.0', metrics), [
            line for line in metrics.splitlines() if "protected" in line]
    finally:
        serve.delete("e2e-segmented")


def chat_with_breakpoint(num_words: int, question: str) -> list[dict]:
    system_text = " ".join(f"rule{index}" for index in range(num_words))
    return [{"role": "system", "content": [{"type": "text", "text": system_text,
                                            "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
            {"role": "user", "content": question}]


def test_cache_control_breakpoint_retains_the_prefix_up_to_it(client, admin):
    # a breakpoint whose prefix alone is more than the retention budget (8 pages) is refused, clearly
    with pytest.raises(openai.BadRequestError, match="retention-budget"):
        client.chat.completions.create(model=MODEL, messages=chat_with_breakpoint(300, "q"), max_tokens=1)
    messages = chat_with_breakpoint(70, "first question")
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cache_write_tokens >= 2 * PAGE
    entries = [entry for entry in admin.get("/admin/prefixes").json()["data"]
               if entry["source"] == "request" and entry["ttl_s"] == 3600.0]
    assert len(entries) == 1 and entries[0]["num_pages"] >= 2
    num_retained = entries[0]["num_pages"]
    flood(client, 4000)
    messages[1]["content"] = "another question"
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= num_retained * PAGE
    bad = [{"role": "system", "content": "x", "cache_control": {"type": "persistent"}}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=bad, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"prompt_cache_retention": {"priority": 500}})


def string_keys_without_expiry(redis_client) -> int:
    """Plain pages carry an expiry (volatile-lru may evict them); retained ones and the tier's marker do not."""
    return sum(1 for key in redis_client.scan_iter(count=1000)
               if redis_client.type(key) == b"string" and redis_client.ttl(key) == -1)


def disk_retained_rows(root) -> list[tuple[int, float]]:
    index = sqlite3.connect(f"file:{root}/index.sqlite?mode=ro", uri=True)
    try:
        return index.execute("SELECT priority, retain_until FROM pages WHERE priority > 0").fetchall()
    finally:
        index.close()


def test_admin_pin_and_unpin_reach_the_redis_and_disk_tiers(ray_session, serve_http_port, tiny_llama_dir,
                                                             redis_server, tmp_path):
    """HTTP admin pin -> the replica -> its shared tiers: the pinned pages are retained in Redis (no expiry, so
    volatile-lru never evicts them) and in the disk index (priority, no end); the listing says where the prefix lives;
    an HTTP unpin makes them plain pages again in both tiers, which keep them."""
    import redis
    from ray import serve

    from cluster.app import build_app

    redis_url = redis_server[:-1] + "6"
    redis_client = redis.Redis.from_url(redis_url)
    redis_client.flushdb()
    disk_root = tmp_path / "kv"
    config = retention_config(tiny_llama_dir, kv_cache_retention_budget=0.5, redis_url=redis_url,
                              enable_disk_cache=True, disk_cache_dir=str(disk_root))
    serve.run(build_app(config), name="e2e-retention-tiers", route_prefix="/e2e-retention-tiers")
    base_url = f"http://127.0.0.1:{serve_http_port}/e2e-retention-tiers"
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    try:
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as admin:
            usage_of(client, token_prompt(80, 2 * PAGE + 1))  # a plain prompt: its pages are not retained anywhere
            usage_of(client, token_prompt(80, 2 * PAGE + 2))  # ... and, reused, written to both tiers as plain pages
            wait_until(lambda: len(list(disk_root.glob("**/*.arrow"))) >= 2, 60, "the plain pages on disk")
            baseline = string_keys_without_expiry(redis_client)
            pinned = token_prompt(81, 2 * PAGE)
            response = admin.post("/admin/prefixes/pin", json={"prompt": pinned, "priority": 90})
            assert response.status_code == 200, response.text
            prefix_id = response.json()["prefix_id"]
            # a request reusing the pinned prefix: a reused page is what the tiers are written
            assert usage_of(client, pinned + [3, 4]) == (2 * PAGE, 0)

            def tiers_of_pin():
                listing = admin.get("/admin/prefixes").json()["data"]
                [entry] = [entry for entry in listing if entry["prefix_id"] == prefix_id]
                wanted = {"num_pages": 2, "num_pages_retained": 2}
                return entry if entry["tiers"] == {"host": wanted, "disk": wanted} else None

            entry = wait_until(tiers_of_pin, 60, "the listing to show the pin retained in both tiers")
            assert [where["num_pages_retained"] for where in entry["replicas"]] == [2]
            # what the tiers themselves hold: two retained Redis pages without an expiry, two pinned disk rows
            assert string_keys_without_expiry(redis_client) == baseline + 2
            assert disk_retained_rows(disk_root) == [(90, math.inf)] * 2

            assert admin.post("/admin/prefixes/unpin", json={"prefix_id": prefix_id}).status_code == 200
            wait_until(lambda: not disk_retained_rows(disk_root), 60, "the unpin to reach the disk index")
            wait_until(lambda: string_keys_without_expiry(redis_client) == baseline, 60, "the unpin to reach Redis")
            assert all(entry["prefix_id"] != prefix_id for entry in admin.get("/admin/prefixes").json()["data"])
            # both tiers keep the pages, plain: a re-pin finds them there without a write
            response = admin.post("/admin/prefixes/pin", json={"prompt": pinned, "priority": 40, "warm": False})
            listing = admin.get("/admin/prefixes").json()["data"]
            [entry] = [entry for entry in listing if entry["prefix_id"] == prefix_id]
            assert {tier: where["num_pages"] for tier, where in entry["tiers"].items()} == {"host": 2, "disk": 2}
    finally:
        serve.delete("e2e-retention-tiers")
        redis_client.flushdb()
