"""The small-row linear kernel (replica/csrc/small_linear.cpp) against a float64 reference: every tile shape (1-4 rows
per tile with AVX-512, 1-3 with AVX2; 4 weight rows per block and the single-row tail), AVX-512's streaming path for
1-3 rows (16 weight rows per reduction, a masked tail, several tasks), the row limits (16 float32, 8 bfloat16), bias,
and the inputs it hands to ATen unchanged (more rows, K not a multiple of its vector of 16 or 8 floats, non-contiguous
input, float16)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from replica import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built (no compiler?)")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16])
@pytest.mark.parametrize("out_features", [4, 7, 33, 258])
@pytest.mark.parametrize("with_bias", [False, True])
# 40: a multiple of AVX2's 8 floats, not of AVX-512's 16; 128: AVX-512's streaming path for 1-3 rows (K % 64 == 0)
@pytest.mark.parametrize("in_features", [96, 40, 128])
def test_kernel_matches_float64(rows, out_features, with_bias, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    out = cpu_kernels.linear(x, weight, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(x, weight, bias), rtol=1e-5, atol=1e-4)
    # the same numbers as ATen's float32 GEMM up to float32 rounding
    torch.testing.assert_close(out, cpu_kernels.linear(x, weight, bias, use_kernel=False), rtol=1e-5, atol=1e-4)


def test_kernel_result_differs_from_aten_only_by_rounding_and_is_deterministic():
    """The kernel really runs (its summation order is its own, so some output differs from ATen's in the last bits)
    and is deterministic call to call."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(4, 512, generator=generator)
    weight = torch.randn(2048, 512, generator=generator)
    ours, again = cpu_kernels.linear(x, weight), cpu_kernels.linear(x, weight)
    assert torch.equal(ours, again)
    aten = cpu_kernels.linear(x, weight, use_kernel=False)
    assert not torch.equal(ours, aten)
    torch.testing.assert_close(ours, aten, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_kernel_matches_float64_up_to_one_rounding(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=generator).bfloat16()
    weight = torch.randn(37, 128, generator=generator).bfloat16()
    bias = torch.randn(37, generator=generator).bfloat16() if with_bias else None
    out = cpu_kernels.linear(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 37)
    reference = _reference(x, weight, bias)
    # float32 sums, then one rounding to bfloat16 (8 bits of mantissa): within half a bfloat16 ulp of the exact value
    torch.testing.assert_close(out.double(), reference, rtol=2**-8, atol=1e-3)
    assert (out.double() == reference.bfloat16().double()).float().mean() > 0.9  # mostly the correctly rounded value


@pytest.mark.parametrize(
    "make",
    [
        lambda g: (torch.randn(17, 64, generator=g), torch.randn(40, 64, generator=g)),  # more rows than the kernel takes
        # K not a multiple of the kernel's vector (16 floats with AVX-512, 8 with AVX2)
        lambda g: (torch.randn(3, 36, generator=g), torch.randn(9, 36, generator=g)),
        lambda g: (torch.randn(64, 5, generator=g).t(), torch.randn(9, 64, generator=g)),  # non-contiguous input
        lambda g: (torch.randn(9, 64, generator=g).bfloat16(), torch.randn(9, 64, generator=g).bfloat16()),
        lambda g: (torch.randn(4, 64, generator=g).half(), torch.randn(9, 64, generator=g).half()),
    ],
    ids=["17-rows", "k-36", "strided", "bfloat16-9-rows", "float16"],
)
def test_inputs_outside_the_kernel_go_to_aten(make):
    x, weight = make(torch.Generator().manual_seed(3))
    assert torch.equal(cpu_kernels.linear(x, weight), F.linear(x, weight))


def test_compact_model_uses_the_kernel_for_float32_and_bfloat16(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from replica.llama import CompactCausalLM

    for dtype, expected in ((torch.float32, True), (torch.bfloat16, True), (torch.float16, False)):
        model = CompactCausalLM(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype).eval())
        assert model.linear_kernel is expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_weight_runs_onednn_from_its_row_count_and_the_kernel_below(dtype, with_bias):
    """With a packed weight, inputs of ``packed_from_rows`` rows or more are oneDNN's packed GEMM (bit for bit the op
    inductor's frozen graphs call) and smaller ones the kernel's, both the float64 product up to rounding."""
    if not cpu_kernels.can_pack(dtype):
        pytest.skip("oneDNN cannot reorder bfloat16 weights on this CPU")
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype) if with_bias else None
    packed = cpu_kernels.pack_linear_weight(weight)
    assert packed.is_mkldnn
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    for rows in (1, 2, 3, 5, 40):
        x = torch.randn(rows, 64, generator=generator).to(dtype)
        out = cpu_kernels.linear(x, weight, bias, True, packed, 3)
        expected = (torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "") if rows >= 3
                    else cpu_kernels.linear(x, weight, bias))
        assert out.dtype == dtype and torch.equal(out, expected), rows
        torch.testing.assert_close(out.double(), _reference(x, weight, bias), **tolerance)
    strided = torch.randn(64, 7, generator=generator).to(dtype).t()  # a non-contiguous input is copied first
    torch.testing.assert_close(cpu_kernels.linear(strided, weight, bias, True, packed, 3).double(),
                               _reference(strided, weight, bias), **tolerance)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_bfloat16_weights_are_not_packed_where_onednn_cannot_reorder_them(monkeypatch):
    """On an AVX2-only CPU oneDNN's bfloat16 reorder raises, so even ``PREFIXSERVE_PACKED_LINEAR=1`` leaves bfloat16
    weights unpacked (the model builds and runs the kernel and ATen) while float32 ones are packed."""
    monkeypatch.setenv("PREFIXSERVE_PACKED_LINEAR", "1")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: fpu avx avx2 fma f16c")
    assert cpu_kernels.packed_gemm_pays(torch.float32) and not cpu_kernels.packed_gemm_pays(torch.bfloat16)
    assert cpu_kernels.packed_gemm_from_few_rows()  # forced: from 4 rows, as on AVX-512
    monkeypatch.delenv("PREFIXSERVE_PACKED_LINEAR")
    # the default packs float32 on AVX2 too, for the rows past the small-row kernel only
    assert cpu_kernels.packed_gemm_pays(torch.float32) and not cpu_kernels.packed_gemm_from_few_rows()
    monkeypatch.setenv("PREFIXSERVE_PACKED_LINEAR", "0")
    assert not cpu_kernels.packed_gemm_pays(torch.float32)
    monkeypatch.delenv("PREFIXSERVE_PACKED_LINEAR")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: avx2 fma avx512f avx512dq avx512bw avx512vl")
    assert cpu_kernels.packed_gemm_pays(torch.float32) and cpu_kernels.packed_gemm_pays(torch.bfloat16)
    assert cpu_kernels.packed_gemm_from_few_rows()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: avx2 fma avx_ne_convert")
    assert cpu_kernels.can_pack(torch.bfloat16) and not cpu_kernels.packed_gemm_pays(torch.bfloat16)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_compact_float32_model_packs_past_the_kernel_on_avx2_and_from_4_rows_on_avx512(tiny_llama_dir, monkeypatch):
    """A float32 model holds packed weights for oneDNN on AVX2 CPUs, for inputs of 17 rows or more (the small-row
    kernel keeps its 1-16), and on AVX-512 CPUs from 4 rows; a CPU with neither packs nothing."""
    from transformers import AutoModelForCausalLM

    from replica.llama import CompactCausalLM

    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    source = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    monkeypatch.delenv("PREFIXSERVE_PACKED_LINEAR", raising=False)
    for flags, rows in (("fpu avx avx2 fma f16c", 17), ("avx2 fma avx512f avx512dq avx512bw avx512vl", 4),
                        ("fpu sse2 sse4_2", 0)):
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda flags=flags: f"flags\t\t: {flags}")
        model = CompactCausalLM(source)
        assert model.packed_from_rows == rows, flags
        assert (model.layers[0].qkv_packed is not None) is (rows > 0) and (model.lm_head_packed is not None) is (
            rows > 0), flags


