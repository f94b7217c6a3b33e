"""The cost model: what one engine step of one replica costs, calibrated from the engine's measured numbers.

Calibration (tiny Llama 512 x 8, float32, one torch thread; BENCHMARKS.md sections 0-2):

    engine_ttft.py (benchmarks/results/engine_ttft_fp32.txt, 2-core AMD EPYC):
        suffix alone  64 new tokens, no context        43.4 ms
        warm          64 new tokens after 2048 cached   89.1 ms
        cold          2112 new tokens                 1674.3 ms
    fitted to  step = STEP_MS + PREFILL_TOKEN_MS * new + ATTENTION_PAIR_US/1000 * new * (context + new / 2):
        STEP_MS = 16.0, PREFILL_TOKEN_MS = 0.417, ATTENTION_PAIR_US = 0.35 (exact through the three points)
    forward_step.py fp32 nofreeze, 1 thread (results/forward_step.txt run A): decode b1 19.8 ms, b4 37.9 ms at
        context 1024 -> 6.0 ms per decode row at 1024 tokens of context; decode_attention.py (results/
        decode_attention.txt): ~0.54 ms per row per layer at ~2100 context -> ~2 us per context token per row (8
        layers). So DECODE_ROW_MS = 4.0 + DECODE_CONTEXT_US/1000 * context, DECODE_CONTEXT_US = 2.0
    kv_sources.py (results/kv_sources_fp32.txt): 16 pages (2048 tokens) from a peer 55.7 ms, Redis 47.5 ms, disk
        38.8 ms -> PEER_COPY_PAGE_MS = 3.5, HOST_TIER_PAGE_MS = 3.0, DISK_TIER_PAGE_MS = 2.4

A step = the fixed cost + every running request's decode row + the prefill chunks scheduled in it (token budget
MAX_NUM_BATCHED_TOKENS) + the pages imported (copied or fetched) for requests admitted in it.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_SIZE = 128


@dataclass(frozen=True)
class CostModel:
    step_ms: float = 16.0
    prefill_token_ms: float = 0.417
    attention_pair_us: float = 0.35
    decode_row_ms: float = 4.0
    decode_context_us: float = 2.0
    peer_copy_page_ms: float = 3.5
    host_tier_page_ms: float = 3.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    page_size: int = PAGE_SIZE
    cached_token_us: float = 0.0
    """Replica time per locally cached prompt token reused (matching and mapping its pages), in the admitting step;
    0 in the published calibration, fitted by benchmarks/sim_calibration.py."""
    request_overhead_ms: float = 0.0
    """Time a request spends before the engine sees it (HTTP, ingress, routing), added to TTFT only by callers that
    model it (benchmarks/sim_calibration.py); it occupies no replica."""

    def prefill_chunk_ms(self, num_new: int, num_context: int) -> float:
        """Cost of computing ``num_new`` prompt tokens after ``num_context`` tokens already in the KV cache."""
        return num_new * self.prefill_token_ms + self.attention_pair_us * 1e-3 * num_new * (num_context + num_new / 2)

    def decode_ms(self, num_rows: int, sum_context: int) -> float:
        return num_rows * self.decode_row_ms + self.decode_context_us * 1e-3 * sum_context

    def policy_kwargs(self) -> dict:
        """The same numbers in PolicyConfig's terms (the router's estimate; decode row at ~1024 tokens of context)."""
        return {
            "page_size": self.page_size,
            "step_ms": self.step_ms,
            "prefill_token_ms": self.prefill_token_ms,
            "attention_pair_us": self.attention_pair_us,
            "decode_row_ms": self.decode_row_ms + self.decode_context_us * 1e-3 * 1024,
            "peer_copy_page_ms": self.peer_copy_page_ms,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }


COST_MODELS = {
    "calibrated": CostModel(),
    "dear-copy": CostModel(peer_copy_page_ms=35.0),
    "slow-compute": CostModel(step_ms=48.0, prefill_token_ms=1.25, attention_pair_us=1.05, decode_row_ms=12.0,
                              decode_context_us=6.0),
}
"""``calibrated``: the engine's measured numbers above (PolicyConfig's defaults are these). The other two are
hypothetical deployments where the defaults are wrong, to show what measuring buys: ``dear-copy`` copies a page 10x
slower (35 ms: e.g. peers on other nodes through the object store); ``slow-compute`` computes 3x slower (a smaller
CPU share per replica) with the copy cost unchanged."""
