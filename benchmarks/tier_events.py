"""What the shared tiers' KV events cost (replica/tiers/events.py), in process, against a private redis-server and a
temporary disk tier:

- the existence check the event tracker makes per round (pipelined EXISTS on Redis, one SQL ``IN`` on the disk
  index), per page;
- storing pages with events off and on, side by side (the writer hands each batch to the tracker; the tracker's
  thread checks and publishes meanwhile), and how long after ``flush`` the last page is announced.

    python benchmarks/tier_events.py [--pages 512] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.page_format import PageFormat  # noqa: E402
from common.page_keys import compute_page_keys  # noqa: E402
from replica.tiers.base import StoredPage  # noqa: E402
from replica.tiers.disk_tier import DiskTier  # noqa: E402
from replica.tiers.redis_tier import RedisTier  # noqa: E402
from replica.tiers.seal import TierKey  # noqa: E402
from tests.conftest import RedisProcess  # noqa: E402

PAGE_FORMAT = PageFormat(model_fingerprint="bench", dtype="bfloat16", page_size=128, num_layers=2, num_kv_heads=2,
                         head_dim=8)


def make_pages(num_pages: int, seed: int) -> list[StoredPage]:
    tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(num_pages * 128)]
    keys = compute_page_keys(tokens, page_size=128, model_fingerprint="bench", salt=str(seed))
    kv = torch.zeros(PAGE_FORMAT.kv_shape, dtype=torch.bfloat16)
    return [StoredPage.from_format(PAGE_FORMAT, key, tokens[i * 128:(i + 1) * 128], kv.clone(),
                                   parent_key=keys[i - 1] if i else None) for i, key in enumerate(keys)]


class CountingSink:
    def __init__(self) -> None:
        self.num_stored = 0

    def __call__(self, medium, events) -> None:
        self.num_stored += sum(len(event.keys) for event in events if type(event).__name__ == "PagesStored")


def store_round(tier, pages, sink: CountingSink | None) -> tuple[float, float]:
    """Seconds to store + flush; seconds from flush until the sink has every page (0 without events)."""
    start = time.perf_counter()
    tier.store(pages)
    tier.flush(timeout=60)
    flushed = time.perf_counter()
    if sink is None:
        return flushed - start, 0.0
    while sink.num_stored < len(pages) and time.perf_counter() - flushed < 30:
        time.sleep(0.002)
    return flushed - start, time.perf_counter() - flushed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    server = RedisProcess()
    server.start()
    folder = tempfile.mkdtemp(prefix="tier-events-")
    key = TierKey.generate()
    try:
        for name, build in (("host (Redis)", lambda: RedisTier(server.url, PAGE_FORMAT, tier_key=key,
                                                                queue_size=4 * args.pages)),
                            ("disk", lambda: DiskTier(os.path.join(folder, f"d{time.monotonic_ns()}"), PAGE_FORMAT,
                                                      1 << 34, tier_key=key, queue_size=4 * args.pages))):
            off, on, delay = [], [], []
            for repeat in range(args.repeat):  # off and on alternate, fresh pages each time
                plain = build()
                off.append(store_round(plain, make_pages(args.pages, 2 * repeat), None)[0])
                plain.close()
                tracked, sink = build(), CountingSink()
                tracked.enable_events(sink)
                time.sleep(0.5)  # the tracker subscribes / opens its cursor first (once per replica)
                seconds, after = store_round(tracked, make_pages(args.pages, 2 * repeat + 1), sink)
                on.append(seconds)
                delay.append(after)
                source = tracked.event_tracker._source
                ids = list(tracked.event_tracker.announced)[:1024]
                start = time.perf_counter()
                for _ in range(5):
                    source.existing(ids)
                check_us = (time.perf_counter() - start) / 5 / max(1, len(ids)) * 1e6
                tracked.close()
            print(f"{name}: store+flush {args.pages} pages, median of {args.repeat}: events off "
                  f"{statistics.median(off) * 1e3:.1f} ms, on {statistics.median(on) * 1e3:.1f} ms "
                  f"(on/off {statistics.median(on) / statistics.median(off):.2f}x); last page announced "
                  f"{statistics.median(delay) * 1e3:.1f} ms after flush; existence check {check_us:.1f} us/page")
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
