"""The SentencePiece wrapper: round trips, fixed special ids, state through bytes, friendly errors."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtrain.config import TokenizerConfig
from mtrain.corpus import read_lines
from mtrain.data import TokenizedData
from mtrain.errors import MtrainError
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

ODD_UNICODE = [
    "Ein Mann\u00a0mit „Hut“ – ½ ﬁ café",  # NBSP, curly quotes, en-dash, NFKC-folded ½ and ligature
    "emoji 😀👩‍👩‍👧 and CJK 漢字 and Hebrew שלום",  # unseen in training: byte fallback
    "  leading, trailing   and\tinner   whitespace  ",
    "combining e\u0301 vs precomposed é, Greek Ωμέγα",
    "line separator\u2028and next line\u0085inside",
    "",
]


@pytest.fixture(scope="module")
def small_lines(multi30k_dir):
    de = read_lines(multi30k_dir / "train.de")[:300]
    en = read_lines(multi30k_dir / "train.en")[:300]
    return de, en


@pytest.fixture(scope="module")
def tok(tokenized_slice) -> Tokenizer:
    return TokenizedData(tokenized_slice).tokenizer


def test_special_ids_are_fixed(tok):
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tok.joint and tok.src.vocab_size == tok.tgt.vocab_size == 1000
    ids = tok.tgt.encode(["A dog runs."])[0]
    assert all(i > EOS_ID for i in ids)  # encoding adds no BOS/EOS and never needs UNK
    assert tok.tgt.decode([[BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]]) == tok.tgt.decode([ids])


def test_round_trip_real_multi30k_lines(tok, multi30k_slice):
    for side, encode, decode, normalize in (
        ("de", tok.src.encode, tok.src.decode, tok.src.normalize),
        ("en", tok.tgt.encode, tok.tgt.decode, tok.tgt.normalize),
    ):
        lines = read_lines(multi30k_slice / f"valid.{side}")  # not seen while training
        assert decode(encode(lines)) == normalize(lines)
        # Multi30k is plain text: normalization only collapses/strips spaces (NBSP -> space).
        assert normalize(lines) == [" ".join(line.replace("\u00a0", " ").split()) for line in lines]


def test_round_trip_odd_unicode(tok):
    decoded = tok.tgt.decode(tok.tgt.encode(ODD_UNICODE))
    assert decoded == tok.tgt.normalize(ODD_UNICODE)
    assert "😀👩‍👩‍👧" in decoded[1] and "שלום" in decoded[1]  # kept, not turned into ⁇
    assert decoded[2] == "leading, trailing and inner whitespace"
    assert "\u2028" not in decoded[4] and "\u0085" in decoded[4]  # U+2028 is whitespace to NFKC, U+0085 is not


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_round_trip_any_text(tok, text):
    assert tok.tgt.decode(tok.tgt.encode([text])) == tok.tgt.normalize([text])


def test_cached_ids_match_encoding_of_cached_text(tok, tokenized_slice):
    split = TokenizedData(tokenized_slice).split("valid")
    expected = tok.src.encode(split.src_text())
    assert [list(split.src[i]) for i in range(len(split))] == expected


def test_state_survives_torch_weights_only(tok):
    buffer = io.BytesIO()
    torch.save({"tokenizer": tok.to_state()}, buffer)
    buffer.seek(0)
    restored = Tokenizer.from_state(torch.load(buffer, weights_only=True)["tokenizer"])
    lines = ["Zwei Männer stehen am Herd.", "A man in an orange hat."]
    assert restored.joint and restored.src.encode(lines) == tok.src.encode(lines)
    assert restored.tgt.decode(restored.tgt.encode(lines)) == tok.tgt.decode(tok.tgt.encode(lines))


def test_separate_vocabularies(small_lines, tmp_path):
    de, en = small_lines
    cfg = TokenizerConfig(vocab_size=500, joint=False, model_type="bpe")
    tok = Tokenizer.train(de, en, cfg, tmp_path)
    assert not tok.joint and tok.src.vocab_size == tok.tgt.vocab_size == 500
    assert (tmp_path / "spm.src.model").is_file() and (tmp_path / "spm.tgt.model").is_file()
    assert not (tmp_path / "spm.model").exists()
    loaded = Tokenizer.load(tmp_path)
    assert not loaded.joint
    assert loaded.src.decode(loaded.src.encode(de[:20])) == loaded.src.normalize(de[:20])
    again = Tokenizer.from_state(tok.to_state())
    assert again.tgt.encode(en[:20]) == tok.tgt.encode(en[:20])
    state = tok.to_state()
    assert state["src_model"] != state["tgt_model"]  # one model per language, not a copy


def test_training_is_deterministic(small_lines):
    de, en = small_lines
    cfg = TokenizerConfig(vocab_size=500)
    a, b = Tokenizer.train(de, en, cfg), Tokenizer.train(de, en, cfg)
    assert a.to_state()["src_model"] == b.to_state()["src_model"]


def test_vocab_too_large_is_one_line_error(small_lines):
    de, en = small_lines
    with pytest.raises(MtrainError) as err:
        Tokenizer.train(de[:50], en[:50], TokenizerConfig(vocab_size=8000))
    message = str(err.value)
    assert "\n" not in message and "--vocab-size 8000 is too large" in message and "smaller --vocab-size" in message


def test_vocab_too_small_and_bad_model_type(small_lines):
    de, en = small_lines
    with pytest.raises(MtrainError, match="too small"):
        Tokenizer.train(de, en, TokenizerConfig(vocab_size=50))
    with pytest.raises(MtrainError, match="unigram, bpe"):
        Tokenizer.train(de, en, TokenizerConfig(model_type="wordpiece"))


def test_load_missing_model(tmp_path):
    with pytest.raises(MtrainError, match="spm.model: SentencePiece model not found"):
        Tokenizer.load(tmp_path, joint=True)
