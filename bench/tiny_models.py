"""Tiny random-weight Hugging Face models (Llama, Qwen2, Mistral) with a real byte-level BPE tokenizer, for tests
and benchmarks on machines without a model hub.

The tokenizer is trained with the ``tokenizers`` library on the Python standard library's own sources, so it needs
no download and is deterministic for a given Python installation. It uses ChatML-style special tokens::

    id 0  <|endoftext|>   pad
    id 1  <|im_start|>    bos (never added automatically; the chat template writes it)
    id 2  <|im_end|>      eos (ends every chat turn)

CLI: ``python -m bench.tiny_models --out DIR [--arch llama] [--hidden-size 512] ...`` (also wired as
``prefixserve make-tiny-model``). torch and transformers are imported only when a model is built, so the flags and
``--help`` work without them.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path
from typing import Iterator, Sequence

ARCHITECTURES = ("llama", "qwen2", "mistral")
DTYPES = ("float32", "bfloat16")
"""Weight dtypes, by their torch names."""
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # trained first, so their ids are 0, 1, 2
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens
CORPUS_MIN_CHARS = 2_000_000  # ~0.4 s of training on one core
CORPUS_CHARS_PER_TOKEN = 150  # more text for larger vocabularies, so every merge is still learned from real text

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def write_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 1024,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    sliding_window: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a random-weight causal LM and its tokenizer into ``out_dir``; return ``out_dir`` as a Path.

    The folder loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` and
    supports ``apply_chat_template``. Same arguments, same bytes: weights come from ``torch.manual_seed(seed)`` and
    the tokenizer from a fixed corpus. ``num_kv_heads < num_heads`` gives grouped-query attention.
    ``intermediate_size`` defaults to ``2 * hidden_size``; ``sliding_window`` (tokens) is for ``arch="mistral"``
    only (None: full attention). Raises ValueError naming the fix for inconsistent shapes.
    """
    config = build_config(
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
        dtype=dtype,
    )
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    model = build_random_model(config, seed=seed, dtype=dtype)
    model.save_pretrained(out_path)
    build_tokenizer(vocab_size, max_position_embeddings, arch).save_pretrained(out_path)
    return out_path


def validate_shapes(
    arch: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    sliding_window: int | None,
    dtype: str,
) -> None:
    """Raise ValueError, with the remedy, for an architecture or shape the tiny model cannot have."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if min(hidden_size, num_layers, num_heads, num_kv_heads) < 1:
        raise ValueError("hidden size, layers, heads and kv heads must all be at least 1")
    if hidden_size % num_heads:
        raise ValueError(f"hidden size {hidden_size} is not divisible by {num_heads} heads; pick a multiple")
    if (hidden_size // num_heads) % 2:
        raise ValueError(
            f"head dim {hidden_size // num_heads} is odd, which rotary embeddings cannot use; "
            f"choose hidden size / heads even"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} heads cannot be grouped over {num_kv_heads} kv heads; use a divisor")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab size {vocab_size} is below {MIN_VOCAB_SIZE} (all bytes + special tokens)")
    if sliding_window is not None and arch != "mistral":
        raise ValueError(f"sliding_window is only supported with arch='mistral', got arch={arch!r}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 token (or None), got {sliding_window}")


def build_config(
    arch: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    intermediate_size: int | None,
    max_position_embeddings: int,
    sliding_window: int | None,
    dtype: str,
):
    """The transformers config for a tiny model (validated; special token ids 0/1/2 as in the module docstring)."""
    validate_shapes(arch, hidden_size, num_layers, num_heads, num_kv_heads, vocab_size, sliding_window, dtype)
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    return MistralConfig(**common, sliding_window=sliding_window)


def build_random_model(config, seed: int, dtype: str):
    """A causal LM for ``config`` with weights drawn after ``torch.manual_seed(seed)`` (in float32, then cast to
    ``dtype``, one of :data:`DTYPES`)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(getattr(torch, dtype)).eval()


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(vocab_size: int, model_max_length: int, arch: str = "llama"):
    """A transformers fast tokenizer (byte-level BPE, ``vocab_size`` tokens at most) with the chat template set.

    For ``arch="qwen2"`` it is trained with Qwen2's normalizer and pre-tokenizer: transformers' AutoTokenizer
    always loads a qwen2 folder as ``Qwen2Tokenizer``, which rebuilds those two stages from code, and the saved
    ``tokenizer.json`` must split text the same way.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(train_tokenizer_json(vocab_size, arch == "qwen2")),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def train_tokenizer_json(vocab_size: int, qwen2_pre_tokenizer: bool = False) -> str:
    """Train a byte-level BPE tokenizer on the stdlib sources; its JSON. Trained once per argument pair per process.

    Deterministic: the corpus is read in sorted path order and BPE training breaks ties deterministically.
    The vocabulary can come out smaller than ``vocab_size`` only if the corpus runs out of merges.
    """
    return train_tokenizer_json_cached(int(vocab_size), bool(qwen2_pre_tokenizer))


@functools.lru_cache(maxsize=None)
def train_tokenizer_json_cached(vocab_size: int, qwen2_pre_tokenizer: bool) -> str:
    """:func:`train_tokenizer_json` with the process-wide cache (always called with both arguments positional)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    if qwen2_pre_tokenizer:
        set_qwen2_pre_tokenizer(tokenizer)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus_chars = max(CORPUS_MIN_CHARS, CORPUS_CHARS_PER_TOKEN * vocab_size)
    tokenizer.train_from_iterator(read_stdlib_corpus(corpus_chars), trainer=trainer)
    return tokenizer.to_str()


def set_qwen2_pre_tokenizer(tokenizer) -> None:
    """Give ``tokenizer`` the normalizer and pre-tokenizer that transformers' ``Qwen2Tokenizer`` builds."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def read_stdlib_corpus(max_chars: int) -> list[str]:
    """The Python standard library's ``.py`` sources, in sorted path order, until ``max_chars`` are read."""
    texts: list[str] = []
    num_chars = 0
    for path in iter_stdlib_sources():
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        num_chars += len(text)
        if num_chars >= max_chars:
            break
    return texts


def iter_stdlib_sources() -> Iterator[Path]:
    """Every ``.py`` file under the stdlib folder (top level first, then sub-folders A-Z; no site-packages)."""
    root = os.path.dirname(os.__file__)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(name for name in dirnames if name not in ("site-packages", "__pycache__"))
        for filename in sorted(filenames):
            if filename.endswith(".py"):
                yield Path(dirpath) / filename


# ----------------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the tiny-model flags to ``parser`` (usable for a ``make-tiny-model`` subcommand); return it."""
    parser.add_argument("--out", required=True, help="folder to write the model into (created if missing)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--intermediate-size", type=int, default=None, help="default: 2 x hidden size")
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    parser.add_argument("--sliding-window", type=int, default=None, help="tokens; --arch mistral only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    return parser


def run_from_args(args: argparse.Namespace) -> Path:
    """Write the model the parsed flags describe; return its folder."""
    return write_tiny_model(
        args.out,
        arch=args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        vocab_size=args.vocab_size,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        sliding_window=args.sliding_window,
        seed=args.seed,
        dtype=args.dtype,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: write a tiny random model and print its folder. Returns the exit status."""
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="prefixserve make-tiny-model",
            description="Write a tiny random-weight causal LM with a trained byte-level BPE tokenizer.",
        )
    )
    args = parser.parse_args(argv)
    try:
        out_path = run_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    print(out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
