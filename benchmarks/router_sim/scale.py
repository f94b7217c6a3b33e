"""The router at scale: decision cost, index memory per page and events applied per second at 64 replicas / 1M pages.

Setup (seeded): ``num_pages`` distinct page keys in chains of 256 pages (documents); each document is held by one to
three replicas (chosen at random), so the index holds ~2x ``num_pages`` (replica, page) entries. The index is filled
through ``PrefixIndex.sync`` with PagesStored events of 16 pages each (one 2048-token prefill at page size 128), the
way the Ray adapter applies routing-stats payloads. Then ``num_decisions`` routing decisions are timed, each a
``PrefixAwarePolicy.choose`` over all replicas (64 ``ReplicaLoad`` candidates) followed by ``note_routed``:
half of the prompts continue a random document for 8-64 pages (a cached prefix of random length plus new pages),
half are new (unknown keys). Wall time per decision (``perf_counter_ns``) and the thread's CPU time
(``thread_time_ns``: not inflated when the shared box preempts the process) are both reported.

Memory: ``tracemalloc`` around filling the index; the key bytes objects are counted separately (the router owns them
in production: ``split_keys`` makes them from the payload blobs).
"""

from __future__ import annotations

import gc
import hashlib
import random
import sys
import time
import tracemalloc

from common.events import PagesRemoved, PagesStored
from common.routing_stats import ReplicaLoad
from router.index import PrefixIndex
from router.policy import PolicyConfig, PrefixAwarePolicy

DOCUMENT_PAGES = 256
EVENT_PAGES = 16


def _keys(document: int, num_pages: int) -> list:
    parent = b""
    out = []
    for page in range(num_pages):
        parent = hashlib.blake2b(parent + f"{document}:{page}".encode(), digest_size=32).digest()
        out.append(parent)
    return out


def _percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100.0 * len(ordered))) - 1))]


def run_scale(*, num_replicas: int = 64, num_pages: int = 1_000_000, num_decisions: int = 20_000,
              seed: int = 0) -> str:
    rng = random.Random(f"scale/{seed}")
    replica_ids = [f"replica-{n:02d}" for n in range(num_replicas)]
    num_documents = max(1, num_pages // DOCUMENT_PAGES)
    began = time.perf_counter()
    documents = [_keys(d, DOCUMENT_PAGES) for d in range(num_documents)]
    key_bytes = sum(sys.getsizeof(key) for document in documents for key in document)
    make_s = time.perf_counter() - began
    holders = [rng.sample(range(num_replicas), rng.randint(1, 3)) for _ in range(num_documents)]
    replica_to_events: dict = {replica_id: [] for replica_id in replica_ids}
    seqs = [0] * num_replicas
    for document, numbers in zip(documents, holders):
        for number in numbers:
            for start in range(0, DOCUMENT_PAGES, EVENT_PAGES):
                seqs[number] += 1
                replica_to_events[replica_ids[number]].append(
                    PagesStored(seqs[number], tuple(document[start:start + EVENT_PAGES])))
    num_events = sum(len(events) for events in replica_to_events.values())
    num_entries = sum(len(numbers) for numbers in holders) * DOCUMENT_PAGES

    def fill() -> PrefixIndex:
        filled = PrefixIndex()
        for replica_id, events in replica_to_events.items():
            for start in range(0, len(events), 64):  # one routing-stats payload carries up to 64 events here
                filled.sync(replica_id, epoch="e", events=events[start:start + 64])
        return filled

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = fill()
    index_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del index
    gc.collect()
    began, cpu_began = time.perf_counter(), time.thread_time()
    index = fill()  # timed without tracemalloc
    apply_s, apply_cpu_s = time.perf_counter() - began, time.thread_time() - cpu_began
    num_keys = len(index._key_to_holder_mask)

    # removal events: evict then re-store 5% of one replica's pages, timed
    victim = replica_ids[0]
    victim_events = replica_to_events[victim][: max(1, len(replica_to_events[victim]) // 20)]
    began = time.perf_counter()
    next_seq = seqs[0]
    for event in victim_events:
        next_seq += 1
        index.sync(victim, epoch="e", events=[PagesRemoved(next_seq, event.keys)])
    for event in victim_events:
        next_seq += 1
        index.sync(victim, epoch="e", events=[PagesStored(next_seq, event.keys)])
    churn_s = time.perf_counter() - began

    policy = PrefixAwarePolicy(index, PolicyConfig())
    loads = [ReplicaLoad(replica_id, rng.randint(0, 8), 4096, 16384) for replica_id in replica_ids]
    wall_ns, cpu_ns = [], []
    now = 1000.0
    for number in range(num_decisions):
        num_new = rng.randint(1, 8)
        if number % 2 == 0:
            document = rng.randrange(num_documents)
            num_cached = rng.randint(8, 64)
            keys = documents[document][:num_cached] + [
                hashlib.blake2b(f"new:{number}:{i}".encode(), digest_size=32).digest() for i in range(num_new)]
        else:
            keys = [hashlib.blake2b(f"fresh:{number}:{i}".encode(), digest_size=32).digest() for i in range(num_new)]
        now += 0.01
        cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
        decision = policy.choose(keys, loads, num_prompt_tokens=len(keys) * 128 + 50, now=now)
        policy.note_routed(f"r{number}", decision.replica_id)
        wall1, cpu1 = time.perf_counter_ns(), time.thread_time_ns()
        wall_ns.append(wall1 - wall0)
        cpu_ns.append(cpu1 - cpu0)
        if number >= 256:
            policy.note_finished(f"r{number - 256}")

    lines = [
        f"| measure ({num_replicas} replicas, {num_keys:,} distinct pages, {num_entries:,} (replica, page) entries) "
        "| value |",
        "|---|---|",
        f"| decision wall time p50 / p99 / max | {_percentile(wall_ns, 50) / 1e3:.1f} / "
        f"{_percentile(wall_ns, 99) / 1e3:.1f} / {max(wall_ns) / 1e3:.0f} us |",
        f"| decision CPU time p50 / p99 | {_percentile(cpu_ns, 50) / 1e3:.1f} / "
        f"{_percentile(cpu_ns, 99) / 1e3:.1f} us |",
        f"| index memory (holder masks, per-replica key sets; keys excluded) | {index_bytes / 2**20:.0f} MiB = "
        f"{index_bytes / num_keys:.0f} B per page, {index_bytes / num_entries:.0f} B per (replica, page) |",
        f"| key bytes objects (32-byte digests) | {key_bytes / 2**20:.0f} MiB = "
        f"{key_bytes / num_keys:.0f} B per page |",
        f"| stored events applied ({EVENT_PAGES} pages each) | {num_events:,} in {apply_s:.2f} s wall "
        f"({apply_cpu_s:.2f} s CPU) = {num_events / apply_s:,.0f} events/s = {num_events * EVENT_PAGES / apply_s:,.0f} "
        "pages/s |",
        f"| removed + stored events, {len(victim_events) * 2:,} on one replica | "
        f"{len(victim_events) * 2 / churn_s:,.0f} events/s |",
        f"| (setup: hashing the keys) | {make_s:.1f} s |",
        "",
    ]
    index.check_integrity() if num_pages <= 20_000 else None
    return "\n".join(lines)
