"""The tokenizer layer: one interface over the byte, HF tokenizers and tiktoken backends."""

from __future__ import annotations

import base64
import json

import pytest

from hyserve.tokenizer import (
    BYTE_VOCAB_SIZE,
    HFTokenizer,
    IncrementalDetokenizer,
    TiktokenTokenizer,
    load_tokenizer,
)

MARKER_TEXT = '<|open|>message role="system"<|sep|>'


@pytest.fixture
def k3():
    return load_tokenizer(None, "k3")


@pytest.fixture
def k2():
    return load_tokenizer("kimi-linear-48b-a3b", "k2")


# --- byte tokenizer ------------------------------------------------------------------------------------

def test_byte_tokenizer_round_trips_unicode_text(k3):
    text = "héllo, 世界 🌍\n"
    ids = k3.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert k3.decode(ids) == text


def test_byte_tokenizer_vocab_fits_the_preset_vocab_size(k3, k2):
    assert k3.vocab_size == k2.vocab_size == BYTE_VOCAB_SIZE == 512
    assert max(k3.special_token_ids) < 512 and max(k2.special_token_ids) < 512


def test_ids_past_the_tokenizer_decode_as_no_text(k3):
    # the 48B presets have 163,840 logits over the 512-id byte tokenizer: random weights sample them
    assert k3.decode([104, 59496, 105]) == "hi"
    assert k3.convert_ids_to_tokens([59496]) == [""]


def test_byte_tokenizer_specials_start_after_the_bytes(k3):
    assert min(k3.special_token_ids) == 256
    assert k3.bos_token_id == k3.token_to_id("[BOS]")
    assert k3.eos_token_id == k3.token_to_id("[EOS]")


def test_k3_family_holds_the_xtml_markers(k3):
    for token in ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "[EOT]", "<|media_pad|>"):
        assert k3.token_to_id(token) in k3.special_token_ids


def test_k2_family_holds_the_chatml_markers(k2):
    for token in ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                  "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<think>", "</think>"):
        assert k2.token_to_id(token) in k2.special_token_ids
    assert k2.token_to_id("<|open|>") is None


def test_marker_text_is_plain_bytes_without_allow_special(k3):
    ids = k3.encode(MARKER_TEXT)
    assert not set(ids) & k3.special_token_ids
    assert k3.decode(ids) == MARKER_TEXT


def test_marker_text_becomes_special_ids_with_allow_special(k3):
    ids = k3.encode(MARKER_TEXT, allow_special=True)
    assert ids[0] == k3.token_to_id("<|open|>")
    assert ids[-1] == k3.token_to_id("<|sep|>")


def test_decode_skips_special_tokens_unless_asked(k3):
    ids = k3.encode("<|open|>hi<|sep|>", allow_special=True)
    assert k3.decode(ids) == "hi"
    assert k3.decode(ids, skip_special_tokens=False) == "<|open|>hi<|sep|>"


def test_every_byte_tokenizer_id_decodes(k3):
    # A random-weight model samples any id below the vocab size.
    assert isinstance(k3.decode(range(512), skip_special_tokens=False), str)


def test_convert_ids_to_tokens_names_specials(k3):
    assert k3.convert_ids_to_tokens([k3.token_to_id("<|sep|>"), ord("a")]) == ["<|sep|>", "a"]


def test_unknown_family_is_rejected():
    with pytest.raises(ValueError):
        load_tokenizer(None, "k9")


# --- incremental detokenizer ---------------------------------------------------------------------------

def test_incremental_detokenizer_holds_back_a_split_character(k3):
    detok = IncrementalDetokenizer(k3)
    euro = "€".encode()  # three bytes, fed one token at a time
    assert detok.step(euro[0]) == ""
    assert detok.step(euro[1]) == ""
    assert detok.step(euro[2]) == "€"


def test_incremental_deltas_join_to_the_full_decode(k3):
    ids = k3.encode("a€b🌍<|sep|>c", allow_special=True) + [0xE2, 0x82]  # ends mid-character
    for skip in (True, False):
        detok = IncrementalDetokenizer(k3, skip_special_tokens=skip)
        text = "".join(detok.step(i) for i in ids) + detok.finish()
        assert text == k3.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_skips_special_tokens(k3):
    detok = IncrementalDetokenizer(k3)
    assert detok.step(k3.token_to_id("<|end_of_msg|>")) == ""


def test_incremental_detokenizer_emits_invalid_bytes_as_replacement(k3):
    detok = IncrementalDetokenizer(k3)
    assert detok.step([0xFF, ord("a")]) == "\ufffda"


# --- HF tokenizers backend -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("hf_tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["hello world, the weather in Paris is cloudy"] * 50 + ["héllo wörld 世界"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_hf_backend_loads_from_a_model_dir(hf_dir):
    tok = load_tokenizer(hf_dir, "k3")
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_token_id == tok.token_to_id("[BOS]")
    assert tok.eos_token_id == tok.token_to_id("[EOS]")
    assert tok.token_to_id("<|open|>") in tok.special_token_ids


def test_hf_backend_round_trips_text(hf_dir):
    tok = load_tokenizer(hf_dir, "k3")
    text = "hello world, héllo 世界 🌍"
    assert tok.decode(tok.encode(text)) == text


def test_hf_backend_never_matches_markers_in_plain_text(hf_dir):
    tok = load_tokenizer(hf_dir, "k3")
    assert not set(tok.encode(MARKER_TEXT)) & tok.special_token_ids
    assert tok.decode(tok.encode(MARKER_TEXT)) == MARKER_TEXT


def test_hf_backend_matches_markers_with_allow_special(hf_dir):
    tok = load_tokenizer(hf_dir, "k3")
    assert tok.encode("<|open|>", allow_special=True) == [tok.token_to_id("<|open|>")]


def test_hf_backend_incremental_decode_matches_full_decode(hf_dir):
    tok = load_tokenizer(hf_dir, "k3")
    ids = tok.encode("wörld 世界🌍 hello") + tok.encode("<|sep|>", allow_special=True)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(detok.step(i) for i in ids) + detok.finish() == tok.decode(ids, skip_special_tokens=False)


# --- tiktoken backend ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiktoken_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiktoken_tok")
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w", b" wo"]
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for rank, tok in enumerate(ranks)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    names = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
    decoder = {str(base + i): {"content": n, "special": True} for i, n in enumerate(names)}
    config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_tiktoken_backend_reserves_256_specials(tiktoken_dir):
    tok = load_tokenizer(tiktoken_dir, "k3")
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == 262 + 256
    assert tok.token_to_id("<|open|>") == 262 + 3
    assert tok.bos_token_id == 262 and tok.eos_token_id == 263


def test_tiktoken_backend_applies_merges_and_round_trips(tiktoken_dir):
    tok = load_tokenizer(tiktoken_dir, "k3")
    assert tok.encode("hello") == [tok.token_to_id("hello")]
    assert tok.decode(tok.encode("hello world 世界")) == "hello world 世界"


def test_tiktoken_backend_never_matches_markers_in_plain_text(tiktoken_dir):
    tok = load_tokenizer(tiktoken_dir, "k3")
    ids = tok.encode(MARKER_TEXT)
    assert not set(ids) & tok.special_token_ids
    assert tok.encode("<|sep|>", allow_special=True) == [tok.token_to_id("<|sep|>")]
