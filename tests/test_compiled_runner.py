"""The compiled forward (replica/llama.py + replica/attention_op.py + replica/compile.py): no recompilation in steady
state, the same logits as the eager compact model and as transformers, greedy tokens equal to transformers'
generate (float32), the compile cache shared only by models with equal weights, and the backend choice
(enforce_eager, fallback to transformers for what the compact model does not cover).

tests/test_model_runner.py and tests/test_engine_equivalence.py run the default (compiled) runner for Llama, Qwen2 and
Mistral; ``PREFIXSERVE_ENFORCE_EAGER=1`` runs them eagerly."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config

from engine_utils import VOCAB, TinyModel, random_prompt
from replica.model_runner import ChunkInput, ModelRunner

PS = 128
CPU = torch.device("cpu")


def graphs(run: ModelRunner) -> int:
    """The graphs a runner's compiled forward has made ready: compiled, or loaded from the file an earlier start (or
    test run) stored (``replica.compile.PrecompiledForward``)."""
    return run.num_compiles + run.num_loaded


def runner(model, **kwargs) -> ModelRunner:
    kwargs.setdefault("num_pages", 32)
    return ModelRunner(model, page_size=PS, device=CPU, **kwargs)


@pytest.fixture(scope="module")
def llama():
    return TinyModel("llama", seed=3)


class Seq:
    """A sequence fed to the runner step by step: its tokens so far and its page table."""

    def __init__(self, prompt: list[int], pages: list[int]) -> None:
        self.tokens = list(prompt)
        self.pages = pages
        self.done = 0  # tokens whose K/V are in the pages

    def chunk(self, n: int | None = None, sample: bool = True) -> ChunkInput:
        n = len(self.tokens) - self.done if n is None else n
        chunk = ChunkInput(self.tokens[self.done : self.done + n], self.done, self.pages, sample)
        self.done += n
        return chunk

    def decode(self, token: int) -> ChunkInput:
        self.tokens.append(token)
        return self.chunk(1)


def mixed_workload():
    """Steps of every kind an engine schedules: prefill chunks with and without sampling, chunks continuing a cached
    context, lone decodes, decode batches of 2..5, prefill and decodes in one step, a one-token prompt."""
    a = Seq(random_prompt(300, seed=40), [0, 1, 2, 3])
    b = Seq(random_prompt(5, seed=41), [4])
    c = Seq(random_prompt(1, seed=42), [5])
    d = Seq(random_prompt(140, seed=43), [9, 6])  # scattered pages
    e = Seq(random_prompt(200, seed=44), [10, 11, 12])
    yield [a.chunk(128, sample=False)]
    yield [a.chunk(), b.chunk()]
    yield [a.decode(7), b.decode(8)]
    yield [a.decode(9)]
    yield [c.chunk()]
    yield [a.decode(10), b.decode(11), c.decode(12), d.chunk(40)]
    yield [d.chunk(100, sample=False), a.decode(13)]
    yield [a.decode(14), b.decode(15), c.decode(16), d.decode(17), e.chunk(64, sample=False)]
    yield [e.chunk(), b.decode(18)]
    yield [a.decode(19), b.decode(20), c.decode(21), d.decode(22), e.decode(23)]
    yield [e.decode(24)]
    yield [b.decode(25), c.decode(26)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steady_state_never_recompiles_and_matches_eager(llama, dtype):
    import torch._dynamo.utils

    model = llama.served if dtype == torch.float32 else copy.deepcopy(llama.served).to(dtype)
    compiled = runner(model, backend="compiled")  # explicit: PREFIXSERVE_ENFORCE_EAGER=1 must not turn it off
    eager = runner(model, enforce_eager=True)
    assert compiled.backend == "compiled" and eager.backend == "eager" and eager.num_compiles == 0
    assert graphs(compiled) == 1  # one graph for every step shape (replica/compile.py)
    compiles = compiled.num_compiles
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    atol = 1e-4 if dtype == torch.float32 else 0.1  # bfloat16: fused kernels round differently
    num_steps = 0
    for chunks in mixed_workload():
        got = compiled.run(chunks)
        expected = eager.run(chunks)
        assert got.dtype == torch.float32 and got.shape == expected.shape == (sum(c.sample for c in chunks), VOCAB)
        torch.testing.assert_close(got, expected, rtol=0, atol=atol)
        if dtype == torch.bfloat16:  # the same greedy token wherever the eager top two are not within rounding
            top2 = expected.topk(2).values
            clear = top2[:, 0] - top2[:, 1] > 2 * atol
            assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
        num_steps += 1
    assert num_steps == 12
    assert compiled.num_compiles == compiles
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before
    torch.testing.assert_close(compiled.kv_cache.float(), eager.kv_cache.float(), rtol=0, atol=atol / 10)


def test_compiled_forward_is_shared_only_by_equal_weights(llama):
    # a compiled forward runs the module it was built from, with that model's weights: sharing it with a model whose
    # weights differ would be wrong
    model = copy.deepcopy(llama.served).to(torch.bfloat16)
    first = runner(model, backend="compiled")
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    twin = runner(copy.deepcopy(model), backend="compiled")  # same values: the cached graphs, no compile
    assert twin._compiled is first._compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before  # nothing traced again
    other = copy.deepcopy(model)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(1.5)
    different = runner(other, backend="compiled")
    assert different._compiled is not first._compiled and graphs(different) == 1
    prompt = random_prompt(150, seed=50)
    got = different.run([ChunkInput(prompt, 0, [0, 1], sample=True)])
    expected = runner(other, backend="eager").run([ChunkInput(prompt, 0, [0, 1], sample=True)])
    error = (got - expected).abs().max()
    stale_error = (first.run([ChunkInput(prompt, 0, [0, 1], sample=True)]) - expected).abs().max()
    assert error < 0.1 and stale_error > 5 * error  # the first model's weights would be far off


def test_enforce_eager_by_argument_and_environment(llama, monkeypatch):
    monkeypatch.delenv("PREFIXSERVE_ENFORCE_EAGER", raising=False)
    assert runner(llama.served).backend == "compiled"
    assert runner(llama.served, enforce_eager=True).backend == "eager"
    monkeypatch.setenv("PREFIXSERVE_ENFORCE_EAGER", "1")
    from_env = runner(llama.served)
    assert from_env.backend == "eager" and from_env.num_compiles == 0


def test_models_the_compact_code_does_not_cover_keep_the_transformers_path():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = AutoModelForCausalLM.from_config(config).eval()
    fallback = runner(model)
    assert fallback.backend == "transformers" and "dynamic" in fallback.fallback_reason
    with pytest.raises(ValueError, match="cannot run this model"):
        runner(model, backend="compiled")


def qwen3_config():
    return Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)


def gemma3_config():
    # one sliding layer with a window shorter than the prompts, one full layer; each with its own rope
    return Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                            sliding_window=96, layer_types=["sliding_attention", "full_attention"],
                            query_pre_attn_scalar=16, final_logit_softcapping=0.5)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("make_config", [qwen3_config, gemma3_config], ids=["qwen3", "gemma3"])
def test_qwen3_and_gemma3_logits_and_greedy_tokens_match_transformers(make_config, backend):
    torch.manual_seed(0)
    config = make_config()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    with torch.no_grad():  # random Gemma norms are zeros (weight + 1): give every norm some spread
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    reference.generation_config.eos_token_id = None
    run = runner(model, backend=backend)
    assert run.backend == backend
    prompt = random_prompt(230, seed=60)
    seq = Seq(prompt, [3, 7])
    run.run([seq.chunk(100, sample=False)])
    assert_matches_transformers(run, seq, reference, num_tokens=5)


def assert_matches_transformers(run: ModelRunner, seq: Seq, reference, num_tokens: int) -> None:
    """The rest of ``seq``'s prompt, then ``num_tokens`` lone greedy decodes through ``run``: the prompt's last logits
    are ``reference``'s (float32, to 2e-4) and the tokens are its ``generate``'s."""
    prompt = list(seq.tokens)
    logits = run.run([seq.chunk()])
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[0], expected, rtol=0, atol=2e-4)
        generated = []
        for _ in range(num_tokens):
            generated.append(int(logits[0].argmax()))
            logits = run.run([seq.decode(generated[-1])])
        expected_tokens = reference.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                                             pad_token_id=0)[0, len(prompt):].tolist()
    assert generated == expected_tokens


@pytest.mark.parametrize(("setting", "backend"), [("1", "eager"), ("1", "compiled"), ("", "eager"), ("0", "eager")])
def test_packed_linear_weights_keep_transformers_logits_and_greedy_tokens(llama, monkeypatch, setting, backend):
    """``PREFIXSERVE_PACKED_LINEAR=1`` forces the packed oneDNN weights from 4 rows (the default on AVX-512 CPUs; on
    others the default takes them from 17 rows, past the small-row kernel), ``0`` turns them off; either way a prompt
    (rows >= ``packed_from_rows``: packed) and lone decodes (the small-row kernel) give transformers' float32 logits
    and greedy tokens."""
    from replica import cpu_kernels
    from replica.llama import PACKED_FROM_ROWS, PACKED_FROM_ROWS_AVX2

    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    if setting:
        monkeypatch.setenv("PREFIXSERVE_PACKED_LINEAR", setting)
    else:
        monkeypatch.delenv("PREFIXSERVE_PACKED_LINEAR", raising=False)
    run = runner(llama.served, backend=backend)
    compact = run._compiled.forward.module if backend == "compiled" else run._compact
    layer = compact.layers[0]
    packs = (layer.qkv_packed, layer.o_packed, layer.gate_up_packed, layer.down_packed, compact.lm_head_packed)
    if setting == "1":
        assert compact.packed_from_rows == PACKED_FROM_ROWS and all(p is not None and p.is_mkldnn for p in packs)
    elif setting == "":
        wide = PACKED_FROM_ROWS if cpu_kernels.packed_gemm_from_few_rows() else PACKED_FROM_ROWS_AVX2
        assert compact.packed_from_rows == wide and all(p is not None and p.is_mkldnn for p in packs)
    else:
        assert compact.packed_from_rows == 0 and all(p is None for p in packs)
    assert_matches_transformers(run, Seq(random_prompt(200, seed=61), [2, 5]), llama.reference, num_tokens=6)


def test_one_cpu_graph_serves_every_thread_count_without_compiling_again(llama, monkeypatch):
    """A CPU engine whose decode and prefill steps run on different torch thread counts compiles one graph, on
    ``compile_thread_count`` threads, and steps on either count reuse it (Dynamo's GLOBAL_STATE guard, which holds
    the thread count, is dropped on a CPU; kept on a GPU) with the eager forward's logits. The state that guard also
    covered is checked by the forward itself: a changed default dtype or CPU autocast is refused, not served."""
    import torch._dynamo.utils
    from types import SimpleNamespace

    from replica.compile import compile_thread_count, skip_module_guards

    state = [SimpleNamespace(name="", guard_type=kind, orig_guard=SimpleNamespace(source=SimpleNamespace(
        is_unspecialized_nn_module=lambda: False))) for kind in ("GLOBAL_STATE", "GRAD_MODE", "TENSOR_MATCH")]
    assert skip_module_guards(state) == [True, True, True]
    assert skip_module_guards(state, keep_global_state=False) == [False, True, True]
    with monkeypatch.context() as patch:
        patch.setattr("os.cpu_count", lambda: 8)
        assert compile_thread_count((1, 2)) == 8 and compile_thread_count((3, 3)) == 3
        assert compile_thread_count(()) == torch.get_num_threads()

    model = copy.deepcopy(llama.served)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.1)  # weights of its own: no other test shares this compiled forward
    before = torch.get_num_threads()
    try:
        compiled = runner(model, backend="compiled", step_threads=(1, 2))
        eager = runner(model, enforce_eager=True)
        entry = compiled._compiled
        assert graphs(compiled) == 1 and entry.threads == compile_thread_count((1, 2))
        assert {1, 2} <= entry.warmed_up
        compiles = compiled.num_compiles
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for i, chunks in enumerate(mixed_workload()):
            torch.set_num_threads(1 + i % 2)
            torch.testing.assert_close(compiled.run(chunks), eager.run(chunks), rtol=0, atol=1e-4)
        assert compiled.num_compiles == compiles
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before
        step = [ChunkInput(random_prompt(10, seed=63), 0, [20], sample=True)]
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="autocast"):
            compiled.run(step)
        torch.set_default_dtype(torch.float64)
        try:
            with pytest.raises(RuntimeError, match="default dtype"):
                compiled.run(step)
        finally:
            torch.set_default_dtype(torch.float32)
        assert compiled.num_compiles == compiles
    finally:
        torch.set_num_threads(before)


def test_calls_check_the_top_module_s_attributes_not_the_module_tree(llama):
    """``replica.compile.skip_module_guards``: a call does not re-check the model's ~750 module-tree guards (its
    tensors, submodules, hooks), but an attribute of the compiled module itself still selects its own graph (a
    benchmark switches ``packed_from_rows`` and ``linear_kernel`` and must get the path it asked for)."""
    from types import SimpleNamespace

    from replica import cpu_kernels
    from replica.compile import skip_module_guards

    def entry(name, on_module):
        return SimpleNamespace(name=name, orig_guard=SimpleNamespace(
            source=SimpleNamespace(is_unspecialized_nn_module=lambda: on_module)))

    entries = [entry("self.packed_from_rows", True), entry("self.linear_kernel", True),
               entry("self._modules['layers']._modules['0'].q_norm", True), entry("self._modules['norm']", True),
               entry("self.embed_weight.shape", True), entry("L['ids_pos']", False), entry("G['torch']", False)]
    assert skip_module_guards(entries) == [True, True, False, False, False, True, True]

    if not cpu_kernels.available():
        pytest.skip("packed_from_rows is read (and guarded) only where the C++ linear kernel runs")
    model = copy.deepcopy(llama.served)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.25)  # weights of its own: no other test shares this compiled forward
    compiled = runner(model, backend="compiled")
    prompt = random_prompt(20, seed=60)
    first = compiled.run([ChunkInput(prompt, 0, [0], sample=True)])
    assert graphs(compiled) == 1
    compiles = compiled.num_compiles
    compact = compiled._compiled.forward.module
    setting = compact.packed_from_rows
    compact.packed_from_rows = setting + 1
    again = compiled.run([ChunkInput(prompt, 0, [1], sample=True)])
    assert compiled.num_compiles == compiles + 1  # the attribute's guard is kept: its own graph
    compact.packed_from_rows = setting
    compiled.run([ChunkInput(prompt, 0, [2], sample=True)])
    assert compiled.num_compiles == compiles + 1  # back to the first graph
    torch.testing.assert_close(again, first, rtol=0, atol=1e-4)
    eps = compact.norm.eps
    compact.norm.eps = eps * 2  # inside the module tree: not checked any more (the model is not changed once built)
    compiled.run([ChunkInput(prompt, 0, [3], sample=True)])
    compact.norm.eps = eps
    assert compiled.num_compiles == compiles + 1


def test_a_forward_stored_by_one_start_is_loaded_by_the_next(llama, monkeypatch, tmp_path, caplog):
    """``replica.compile.PrecompiledForward``: the start that compiles a CPU forward stores its graph in a private
    file; a later start of the same architecture (any weights) loads it instead of tracing and compiling, with the
    eager forward's logits and no compile in steady state. A torn file is compiled again and replaced; a file others
    can write is not loaded; ``PREFIXSERVE_PRECOMPILED_FORWARD=0`` stores nothing."""
    import logging
    import os

    import torch._dynamo.utils

    from replica import compile as compile_module

    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(compile_module.PRECOMPILED_ENV, raising=False)

    def model_scaled(scale):
        model = copy.deepcopy(llama.served)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(scale)  # weights of its own: the process's cache of compiled forwards has no entry for it
        return model

    first = runner(model_scaled(1.3), backend="compiled")
    assert (first.num_compiles, first.num_loaded) == (1, 0)
    [stored] = (tmp_path / "compiled").glob("forward-*.bin")
    assert stored.stat().st_mode & 0o777 == 0o600 and stored.parent.stat().st_mode & 0o777 == 0o700

    model = model_scaled(0.8)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    loaded = runner(model, backend="compiled")
    eager = runner(model, enforce_eager=True)
    assert (loaded.num_compiles, loaded.num_loaded) == (0, 1)
    for chunks in mixed_workload():
        torch.testing.assert_close(loaded.run(chunks), eager.run(chunks), rtol=0, atol=1e-4)
    assert loaded.num_compiles == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before  # nothing traced

    stored.write_bytes(stored.read_bytes()[:1000])  # torn
    with caplog.at_level(logging.WARNING, logger="replica.compile"):
        again = runner(model_scaled(0.7), backend="compiled")
    assert (again.num_compiles, again.num_loaded) == (1, 0) and "could not be used" in caplog.text
    assert stored.stat().st_size > 1000 and runner(model_scaled(0.6), backend="compiled").num_loaded == 1

    os.chmod(stored, 0o666)  # another user could have written it: code in it would run
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="replica.compile"):
        assert runner(model_scaled(0.5), backend="compiled").num_loaded == 0
    assert "not this user's alone" in caplog.text

    monkeypatch.setenv(compile_module.PRECOMPILED_ENV, "0")
    off = runner(model_scaled(0.4), backend="compiled")
    assert off._compiled.forward.precompiled is None and off.num_compiles == 1

    older = [tmp_path / "compiled" / f"forward-{n}.bin" for n in range(3)]
    for age, path in enumerate(older):
        path.write_bytes(b"x")
        path.with_suffix(".lock").touch()
        os.utime(path, (1000 - age, 1000 - age))
    compile_module.prune_precompiled(tmp_path / "compiled", keep=3)
    assert sorted(p.name for p in (tmp_path / "compiled").iterdir()) == sorted(
        [stored.name, stored.with_suffix(".lock").name, "forward-0.bin", "forward-0.lock", "forward-1.bin",
         "forward-1.lock"])



def test_a_forward_that_cannot_be_stored_is_compiled_by_dynamo_at_later_starts(llama, monkeypatch, tmp_path, caplog):
    """``PrecompiledForward._worth_trying``: a graph that cannot be written leaves a note beside its file name, and a
    later start compiles with Dynamo (whose FX graph cache an ahead-of-time compile skips) without compiling ahead of
    time again; so does a start whose cache folder cannot be written. Both run the eager forward's logits."""
    import logging
    import os

    from replica import compile as compile_module

    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(compile_module.PRECOMPILED_ENV, raising=False)
    aot_compiles = []
    real_compile = compile_module.PrecompiledForward._compile
    monkeypatch.setattr(compile_module.PrecompiledForward, "_compile",
                        lambda self, *args: aot_compiles.append(self.path) or real_compile(self, *args))

    def fresh_model(scale):  # weights of its own: no entry in the process's cache of compiled forwards
        model = copy.deepcopy(llama.served)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(scale)
        return model

    def unwritable(graph, external_data):
        raise TypeError("cannot pickle 'SomeGuard' object")

    with monkeypatch.context() as patch:
        patch.setattr(torch._dynamo.aot_compile.AOTCompiledFunction, "serialize", staticmethod(unwritable))
        with caplog.at_level(logging.WARNING, logger="replica.compile"):
            first = runner(fresh_model(1.15), backend="compiled")
    assert (first.num_compiles, first.num_loaded, len(aot_compiles)) == (1, 0, 1)
    assert "could not be stored" in caplog.text
    [note] = (tmp_path / "compiled").glob("forward-*" + compile_module.UNSTORABLE_SUFFIX)
    assert "SomeGuard" in note.read_text() and note.stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "compiled").glob("forward-*.bin"))

    def dynamo_only(model):
        later = runner(model, backend="compiled")
        assert (later.num_compiles, later.num_loaded, len(aot_compiles)) == (1, 0, 1)  # Dynamo's compile only
        eager = runner(model, enforce_eager=True)
        for chunks in mixed_workload():
            torch.testing.assert_close(later.run(chunks), eager.run(chunks), rtol=0, atol=1e-4)

    dynamo_only(fresh_model(0.95))

    note.unlink()
    os.chmod(tmp_path / "compiled", 0o500)  # a cache that cannot be written: nothing could be stored
    try:
        assert not compile_module.writable(tmp_path / "compiled") or os.geteuid() == 0  # (root writes anything)
        monkeypatch.setattr(compile_module, "writable", lambda folder: False)  # as any other user would see it
        dynamo_only(fresh_model(0.85))
    finally:
        os.chmod(tmp_path / "compiled", 0o700)
    assert [path.suffix for path in (tmp_path / "compiled").iterdir()] == [".lock"]  # the first start's, only

