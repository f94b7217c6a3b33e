"""benchmarks/engine_ttft.py --peak: the attention work a cached prefix adds, and which vector rate it runs on."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, Qwen3Config

from benchmarks import engine_ttft
from replica import cpu_kernels


def test_prefix_attention_flops_counts_every_layer_head_and_prefix_key_for_each_new_token():
    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    # 64 new tokens x 2048 cached keys x 9 query heads x 64 dims x 30 layers, 2 products of 2 FLOPs each
    assert engine_ttft.prefix_attention_flops(smollm2, 2048, 64) == 4 * 30 * 9 * 64 * 64 * 2048
    assert engine_ttft.prefix_attention_flops(smollm2, 0, 64) == 0
    assert engine_ttft.prefix_attention_flops(smollm2, 4096, 64) == 2 * engine_ttft.prefix_attention_flops(
        smollm2, 2048, 64)


def test_prefix_attention_flops_takes_an_explicit_head_size():
    qwen3 = Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        num_hidden_layers=28)
    assert engine_ttft.prefix_attention_flops(qwen3, 1000, 10) == 4 * 28 * 16 * 128 * 10 * 1000


@pytest.mark.parametrize(("dtype", "flags", "amx", "key"), [
    ("bfloat16", {"fma", "avx512f", "avx512_bf16", "amx_tile"}, True, None),  # AMX tiles: not probed
    ("bfloat16", {"fma", "avx512f", "avx512_bf16"}, False, "dpbf16_zmm_per_s"),  # Zen 4 / Zen 5
    ("bfloat16", {"fma", "avx512f"}, False, "fma_zmm_per_s"),  # widened to float32
    ("bfloat16", {"fma", "avx2"}, False, "fma_ymm_per_s"),
    ("float32", {"fma", "avx512f", "avx512_bf16"}, False, "fma_zmm_per_s"),
    ("float32", {"fma", "avx2"}, False, "fma_ymm_per_s"),
    ("float32", {"sse4_2"}, False, None),  # no vector kernel
])
def test_attention_peak_key_is_the_instruction_the_kernel_runs_on(dtype, flags, amx, key):
    assert engine_ttft.attention_peak_key(dtype, flags, amx) == key


@pytest.mark.skipif(shutil.which("g++") is None or "fma" not in cpu_kernels._cpu_flag_set() or cpu_kernels.has_amx(),
                    reason="needs g++ and an FMA CPU without AMX tiles (whose kernel the probe does not cover)")
def test_peak_bound_adds_the_prefix_work_at_the_probed_rate_to_the_floor():
    config = LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=8)
    engine = SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(config=config)))
    args = SimpleNamespace(dtype="float32", prefill_threads=2, prefix_len=2048, suffix_len=64)
    bound = engine_ttft.peak_bound(engine, args, floor_s=0.010)
    key = engine_ttft.attention_peak_key("float32", cpu_kernels._cpu_flag_set(), False)
    assert bound["instruction"] == key.removesuffix("_per_s")
    assert bound["attention_flops"] == 4 * 8 * 8 * 64 * 64 * 2048
    # an FMA CPU at 1 GHz or more starts an 8-wide FMA (16 FLOPs) a cycle on each core, or more
    assert bound["peak_flops_per_s"] > 2 * 16e9
    assert bound["warm_over_floor_at_peak"] == pytest.approx(
        1 + bound["attention_flops"] / bound["peak_flops_per_s"] / 0.010)
