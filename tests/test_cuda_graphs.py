"""Decode steps on static buffers (replica/cuda_graphs.py): the path CUDA graphs replay.

On the CPU the runner runs that path uncaptured (``graph_decode=True``): the static buffers, the page table and the
attention read through it must give the same logits and the same pool contents as the ordinary eager path, for Llama,
Qwen2 (one kv head) and Mistral (a sliding window shorter than the contexts), over a workload of every step kind. The
Triton kernel is compared with the ATen path where Triton is installed (its interpreter runs it on the CPU), and on a
CUDA machine the captured graphs serve an engine whose greedy tokens equal transformers'."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine_utils import TinyModel, random_prompt, run_to_completion
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica import cuda_graphs
from replica.llama import RMSNorm
from replica.model_runner import ChunkInput, ModelRunner
from test_compiled_runner import PS, Seq, mixed_workload

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny(request):
    return TinyModel(request.param, seed=5)


def test_static_decode_path_matches_the_eager_path(tiny):
    static = ModelRunner(tiny.served, num_pages=32, page_size=PS, device=CPU, backend="eager", graph_decode=True,
                         max_num_seqs=8, max_model_len=1024)
    eager = ModelRunner(tiny.served, num_pages=32, page_size=PS, device=CPU, backend="eager")
    graphs = static.decode_graphs
    assert graphs is not None and not graphs.captured and eager.decode_graphs is None
    assert graphs.width == 8 and graphs.max_batch == 8
    decode_steps = 0
    for chunks in mixed_workload():
        got, expected = static.run(chunks), eager.run(chunks)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        decode_steps += all(len(chunk.token_ids) == 1 for chunk in chunks)
    assert decode_steps == 6 and graphs.replays == decode_steps  # every decode-only step (and the 1-token prompt)
    torch.testing.assert_close(static.kv_cache, eager.kv_cache, rtol=0, atol=1e-6)


def test_static_decode_path_of_a_compiled_forward_never_recompiles_and_matches_eager():
    """A compiled forward takes two rows or more: the batch-1 graph runs its row twice (the same K/V into the same
    slot). The graphs' inputs are whole tensors, so the one graph compiled at start-up serves every step."""
    llama = TinyModel("llama", seed=3)  # the weights of test_compiled_runner's module: its compiled forward is reused
    static = ModelRunner(llama.served, num_pages=32, page_size=PS, device=CPU, backend="compiled", graph_decode=True,
                         max_num_seqs=8, max_model_len=1024)
    eager = ModelRunner(llama.served, num_pages=32, page_size=PS, device=CPU, backend="eager")
    graphs = static.decode_graphs
    assert graphs is not None and graphs.min_rows == 2 and static.num_compiles + static.num_loaded == 1
    compiles = static.num_compiles  # (a graph stored by an earlier run is loaded: replica.compile.PrecompiledForward)
    decode_steps = 0
    for chunks in mixed_workload():
        torch.testing.assert_close(static.run(chunks), eager.run(chunks), rtol=0, atol=1e-4)
        decode_steps += all(len(chunk.token_ids) == 1 for chunk in chunks)
    assert decode_steps == 6 and graphs.replays == decode_steps
    assert static.num_compiles == compiles
    torch.testing.assert_close(static.kv_cache, eager.kv_cache, rtol=0, atol=1e-5)


def test_the_gpu_fusions_keep_the_values(tiny):
    """On a GPU the compact model normalizes with ATen's fused RMSNorm and rotates q and k as one tensor
    (``RMSNorm.fused``, ``DecoderLayer.joint_rope``); switched on here on the CPU, the logits stay those of the
    formulas they replace (float32)."""
    plain = ModelRunner(tiny.served, num_pages=32, page_size=PS, device=CPU, backend="eager")
    fused = ModelRunner(tiny.served, num_pages=32, page_size=PS, device=CPU, backend="eager")
    compact = fused._compact
    norms = [module for module in compact.modules() if isinstance(module, RMSNorm) and not module.gemma]
    assert norms and not any(norm.fused for norm in norms)
    for norm in norms:
        norm.fused = True
    for layer in compact.layers:
        layer.joint_rope = layer.q_norm is None
    assert any(layer.joint_rope for layer in compact.layers)
    for chunks in mixed_workload():
        torch.testing.assert_close(fused.run(chunks), plain.run(chunks), rtol=0, atol=1e-5)
    torch.testing.assert_close(fused.kv_cache, plain.kv_cache, rtol=0, atol=1e-6)