def test_a_stored_forward_keeps_every_guard_but_those_on_code_identity_and_weights():
    """``replica.compile.portable_guards``: what a stored graph checks at each call. Dropped: guards on which code a
    global names (the file's key carries the code), on the module tree, on the top module's tensors, Dynamo's
    GLOBAL_STATE (as for every CPU forward); kept: the inputs', grad mode's, the top module's plain attributes', and a
    guard on a global's value."""
    from types import SimpleNamespace

    from replica.compile import portable_guards

    def entry(name, kind, *, is_global=False, on_module=False):
        return SimpleNamespace(name=name, guard_type=kind, is_global=is_global, orig_guard=SimpleNamespace(
            source=SimpleNamespace(is_unspecialized_nn_module=lambda: on_module)))

    entries = {
        "input": (entry("L['ids_pos']", "TENSOR_MATCH"), True),
        "grad mode": (entry("", "GRAD_MODE"), True),
        "global state": (entry("", "GLOBAL_STATE"), False),
        "top attribute": (entry("self.linear_kernel", "CONSTANT_MATCH", on_module=True), True),
        "top tensor": (entry("self.lm_head_packed", "TENSOR_MATCH", on_module=True), False),
        "module tree": (entry("self._modules['norm']", "TYPE_MATCH", on_module=True), False),
        "code of a global": (entry("G['torch'].rsqrt", "BUILTIN_MATCH", is_global=True), False),
        "module of a global": (entry("G['F']", "MODULE_MATCH", is_global=True), False),
        "a global's value": (entry("G['SOME_FLAG']", "EQUALS_MATCH", is_global=True), True),
        "identity": (entry("L['x']", "ID_MATCH"), False),
    }
    kept = portable_guards([guard for guard, _ in entries.values()])
    assert dict(zip(entries, kept)) == {name: keep for name, (_, keep) in entries.items()}



