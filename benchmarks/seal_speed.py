"""The floor that sealing puts under the shared tiers' page moves on this CPU: ``TierKey.open_into`` / ``seal_into``
(AES-256-GCM, what every Redis and disk page goes through) on 1 and 2 threads, beside a plain copy of the same bytes.
Pages of the tiny Llama at page 128 in float32 (2 MiB); 16 of them (32 MiB) per round, as ``benchmarks/kv_sources.py``
moves. A tier path cannot move pages faster than its share of the CPU opens them.

    PYTHONPATH=. .venv/bin/python benchmarks/seal_speed.py [--rounds 20] [--page-mib 2]
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.ecosystem_overhead import median_s
from replica.tiers.seal import NONCE_BYTES, TAG_BYTES, TierKey

NUM_PAGES = 16


def timed(rounds: int, run) -> float:
    """Median seconds of ``run()`` over ``rounds`` (one warm-up first)."""
    run()
    return median_s(run, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--page-mib", type=float, default=2.0)
    args = parser.parse_args()
    page_bytes = int(args.page_mib * (1 << 20))
    key = TierKey.generate()
    # one nonce and one associated data for every page: fine for timing, never for storing (the tiers draw a nonce
    # per page)
    nonce, associated = os.urandom(NONCE_BYTES), b"header and page key"
    plain = [np.frombuffer(os.urandom(page_bytes), dtype=np.uint8) for _ in range(NUM_PAGES)]
    sealed = [bytearray(page_bytes + TAG_BYTES) for _ in range(NUM_PAGES)]
    for page, out in zip(plain, sealed):
        key.seal_into(nonce, page, associated, out)
    opened = [np.empty(page_bytes, dtype=np.uint8) for _ in range(NUM_PAGES)]
    total = NUM_PAGES * page_bytes

    def open_pages(indices) -> None:
        for index in indices:
            key.open_into(nonce, sealed[index], associated, opened[index])

    def seal_pages(indices) -> None:
        for index in indices:
            key.seal_into(nonce, plain[index], associated, sealed[index])

    def copy_pages(indices) -> None:
        for index in indices:
            np.copyto(opened[index], plain[index])

    print(f"{NUM_PAGES} pages of {page_bytes / (1 << 20):g} MiB = {total / (1 << 20):g} MiB per round, "
          f"median of {args.rounds} rounds")
    print("| operation | threads | median ms | GB/s |")
    print("|---|---|---|---|")
    for name, work in (("open (decrypt + check tag)", open_pages), ("seal (encrypt)", seal_pages),
                       ("plain copy", copy_pages)):
        for threads in (1, 2):
            halves = [range(start, NUM_PAGES, threads) for start in range(threads)]
            with ThreadPoolExecutor(threads) as pool:
                seconds = timed(args.rounds, lambda: list(pool.map(work, halves)))
            print(f"| {name} | {threads} | {seconds * 1e3:.1f} | {total / seconds / 1e9:.2f} |")
            if work is open_pages:  # what was opened is what was sealed
                assert all(np.array_equal(a, b) for a, b in zip(opened, plain))
                for page in opened:
                    page.fill(0)


if __name__ == "__main__":
    main()