def test_steps_the_buffers_do_not_cover_run_the_ordinary_path(tiny):
    static = ModelRunner(tiny.served, num_pages=32, page_size=PS, device=CPU, backend="eager", graph_decode=True,
                         max_num_seqs=2, max_model_len=256)
    eager = ModelRunner(tiny.served, num_pages=32, page_size=PS, device=CPU, backend="eager")
    graphs = static.decode_graphs
    assert graphs.width == 2 and graphs.max_batch == 2
    long = Seq(random_prompt(300, seed=60), [7, 3, 9])
    a, b, c = (Seq(random_prompt(20 + i, seed=61 + i), [10 + i]) for i in range(3))
    steps = [
        [long.chunk(), a.chunk(), b.chunk(), c.chunk()],  # prompts
        [long.decode(5)],  # its context needs three pages: wider than the table
        [a.decode(6), b.decode(7), c.decode(8)],  # three rows: above the largest batch
        [a.decode(9), b.decode(10)],  # covered
        [c.decode(11), long.decode(12)],  # one row too long: the whole step runs the ordinary path
    ]
    served = []
    for chunks in steps:
        before = graphs.replays
        torch.testing.assert_close(static.run(chunks), eager.run(chunks), rtol=0, atol=1e-5)
        served.append(graphs.replays - before)
    assert served == [0, 0, 0, 1, 0]
    torch.testing.assert_close(static.kv_cache, eager.kv_cache, rtol=0, atol=1e-6)


def _random_case(num_rows, num_heads, num_kv_heads, head_dim, page_size, num_pages, lens, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=g).to(dtype)
    query = torch.randn(num_rows, num_heads, head_dim, generator=g).to(dtype)
    width = max(-(-n // page_size) for n in lens) + 1
    table = torch.stack([torch.randperm(num_pages, generator=g)[:width] for _ in range(num_rows)])
    return query, k_cache, v_cache, table, torch.tensor(lens)


def _reference(query, k_cache, v_cache, table, lens, page_size, scale, window):
    """Row by row in float64 over the positions the row may see."""
    outs = []
    group = query.shape[1] // k_cache.shape[1]
    for row, length in enumerate(lens.tolist()):
        pos = torch.arange(max(0, length - window) if window else 0, length)
        slots = table[row, pos // page_size] * page_size + pos % page_size
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[row].double(), k) * scale
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


@pytest.mark.parametrize("window", [0, 200])
def test_aten_decode_attention_matches_a_row_by_row_reference(window):
    query, k, v, table, lens = _random_case(4, 6, 2, 32, 16, 40, [1, 17, 250, 64], seed=1, dtype=torch.float32)
    got = cuda_graphs.paged_decode_attention(query, k, v, table, lens, 16, 0.2, window, use_triton=False)
    torch.testing.assert_close(got.double(), _reference(query, k, v, table, lens, 16, 0.2, window), rtol=0, atol=1e-5)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not cuda_graphs.triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize("shape", [(1, 9, 3, 64), (5, 8, 8, 32), (3, 4, 1, 48)])
@pytest.mark.parametrize("window", [0, 100])
def test_triton_decode_attention_matches_a_row_by_row_reference(shape, window):
    num_rows, num_heads, num_kv_heads, head_dim = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not INTERPRETED:
        pytest.skip("no GPU: test_triton_kernel_under_the_interpreter runs this under Triton's interpreter")
    lens = [1, 300, 129, 64, 17][:num_rows]
    query, k, v, table, lens_t = _random_case(num_rows, num_heads, num_kv_heads, head_dim, 16, 64, lens, seed=2,
                                              dtype=torch.float32)
    expected = _reference(query, k, v, table, lens_t, 16, 0.125, window)
    query = torch.cat([query, torch.randn(num_rows, num_kv_heads, head_dim)], dim=1)[:, :num_heads]  # a strided view
    got = cuda_graphs.paged_decode_attention(query.to(device), k.to(device), v.to(device), table.to(device),
                                             lens_t.to(device), 16, 0.125, window, use_triton=True)
    torch.testing.assert_close(got.cpu().double(), expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(not cuda_graphs.triton_available() or torch.cuda.is_available() or INTERPRETED,
                    reason="Triton is not installed, or a GPU runs the kernel itself")
def test_triton_kernel_under_the_interpreter():
    """Without a GPU, Triton's interpreter runs the kernel on the CPU (numpy); it must be switched on before Triton
    compiles anything, so the kernel tests above run again in a fresh interpreter process."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "test_triton_decode_attention_matches_a_row_by_row_reference"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 and "6 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_env", ["", "0"])
def test_engine_on_cuda_replays_decode_graphs_with_reference_tokens(compile_env, monkeypatch):
    """The default (the compiled forward's graphs: one compile serves every step) and ``PREFIXSERVE_CUDA_COMPILE=0``
    (the eager forward's graphs)."""
    monkeypatch.setenv("PREFIXSERVE_CUDA_COMPILE", compile_env)
    tiny = TinyModel("mistral", seed=9)
    tiny.served.to("cuda")
    tiny.reference.to("cuda")

    engine = LLMEngine(EngineConfig(num_pages=64, max_num_seqs=8, max_num_batched_tokens=512), tiny.served,
                       device="cuda")
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.captured and len(graphs.graphs) == 8
    assert engine.runner.backend == ("eager" if compile_env == "0" else "compiled")
    prompts = {str(n): random_prompt(n, seed=70 + n) for n in (5, 140, 260, 300)}
    tokens, _ = run_to_completion(engine, prompts, 12)
    for request_id, prompt in prompts.items():
        with torch.inference_mode():
            ref = tiny.reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False,
                                          pad_token_id=0)
        assert tokens[request_id] == ref[0, len(prompt):].tolist()
    assert graphs.replays > 0
    assert engine.runner.num_compiles == (0 if compile_env == "0" else 1)