def test_the_amx_library_is_built_only_on_a_cpu_with_amx(monkeypatch):
    """Without amx_tile / amx_bf16 / avx512_bf16 the AMX library is not built (it would hold no kernel); with them
    its build is tried once (here it fails: the fake build below returns a reason), and ``has_amx`` is False."""
    assert cpu_kernels.available()
    builds = []
    monkeypatch.setattr(cpu_kernels, "_build", lambda sources, prefix: builds.append(prefix) or "no compiler here")
    # a copy of the state without this CPU's answer, put back whole afterwards: later tests see the real answer
    monkeypatch.setattr(cpu_kernels, "_state", {k: v for k, v in cpu_kernels._state.items() if k != "amx"})
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: avx2 fma avx512f avx512_bf16")
    assert not cpu_kernels.has_amx() and not cpu_kernels.has_amx() and builds == []
    del cpu_kernels._state["amx"]
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile")
    assert not cpu_kernels.has_amx() and not cpu_kernels.has_amx() and builds == ["prefixserve_amx"]


def test_packed_rows_differ_from_the_kernel_so_the_switch_is_real():
    """From ``packed_from_rows`` up the packed GEMM answers, not the kernel: their sums are ordered differently."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4, 512, generator=generator)
    weight = torch.randn(2048, 512, generator=generator)
    packed = cpu_kernels.pack_linear_weight(weight)
    assert not torch.equal(cpu_kernels.linear(x, weight, None, True, packed, 3), cpu_kernels.linear(x, weight))
    assert torch.equal(cpu_kernels.linear(x, weight, None, True, packed, 5), cpu_kernels.linear(x, weight))


needs_pairs = pytest.mark.skipif(not cpu_kernels.has_pair_linear(), reason="kernels not built with AVX512-BF16")
needs_float_pairs = pytest.mark.skipif(not cpu_kernels.has_pair_linear(torch.float32),
                                       reason="kernels not built with AVX-512")
PAIR_DTYPES = [pytest.param(torch.bfloat16, marks=needs_pairs), pytest.param(torch.float32, marks=needs_float_pairs)]


@needs_pairs
def test_pair_layout_puts_two_inputs_of_one_output_side_by_side_in_blocks_of_32_outputs():
    weight = torch.arange(37 * 6, dtype=torch.float32).view(37, 6).bfloat16()  # exact in bfloat16 (< 256)
    pairs = cpu_kernels.pack_pairs(weight)
    assert pairs.shape == (2, 3, 32, 2) and pairs.dtype == torch.bfloat16
    for n in range(37):
        for k in range(6):
            assert pairs[n // 32, k // 2, n % 32, k % 2] == weight[n, k]
    assert not pairs[1, :, 5:].any()  # columns past the last output are zeros


@needs_float_pairs
def test_float32_pair_layout_holds_one_input_per_unit_in_blocks_of_32_outputs():
    weight = torch.arange(37 * 5, dtype=torch.float32).view(37, 5) + 0.25
    pairs = cpu_kernels.pack_pairs(weight)
    assert pairs.shape == (2, 5, 32, 1) and pairs.dtype == torch.float32
    for n in range(37):
        for k in range(5):
            assert pairs[n // 32, k, n % 32, 0] == weight[n, k]
    assert not pairs[1, :, 5:].any()


@pytest.mark.parametrize("dtype", PAIR_DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])  # 13-16: 12, then the rest
@pytest.mark.parametrize("out_features", [7, 32, 70, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_pair_kernel_matches_float64_up_to_one_rounding(dtype, rows, out_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    weight = torch.randn(out_features, 96, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    pairs = cpu_kernels.pack_pairs(weight)
    out = cpu_kernels.linear(x, weight, bias, pairs=pairs, pairs_below_rows=17)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    reference = _reference(x, weight, bias)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), reference, rtol=2**-8, atol=1e-3)
        assert (out.double() == reference.bfloat16().double()).float().mean() > 0.9
    else:
        torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)
        if rows > 1:  # the pair kernel answered (one float32 row streams from the weight itself)
            doubled = cpu_kernels.linear(x, weight, bias, pairs=cpu_kernels.pack_pairs(weight * 2), pairs_below_rows=17)
            torch.testing.assert_close(doubled.double(), _reference(x, weight * 2, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", PAIR_DTYPES)
def test_pair_kernel_leaves_a_strided_or_mismatched_bias_to_the_other_paths(dtype):
    """A bias that is not contiguous, or not one value per output, is not the pair kernel's to read: the input goes
    to the other paths (which answer a strided bias right and refuse a short one)."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(4, 64, generator=generator).to(dtype)
    weight = torch.randn(40, 64, generator=generator).to(dtype)
    strided = torch.randn(80, generator=generator).to(dtype)[::2]
    pairs = cpu_kernels.pack_pairs(weight)
    out = cpu_kernels.linear(x, weight, strided, pairs=pairs, pairs_below_rows=17)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.double(), _reference(x, weight, strided), rtol=tolerance, atol=tolerance)
    with pytest.raises(RuntimeError):
        cpu_kernels.linear(x, weight, strided[:39].contiguous(), pairs=pairs, pairs_below_rows=17)