ISA_PROBE_SCRIPT = r"""
import json, sys, threading
from torch._inductor import cpu_vec_isa
from replica import compile as compile_module
from replica.config import EngineConfig
from replica.engine import build_engine

seen, imported = [], []
original = cpu_vec_isa.VecISA.check_build
def check_build(self, code):  # which threads run inductor's probes
    seen.append(threading.current_thread().name)
    return original(self, code)
cpu_vec_isa.VecISA.check_build = check_build
probe = compile_module._probe_isa
def watched():  # what the thread imports (alone: the main thread waits)
    before = set(sys.modules)
    probe()
    imported.extend(sorted(set(sys.modules) - before))
compile_module._probe_isa = watched
compile_module.start_isa_probe()
compile_module._await_isa_probe()
engine = build_engine(EngineConfig(model=sys.argv[1], dtype="float32"))
print(json.dumps({"backend": engine.runner.backend, "probe_threads": sorted(set(seen)), "imported": imported,
                  "computed": cpu_vec_isa.valid_vec_isa_list.cache_info().misses,
                  "vectorized": bool(cpu_vec_isa.valid_vec_isa_list())}))
"""


def test_inductor_s_isa_probe_runs_in_a_thread_whose_result_the_compile_uses(tiny_llama_dir):
    """``replica.compile.start_isa_probe``: inductor's vector-ISA probes (a child process each) run in its thread, and
    an engine's compile uses that thread's result (computed once); the thread imports nothing (every module it uses
    is imported before it starts: two threads importing at once can deadlock on a circular import, and the C++
    extension loader brings in setuptools, which patches the import system). A fresh process: inductor keeps the
    result for the process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = subprocess.run([sys.executable, "-c", ISA_PROBE_SCRIPT, tiny_llama_dir],
                            cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=600)
    assert script.returncode == 0, script.stderr[-3000:]
    seen = json.loads(script.stdout.splitlines()[-1])
    assert (seen["backend"], seen["computed"], seen["imported"]) == ("compiled", 1, [])
    if seen["vectorized"]:  # an x86 CPU with AVX2 or more: its probes ran, in the thread only
        assert seen["probe_threads"] == ["prefixserve-isa-probe"]


@pytest.mark.parametrize("case", ["compiled", "eager", "config names another architecture"])
def test_the_isa_probe_starts_before_the_model_loads_and_not_for_eager_engines(tiny_llama_dir, monkeypatch, case):
    """``build_engine`` starts the probe before loading the model, for engines that compile on a CPU only: not for an
    eager engine, nor where config.json names an architecture the compact model does not cover (transformers' path,
    uncompiled). A compile whose probe was not started ahead still compiles (inductor probes then)."""
    from replica import engine as engine_module
    from replica import model_loader
    from replica.config import EngineConfig

    calls = []
    monkeypatch.setattr(engine_module, "start_isa_probe", lambda: calls.append("probe"))
    load = model_loader.load_model
    monkeypatch.setattr(model_loader, "load_model", lambda *args: calls.append("load") or load(*args))
    if case == "config names another architecture":
        monkeypatch.setattr(engine_module, "names_compact_architecture", lambda config_json: False)
    built = engine_module.build_engine(EngineConfig(model=tiny_llama_dir, dtype="float32",
                                                    enforce_eager=case == "eager"))
    assert calls == (["probe", "load"] if case == "compiled" else ["load"])
    assert built.runner.backend == ("eager" if case == "eager" else "compiled")


def test_which_checkpoints_name_a_compact_architecture(tmp_path):
    from replica.llama import names_compact_architecture
    from replica.model_loader import read_config_json

    def names(text):
        (tmp_path / "config.json").write_text(text)
        return names_compact_architecture(read_config_json(tmp_path))

    assert names('{"architectures": ["Qwen2ForCausalLM"]}') and names('{"architectures": ["LlamaForCausalLM"]}')
    assert not names('{"architectures": ["GPT2LMHeadModel"]}')
    assert not names('{"architectures": ["LlavaForConditionalGeneration"]}')
    assert names("{}") and names('{"architectures": null}') and names("{not json") and names("[1, 2]")
    assert names_compact_architecture(read_config_json(tmp_path / "absent"))
