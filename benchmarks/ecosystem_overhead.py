"""What the ecosystem add-ons cost on the serving path (issue 13), measured in process:

- KV events: converting one routing-stats period's engine events to vLLM's schema and msgpack-encoding them
  (``ZmqKVEventPublisher.publish`` does the conversion on the replica's event loop; the encoding and the send run on
  the publisher's thread), per stored page;
- /metrics: rendering the ingress's registry with and without the vLLM-named collector (one scrape).

    python benchmarks/ecosystem_overhead.py [--pages 2048] [--page-size 128] [--replicas 4] [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.metrics import IngressMetrics  # noqa: E402
from common.events import PagesRemoved, PagesStored, StoredPageInfo  # noqa: E402
from common.page_keys import compute_page_keys  # noqa: E402
from common.types import CachedTokens, EngineStats, RequestOutput  # noqa: E402
from replica.kv_event_publisher import encode_batch, to_vllm_events  # noqa: E402


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kv_events(num_pages: int, page_size: int, repeat: int) -> None:
    rng = random.Random(0)
    chains = []
    for chain in range(num_pages // 16):  # chains of 16 pages, like 16 x 128-token prompts
        tokens = [rng.randrange(50000) for _ in range(16 * page_size)]
        keys = compute_page_keys(tokens, page_size=page_size, model_fingerprint="f")
        chains.append((keys, tokens))
    keys, infos = [], []
    for chain_keys, tokens in chains:
        for index, key in enumerate(chain_keys):
            keys.append(key)
            infos.append(StoredPageInfo(chain_keys[index - 1] if index else None,
                                        tuple(tokens[index * page_size:(index + 1) * page_size])))
    events = [PagesStored(1, tuple(keys), tuple(infos)), PagesRemoved(2, tuple(keys[: len(keys) // 2]))]
    for hash_format in ("int", "bytes"):
        convert = median_s(lambda: to_vllm_events(events, page_size, hash_format), repeat)
        converted = to_vllm_events(events, page_size, hash_format)
        encode = median_s(lambda: encode_batch(time.time(), converted, 0), repeat)
        size = len(encode_batch(time.time(), converted, 0))
        print(f"kv events, {len(keys)} pages stored + {len(keys) // 2} removed, page size {page_size}, "
              f"hashes {hash_format}: convert {convert * 1e3:.2f} ms ({convert / len(keys) * 1e6:.2f} us/page), "
              f"encode {encode * 1e3:.2f} ms, {size / 1e6:.2f} MB per batch")


def metrics(num_replicas: int, repeat: int) -> None:
    stats = [EngineStats(f"replica-{i}", 10**6, 10**5, 1000, 400, 300, 300, 5, 1, 3, 2, 1000, 128)
             for i in range(num_replicas)]
    for with_vllm in (False, True):
        ingress = IngressMetrics(model_name="m")
        if not with_vllm:
            ingress.registry.unregister(ingress.vllm)
        for i in range(1000):
            replica = f"replica-{i % num_replicas}"
            first = RequestOutput(str(i), [1], "a", False, None, 2048, 1, CachedTokens(), replica)
            ingress.observe_first_token(0.05 + (i % 50) / 100, first)
            ingress.observe_finished(RequestOutput(str(i), [2], "b", True, "length", 2048, 64,
                                                   CachedTokens(local=1024, peer=512), replica))
        scrape = median_s(lambda: ingress.render(stats), repeat)
        size = len(ingress.render(stats))
        observe = median_s(lambda: ingress.observe_finished(RequestOutput(
            "x", [2], "b", True, "length", 2048, 64, CachedTokens(local=1024), "replica-0")), repeat * 50)
        print(f"/metrics, {num_replicas} replicas, vLLM names {'on ' if with_vllm else 'off'}: render "
              f"{scrape * 1e3:.2f} ms, {size / 1e3:.1f} kB; observe_finished {observe * 1e6:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    kv_events(args.pages, args.page_size, args.repeat)
    metrics(args.replicas, args.repeat)


if __name__ == "__main__":
    main()