@needs_pairs
def test_pair_kernel_answers_below_its_row_count_only():
    """Below ``pairs_below_rows`` the pair kernel answers, from there the packed GEMM (or the small-row kernel) as
    before. (Its bfloat16 sums are bit for bit oneDNN's, so the pairs given here hold twice the weight, an exact
    scaling, to show which path answered.)"""
    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(300, 128, generator=generator).bfloat16()
    doubled_pairs, packed = cpu_kernels.pack_pairs(weight * 2), cpu_kernels.pack_linear_weight(weight)
    for rows in (1, 3, 4, 8, 9, 12, 16, 17):
        x = torch.randn(rows, 128, generator=generator).bfloat16()
        plain = cpu_kernels.linear(x, weight, None, True, packed, 4)
        switched = cpu_kernels.linear(x, weight, None, True, packed, 4, doubled_pairs, 17)
        assert torch.equal(switched, plain * 2 if rows < 17 else plain), rows
        assert torch.equal(cpu_kernels.linear(x, weight, None, True, packed, 4, doubled_pairs, rows), plain)


@needs_float_pairs
def test_float32_pair_kernel_answers_from_two_rows_below_its_row_count_and_never_for_another_dtype():
    """float32: from 2 rows to ``pairs_below_rows`` the pair kernel answers (pairs of twice the weight show it); one
    row and 17 rows go to the small-row kernel and the packed GEMM as before. Pairs of the other dtype are not taken:
    the input's dtype must match."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(300, 128, generator=generator)
    doubled_pairs, packed = cpu_kernels.pack_pairs(weight * 2), cpu_kernels.pack_linear_weight(weight)
    for rows in (1, 2, 3, 4, 8, 9, 12, 16, 17):
        x = torch.randn(rows, 128, generator=generator)
        plain = cpu_kernels.linear(x, weight, None, True, packed, 4)
        switched = cpu_kernels.linear(x, weight, None, True, packed, 4, doubled_pairs, 17)
        if 2 <= rows < 17:
            torch.testing.assert_close(switched, plain * 2, rtol=1e-5, atol=1e-4)
        else:
            assert torch.equal(switched, plain), rows
        assert torch.equal(cpu_kernels.linear(x, weight, None, True, packed, 4, doubled_pairs, rows), plain)
    if cpu_kernels.has_pair_linear(torch.bfloat16):
        x16 = torch.randn(3, 128, generator=generator).bfloat16()
        bf16_weight = weight.bfloat16()
        assert torch.equal(cpu_kernels.linear(x16, bf16_weight, None, True, None, 0, doubled_pairs, 17),
                           cpu_kernels.linear(x16, bf16_weight))
        x32 = torch.randn(3, 128, generator=generator)
        assert torch.equal(cpu_kernels.linear(x32, weight, None, True, None, 0,
                                              cpu_kernels.pack_pairs(bf16_weight * 2), 17),
                           cpu_kernels.linear(x32, weight))


def _helper_takes_part(call, seconds: float = 5.0) -> bool:
    """Whether the step helper computes a chunk of ``call()`` (made armed, again and again) within ``seconds``."""
    before = cpu_kernels.step_helper_chunks()
    deadline = time.monotonic() + seconds
    cpu_kernels.arm_step_helper(True)
    try:
        while cpu_kernels.step_helper_chunks() == before and time.monotonic() < deadline:
            call()
    finally:
        cpu_kernels.arm_step_helper(False)
    return cpu_kernels.step_helper_chunks() > before


two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the step helper needs a second CPU")


@two_cpus
@pytest.mark.parametrize("dtype", PAIR_DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 16, 24, 37, 64])
@pytest.mark.parametrize("out_features", [70, 300, 2200])  # 3, 10 and 69 blocks (from 64 blocks: chunks of 2)
def test_step_helper_computes_the_same_bits_as_one_thread(dtype, rows, out_features):
    """Armed, the step helper takes chunks of the pair kernel's columns from the calling thread's job: every chunk is
    computed as one thread computes it, so the result is equal bit for bit, whoever took which chunk (calls are made
    until the helper has taken part). Above 16 rows (the rows in groups, only while the helper shares the step) the
    reference is the pair kernel alone on one thread (``pairs_below_rows`` past the row count), close to the GEMM."""
    generator = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, 128, generator=generator).to(dtype)
    weight = torch.randn(out_features, 128, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    pairs = cpu_kernels.pack_pairs(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    shared = []
    try:
        alone = cpu_kernels.linear(x, weight, bias, pairs=pairs, pairs_below_rows=max(17, rows + 1))
        pair_kernel = dtype == torch.bfloat16 or rows >= 2  # (one float32 row streams from the weight itself)
        took_part = _helper_takes_part(
            lambda: shared.append(cpu_kernels.linear(x, weight, bias, pairs=pairs, pairs_below_rows=17)),
            seconds=5.0 if pair_kernel else 0.3)
    finally:
        torch.set_num_threads(before)
    assert took_part == pair_kernel
    for out in shared:
        assert torch.equal(out, alone)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(alone.double(), _reference(x, weight, bias), rtol=tolerance, atol=tolerance)


@two_cpus
@pytest.mark.parametrize("dtype", PAIR_DTYPES)
def test_the_pair_kernel_takes_up_to_its_shared_row_count_while_the_helper_shares_the_step(dtype):
    """From 17 rows to ``max_shared_pair_rows()`` the packed GEMM answers, unless the step helper shares the step
    (armed, one torch thread): then the pair kernel does (pairs of twice the weight show it), its rows in groups, equal
    bit for bit to the kernel on one thread alone and close to twice the GEMM. One row more, or two torch threads, and
    the GEMM answers however the helper stands. (A ``pairs_below_rows`` past 16, as the one-thread reference passes
    here, takes that many rows on the pair kernel without the helper: a hook for tests and benchmarks.)"""
    limit = cpu_kernels.max_shared_pair_rows()
    assert limit >= 24
    generator = torch.Generator().manual_seed(12)
    weight = torch.randn(300, 128, generator=generator).to(dtype)
    doubled_pairs, packed = cpu_kernels.pack_pairs(weight * 2), cpu_kernels.pack_linear_weight(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rows in (17, 24, 25, 37, limit, limit + 1):
            x = torch.randn(rows, 128, generator=generator).to(dtype)
            plain = cpu_kernels.linear(x, weight, None, True, packed, 4)
            assert torch.equal(cpu_kernels.linear(x, weight, None, True, packed, 4, doubled_pairs, 17), plain)
            shared = []
            took_part = _helper_takes_part(
                lambda: shared.append(cpu_kernels.linear(x, weight, None, True, packed, 4, doubled_pairs, 17)),
                seconds=5.0 if rows <= limit else 0.3)
            assert took_part == (rows <= limit), rows
            if rows > limit:
                assert all(torch.equal(out, plain) for out in shared)
                continue
            alone = cpu_kernels.linear(x, weight, None, True, packed, 4, doubled_pairs, rows + 1)
            tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4  # (twice the GEMM: the pair kernel answered)
            torch.testing.assert_close(alone.float(), plain.float() * 2, rtol=tolerance, atol=tolerance)
            assert all(torch.equal(out, alone) for out in shared), rows
        torch.set_num_threads(2)
        x = torch.randn(24, 128, generator=generator).to(dtype)
        cpu_kernels.arm_step_helper(True)
        try:
            assert torch.equal(cpu_kernels.linear(x, weight, None, True, packed, 4, doubled_pairs, 17),
                               cpu_kernels.linear(x, weight, None, True, packed, 4))
        finally:
            cpu_kernels.arm_step_helper(False)
    finally:
        torch.set_num_threads(before)


@two_cpus
@pytest.mark.parametrize("dtype", PAIR_DTYPES)
def test_step_helper_takes_chunks_only_while_armed_and_on_one_torch_thread(dtype):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(12, 512, generator=generator).to(dtype)
    weight = torch.randn(4096, 512, generator=generator).to(dtype)
    pairs = cpu_kernels.pack_pairs(weight)

    def call():
        return cpu_kernels.linear(x, weight, None, pairs=pairs, pairs_below_rows=17)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _helper_takes_part(call)
        taken = cpu_kernels.step_helper_chunks()
        for _ in range(20):  # disarmed: the caller computes every chunk
            call()
        assert cpu_kernels.step_helper_chunks() == taken
        torch.set_num_threads(2)  # a step on torch's threads: OpenMP's split, not the helper
        assert not _helper_takes_part(call, seconds=0.5)
    finally:
        torch.set_num_threads(before)


@two_cpus
@needs_float_pairs
def test_step_helper_never_takes_a_chunk_of_a_job_the_caller_has_finished():
    """Jobs of 2-69 chunks back to back, for 2 s: the helper must never pair one job's claim word with the next job's
    count or function (a chunk computed after its caller returned, or the caller counting it done too early). A
    helper that read the count apart from the word gave 2-5 wrong results in 200000 such calls."""
    generator = torch.Generator().manual_seed(5)
    cases = []
    for out_features, rows in ((70, 2), (2200, 3), (40, 12), (1000, 5)):
        weight, x = torch.randn(out_features, 64, generator=generator), torch.randn(rows, 64, generator=generator)
        pairs = cpu_kernels.pack_pairs(weight)
        cases.append((x, weight, pairs, cpu_kernels.linear(x, weight, None, pairs=pairs, pairs_below_rows=17)))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    wrong = calls = 0
    taken = cpu_kernels.step_helper_chunks()
    deadline = time.monotonic() + 2.0
    cpu_kernels.arm_step_helper(True)
    try:
        while time.monotonic() < deadline:
            for x, weight, pairs, expected in cases * 50:
                calls += 1
                wrong += not torch.equal(cpu_kernels.linear(x, weight, None, pairs=pairs, pairs_below_rows=17),
                                         expected)
            cpu_kernels.arm_step_helper(True)
    finally:
        cpu_kernels.arm_step_helper(False)
        torch.set_num_threads(before)
    assert calls > 1000 and wrong == 0 and cpu_kernels.step_helper_chunks() > taken


@two_cpus
@needs_float_pairs
def test_a_forked_child_starts_a_step_helper_of_its_own():
    """The parent's helper thread does not exist in a forked child: its first arm starts one of its own, from a clean
    state (pthread_atfork), and the child's results are right."""
    generator = torch.Generator().manual_seed(6)
    x, weight = torch.randn(12, 256, generator=generator), torch.randn(3000, 256, generator=generator)
    pairs = cpu_kernels.pack_pairs(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = cpu_kernels.linear(x, weight, None, pairs=pairs, pairs_below_rows=17)

        def call():
            assert torch.equal(cpu_kernels.linear(x, weight, None, pairs=pairs, pairs_below_rows=17), expected)

        assert _helper_takes_part(call)  # the parent's thread runs
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 when its own helper took part and every result was right
            code = 1
            try:
                code = 0 if _helper_takes_part(call) else 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert _helper_takes_part(call)  # and the parent's still does
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", PAIR_DTYPES)
def test_step_helper_serves_one_caller_at_a_time_and_a_second_one_computes_alone(dtype):
    """Jobs come from one thread at a time: while one caller's job is out, another thread's call runs all its
    chunks itself. Four threads calling at once, armed, all get their own right answers."""
    generator = torch.Generator().manual_seed(4)
    weights = [torch.randn(1000 + 100 * i, 256, generator=generator).to(dtype) for i in range(4)]
    inputs = [torch.randn(3 + i, 256, generator=generator).to(dtype) for i in range(4)]
    pairs = [cpu_kernels.pack_pairs(weight) for weight in weights]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = [cpu_kernels.linear(x, w, None, pairs=p, pairs_below_rows=17)
                    for x, w, p in zip(inputs, weights, pairs)]
        results: dict[int, list[bool]] = {i: [] for i in range(4)}

        def caller(i: int) -> None:
            torch.set_num_threads(1)
            for _ in range(40):
                out = cpu_kernels.linear(inputs[i], weights[i], None, pairs=pairs[i], pairs_below_rows=17)
                results[i].append(torch.equal(out, expected[i]))

        cpu_kernels.arm_step_helper(True)
        try:
            threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            cpu_kernels.arm_step_helper(False)
    finally:
        torch.set_num_threads(before)
    assert all(len(done) == 40 and all(done) for done in results.values())


@pytest.mark.parametrize("dtype", PAIR_DTYPES)
def test_compact_model_holds_pairs_unless_switched_off(tiny_llama_dir, monkeypatch, dtype):
    from transformers import AutoModelForCausalLM

    from replica.llama import PAIRS_BELOW_ROWS, CompactCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype).eval()
    model = CompactCausalLM(source)
    assert model.pairs_below_rows == PAIRS_BELOW_ROWS and model.layers[0].qkv_pairs is not None
    assert model.lm_head_pairs is not None and model.lm_head_pairs.dtype == dtype
    monkeypatch.setenv("PREFIXSERVE_PAIR_LINEAR", "0")
    off = CompactCausalLM(source)
    assert off.pairs_below_rows == 0 and off.layers[0].qkv_pairs is None


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not available")
def test_packed_weights_are_made_only_when_the_copy_fits_in_half_the_available_memory(tiny_llama_dir, monkeypatch,
                                                                                       caplog):
    """The packed copy of the linear weights (the decoder layers' matrices and the LM head, counted here from the
    config) is made when it takes at most half the memory the process can still take less what the build takes
    anyway (the KV pool given, the fused QKV and gate/up matrices), and skipped with a warning when the memory is one
    byte less. ``PREFIXSERVE_WEIGHT_COPY_SHARE`` changes the share."""
    from transformers import AutoModelForCausalLM

    from replica.llama import CompactCausalLM

    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    source = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    config = source.config
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = {"q": q * hidden, "k": kv * hidden, "v": kv * hidden, "o": hidden * q, "gate": inter * hidden,
                 "up": inter * hidden, "down": hidden * inter}
    copy_bytes = 4 * (config.num_hidden_layers * sum(per_layer.values()) + config.vocab_size * hidden)
    fused_bytes = 4 * config.num_hidden_layers * sum(per_layer[name] for name in ("q", "k", "v", "gate", "up"))
    kv_pool = 12345
    available = 2 * copy_bytes + fused_bytes + kv_pool
    monkeypatch.delenv("PREFIXSERVE_PACKED_LINEAR", raising=False)
    monkeypatch.delenv("PREFIXSERVE_WEIGHT_COPY_SHARE", raising=False)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: fpu avx avx2 fma f16c")
    monkeypatch.setattr(cpu_kernels, "available_memory_bytes", lambda: available)
    fits = CompactCausalLM(source, kv_pool)
    assert fits.packed_from_rows == 17 and fits.layers[-1].down_packed is not None
    monkeypatch.setattr(cpu_kernels, "available_memory_bytes", lambda: available - 1)
    with caplog.at_level("WARNING", logger=cpu_kernels.log.name):
        short = CompactCausalLM(source, kv_pool)
    assert short.packed_from_rows == 0 and short.lm_head_packed is None
    assert all(layer.qkv_packed is None and layer.down_packed is None for layer in short.layers)
    assert "not keeping packed oneDNN weight copies" in caplog.text
    monkeypatch.setenv("PREFIXSERVE_WEIGHT_COPY_SHARE", "0.51")
    assert CompactCausalLM(source, kv_pool).packed_from_rows == 17
    monkeypatch.setenv("PREFIXSERVE_WEIGHT_COPY_SHARE", "0")
    assert CompactCausalLM(source, kv_pool).packed_from_rows == 0


