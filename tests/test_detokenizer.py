"""The incremental detokenizer (replica/detokenizer.py) decodes a window of the output tokens each step: what it
streams, concatenated, is exactly the whole output decoded at once, for random token streams (byte tokens that split
UTF-8 characters, special tokens) on the tiny test tokenizer and the bundled SmolLM2 tokenizer (byte-level BPE), and on
a SentencePiece-style one built here (a word's leading space is a "▁" the decoder drops at the start of a decode:
decoding only the new tokens would lose it); stop strings cut the text as they did, and a stop string is found as soon
as its token arrives, even when the token ends with an incomplete character. No model runs."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from replica.detokenizer import IncrementalDetokenizer


def sentencepiece_style():
    """Llama-2 style: "▁" for spaces (dropped at the start of a decode), byte-fallback tokens; no lone ASCII bytes
    in the random streams below (see ``vocab_ids``)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ["▁", "▁a", "b", "▁hello", "world", ".", "▁.", "▁'", "s", "é", "▁日本", "語", "▁▁", "n't", "▁n"]:
        vocab[piece] = len(vocab)
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["tiny", "smollm2", "sentencepiece"])
def tokenizer(request, tiny_llama_dir):
    if request.param == "tiny":
        return AutoTokenizer.from_pretrained(tiny_llama_dir)
    if request.param == "sentencepiece":
        return sentencepiece_style()
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


def vocab_ids(tokenizer, with_bytes=True):
    """Token ids for random streams: all of them, but for byte-fallback vocabularies only the pieces and the
    multi-byte lead / continuation bytes (a random run of those can still be invalid UTF-8, which the decoder turns
    into U+FFFD as a whole run: compared below only where the text has none)."""
    if "<0x41>" not in tokenizer.get_vocab():
        return list(range(len(tokenizer)))
    return [index for token, index in tokenizer.get_vocab().items()
            if not (token.startswith("<0x") and (not with_bytes or int(token[3:5], 16) < 0x80))]


def test_streamed_text_is_the_whole_output_decoded_at_once(tokenizer):
    rng = random.Random(0)
    vocab = vocab_ids(tokenizer)
    specials = sorted(tokenizer.all_special_ids)
    for trial in range(60):
        ids = [rng.choice(vocab) for _ in range(rng.randrange(1, 80))]
        if trial % 3 == 0 and specials:  # special tokens (skipped) in the middle and at the start
            ids.insert(0, specials[0])
            ids.insert(len(ids) // 2, specials[-1])
        streamed, stopped, pieces = stream(tokenizer, ids)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        if "\ufffd" in whole and "<0x41>" in tokenizer.get_vocab():
            continue  # an invalid byte run: the byte-fallback decoder replaces it whole, in any window
        assert streamed == whole, ids
        assert not stopped
        assert all("\ufffd" not in piece for piece in pieces[:-1]) or "\ufffd" in tokenizer.decode(
            ids, skip_special_tokens=True)


def test_a_sentencepiece_word_keeps_its_leading_space_mid_stream():
    tokenizer = sentencepiece_style()
    ids = tokenizer.convert_tokens_to_ids(["▁a", "b", "▁hello", "world", "▁.", "▁日本", "語"])
    streamed, _, pieces = stream(tokenizer, ids)
    assert streamed == tokenizer.decode(ids) == "ab helloworld . 日本語"
    assert pieces[2] == " hello"


def test_a_stop_string_is_found_when_its_token_arrives_even_before_an_incomplete_character():
    tokenizer = sentencepiece_style()
    # "▁a", then the first two bytes of "€" (E2 82 AC): the text so far is "a" + an incomplete character
    ids = tokenizer.convert_tokens_to_ids(["▁hello", "▁a", "<0xE2>", "<0x82>", "<0xAC>", "▁n"])
    detokenizer = IncrementalDetokenizer(tokenizer, ("a",))
    results = [detokenizer.update(ids[:end], finished=False) for end in (1, 2)]
    assert [(r.new_text, r.stopped) for r in results] == [("hello", False), (" ", True)]
    streamed, stopped, _ = stream(tokenizer, ids[:4], stop=("a",))  # the stop's token ends incomplete: same step
    assert (streamed, stopped) == ("hello ", True)


def test_stop_strings_cut_the_text_before_them(tokenizer):
    rng = random.Random(1)
    vocab = vocab_ids(tokenizer, with_bytes=False)
    num_checked = 0
    for _ in range(200):
        ids = [rng.choice(vocab) for _ in range(40)]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        if len(whole) < 20 or ("\ufffd" in whole and "<0x41>" in tokenizer.get_vocab()):
            continue  # short, or an invalid byte run (see the test above)
        stop = whole[12:15]
        streamed, stopped, _ = stream(tokenizer, ids, stop=(stop,))
        assert stopped and streamed == whole[: whole.index(stop)]
        num_checked += 1
    assert num_checked >= 50
