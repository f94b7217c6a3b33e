"""The incremental detokenizer (replica/detokenizer.py) decodes a window of the output tokens each step: what it
streams, concatenated, is exactly the whole output decoded at once, for random token streams (byte tokens that split
UTF-8 characters, special tokens, SentencePiece-style leading spaces) on the tiny test tokenizer and on the bundled
SmolLM2 tokenizer (byte-level BPE); and stop strings cut the text as they did. No model runs."""

import random

import pytest
from transformers import AutoTokenizer

from replica.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request, tiny_llama_dir):
    if request.param == "tiny":
        return AutoTokenizer.from_pretrained(tiny_llama_dir)
    from replica.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def stream(tokenizer, ids, stop=()):
    detokenizer = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    for end in range(1, len(ids) + 1):
        result = detokenizer.update(ids[:end], finished=end == len(ids))
        pieces.append(result.new_text)
        if result.stopped:
            break
    return "".join(pieces), result.stopped, pieces


def test_streamed_text_is_the_whole_output_decoded_at_once(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    specials = sorted(tokenizer.all_special_ids)
    for trial in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        if trial % 3 == 0 and specials:  # special tokens (skipped) in the middle and at the start
            ids.insert(0, specials[0])
            ids.insert(len(ids) // 2, specials[-1])
        streamed, stopped, pieces = stream(tokenizer, ids)
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True), ids
        assert not stopped
        assert all("\ufffd" not in piece for piece in pieces[:-1]) or "\ufffd" in tokenizer.decode(
            ids, skip_special_tokens=True)


def test_stop_strings_cut_the_text_before_them(tokenizer):
    rng = random.Random(1)
    vocab = len(tokenizer)
    num_checked = 0
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(40)]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        if len(whole) < 20:
            continue
        stop = whole[12:15]
        streamed, stopped, _ = stream(tokenizer, ids, stop=(stop,))
        assert stopped and streamed == whole[: whole.index(stop)]
        num_checked += 1
    assert num_checked >= 50