def test_pair_copies_must_fit_beside_the_packed_ones(tiny_llama_dir, monkeypatch):
    """A bfloat16 model asks for room for one copy for the packed weights, then for two (packed and pairs) together;
    without the packed copy, for one."""
    from transformers import AutoModelForCausalLM

    from replica.llama import CompactCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    asked = []

    def record(num_bytes, what, reserved_bytes=0):
        asked.append((num_bytes, what.split()[0], reserved_bytes))
        return True

    monkeypatch.setattr(cpu_kernels, "weight_copies_fit", record)
    monkeypatch.setattr(cpu_kernels, "available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "packed_gemm_pays", lambda dtype: True)
    monkeypatch.setattr(cpu_kernels, "pair_linear_pays", lambda dtype: True)
    monkeypatch.setattr(cpu_kernels, "pack_linear_weight", lambda weight: weight.clone())
    monkeypatch.setattr(cpu_kernels, "pack_pairs", lambda weight: weight.clone())
    CompactCausalLM(source, 100)
    copy = sum(p.nbytes for p in source.model.layers.parameters() if p.dim() == 2) + source.lm_head.weight.nbytes
    assert [(num, what) for num, what, _ in asked] == [(copy, "packed"), (2 * copy, "pair-layout")]
    assert asked[0][2] == asked[1][2] > 100
    asked.clear()
    monkeypatch.setattr(cpu_kernels, "packed_gemm_pays", lambda dtype: False)
    CompactCausalLM(source, 100)
    assert [(num, what) for num, what, _ in asked] == [(copy, "pair-layout")]


def test_available_memory_is_the_least_of_memavailable_and_every_cgroup_levels_headroom(tmp_path):
    """``MemAvailable``, lowered to the least (limit - working set) over the cgroup levels of v2 and v1: a leaf
    without a limit under a limited parent, v1's "no limit" number, inactive file cache not counted as used, a level
    over its limit; None when nothing is known."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/pod/worker\n")

    def level(folder, limit, usage, v1=False, inactive_file=None):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(f"{limit}\n")
        (folder / ("memory.usage_in_bytes" if v1 else "memory.current")).write_text(f"{usage}\n")
        if inactive_file is not None:
            name = "total_inactive_file" if v1 else "inactive_file"
            (folder / "memory.stat").write_text(f"anon 1\n{name} {inactive_file}\nactive_file 7\n")

    def available():
        return cpu_kernels.available_memory_bytes(str(proc), str(root))

    assert available() == 8000000 * 1024  # no cgroup files: MemAvailable
    level(root / "memory" / "job", 9223372036854771712, 1 << 30, v1=True)  # v1's "no limit"
    assert available() == 8000000 * 1024
    level(root / "pod" / "worker", "max", 5 << 30)  # the leaf sets no limit, its parent does
    level(root / "pod", 6 << 30, 5 << 30)
    assert available() == 1 << 30
    level(root / "pod", 6 << 30, 5 << 30, inactive_file=2 << 30)  # reclaimable file cache is not in use
    assert available() == 3 << 30
    level(root / "memory", 4 << 30, (4 << 30) + 5, v1=True)  # over its limit: nothing left
    assert available() == 0
    (proc / "meminfo").unlink()
    (root / "memory" / "memory.limit_in_bytes").unlink()
    assert available() == 3 << 30
    (root / "pod" / "memory.max").unlink()
    assert available() is None  # no meminfo, no limit anywhere
    (proc / "self" / "cgroup").write_bytes(b"0::/\xff\xfe\n")  # a cgroup name that is not UTF-8
    assert available() is None
    (proc / "self" / "cgroup").unlink()
    assert available() is None
