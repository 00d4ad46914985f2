"""Property tests (hypothesis) for what must hold for ANY input, not just the examples in the
module tests: translation keeps one output line per input line, batching keeps every sentence
exactly once within its budget (also across epochs and a resume), and the tokenizer round-trips
any Unicode text up to its normalization.

Already covered elsewhere and not repeated here: data.make_batches' budget and coverage for
random lengths (tests/test_data.py::test_batches_respect_budget_and_cover_every_index) and the
target-side round trip of st.text() (tests/test_tokenizer.py::test_round_trip_any_text).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtrain.config import DecodeConfig
from mtrain.translate import LINE_BREAKS, translate_lines

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------- strategies

NON_LATIN = st.sampled_from([
    "漢字かなカナ한국어", "שלום עולם", "مرحبا بالعالم", "Привет, мир", "Γειά σου", "नमस्ते दुनिया",
    "😀👩‍👩‍👧🏳️‍🌈", "ไทย", "e\u0301\u0308\u20dd",  # combining marks
])
WHITESPACE = st.text(alphabet=" \t\u00a0\u2000\u3000\u200b\x0b\x0c\x1c\x85\u2028\u2029\r", min_size=1, max_size=6)
WORDS = st.sampled_from("Ein Mann Hund läuft über die Straße und eine Frau lacht .".split())


@st.composite
def long_lines(draw) -> str:
    return " ".join(draw(st.lists(WORDS, min_size=40, max_size=120)))


# A line of any kind, never with "\n" (the line separator of files and of the caller's list).
LINE = st.one_of(
    st.just(""),
    WHITESPACE,
    long_lines(),
    NON_LATIN,
    st.lists(WORDS, min_size=1, max_size=6).map(" ".join),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), max_size=30),
)


# ---------------------------------------------------------------- a tiny random model

@pytest.fixture(scope="module")
def tokenizer(tokenized_slice):
    from mtrain.data import TokenizedData

    return TokenizedData(tokenized_slice).tokenizer


@pytest.fixture(scope="module")
def model(tokenizer):
    from mtrain.config import ModelConfig
    from mtrain.model import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      vocab_size=tokenizer.tgt.vocab_size, max_len=24)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def checkpoint(model, tokenizer, tmp_path_factory):
    from mtrain.checkpoint import make, save_atomic
    from mtrain.config import Config, to_dict

    path = tmp_path_factory.mktemp("props") / "best.pt"
    save_atomic(make(to_dict(Config(model=model.cfg)), model.state_dict(), tokenizer.to_state(), {}, 0), path)
    return path


# ---------------------------------------------------------------- translate: one line per line

@FAST
@given(lines=st.lists(LINE, max_size=12), beam=st.sampled_from([1, 2]), max_tokens=st.sampled_from([8, 64, 4096]))
def test_translate_lines_keeps_one_line_per_input_line(model, tokenizer, lines, beam, max_tokens):
    decode = DecodeConfig(beam=beam, max_len_a=0.0, max_len_b=3, max_tokens=max_tokens)
    out = translate_lines(model, tokenizer, lines, decode, "cpu")
    assert len(out) == len(lines)
    for line, translation in zip(lines, out):
        assert isinstance(translation, str) and not LINE_BREAKS.search(translation)
        if not line.strip():
            assert translation == ""  # blank in, blank out, without running the model


@FAST
@given(lines=st.lists(LINE, max_size=10), final_newline=st.booleans(), crlf=st.booleans())
def test_translate_file_writes_one_line_per_input_line(checkpoint, tmp_path_factory, lines, final_newline, crlf):
    """Through the file path: bytes split on \\n only (a \\r, U+2028 or U+0085 inside a line stays
    inside it), an optional last newline, CRLF endings; the output has exactly as many lines."""
    from mtrain.translate import translate_file

    folder = tmp_path_factory.mktemp("tf")
    end = "\r\n" if crlf else "\n"
    text = end.join(lines) + (end if final_newline and lines else "")
    (folder / "in.txt").write_bytes(text.encode("utf-8"))
    decode = DecodeConfig(beam=1, max_len_a=0.0, max_len_b=2)
    translate_file(checkpoint, str(folder / "in.txt"), str(folder / "out.txt"), decode, device="cpu")
    written = (folder / "out.txt").read_bytes().decode("utf-8")
    expected = len(text.split("\n")) - (1 if text.endswith("\n") else 0) if text else 0
    assert written.count("\n") == expected and (written == "" or written.endswith("\n"))
    assert "\r" not in written


# ---------------------------------------------------------------- batching

@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 80), max_size=200), max_tokens=st.integers(1, 300))
def test_decode_batches_keep_the_budget_and_every_line_once(lengths, max_tokens):
    """translate.decode_batches: a batch over budget only when it is one sentence too long alone."""
    from mtrain.translate import decode_batches

    batches = decode_batches(lengths, max_tokens)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * (max(lengths[i] for i in batch) + 1) <= max_tokens


@settings(max_examples=60, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 120), st.integers(0, 120)), min_size=1, max_size=150),
       max_tokens=st.integers(20, 400), seed=st.integers(0, 3))
def test_oversize_sentences_go_alone_and_the_rest_keep_the_budget(pairs, max_tokens, seed):
    """make_batches(allow_oversize=True), as validation uses it: nothing dropped or repeated."""
    from mtrain.data import make_batches

    src, tgt = (np.array(x) for x in zip(*pairs))
    cost = np.maximum(src, tgt) + 1
    batches = make_batches(src, tgt, max_tokens, seed=seed, epoch=1, allow_oversize=True)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(pairs)))
    for batch in batches:
        assert len(batch) * cost[batch].max() <= max_tokens or len(batch) == 1


class FakeSplit:
    def __init__(self, src_lengths, tgt_lengths):
        self.src = type("R", (), {"lengths": np.asarray(src_lengths)})()
        self.tgt = type("R", (), {"lengths": np.asarray(tgt_lengths)})()


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=80), max_tokens=st.integers(32, 200),
       takes=st.lists(st.integers(1, 5), min_size=1, max_size=30), cut=st.integers(0, 29))
def test_training_stream_covers_each_sentence_once_per_epoch_and_resumes_exactly(lengths, max_tokens, takes, cut):
    """The trainer's BatchStream: the batches of epoch e hold every sentence exactly once, and a
    stream rebuilt from a saved (epoch, index) continues with exactly the same batches."""
    from mtrain.data import BatchStream

    split = FakeSplit(lengths, lengths[::-1])
    stream = BatchStream(split, max_tokens, seed=1)
    taken, positions = [], []
    for n in takes:
        positions.append((stream.epoch, stream.index, len(taken)))
        taken += stream.take(n)
    epochs_done = stream.epoch - 1
    for epoch in range(1, epochs_done + 1):
        batches = stream.batches(epoch)
        assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    epoch, index, done = positions[cut % len(positions)]
    resumed = BatchStream(split, max_tokens, seed=1, epoch=epoch, index=index)
    rest = resumed.take(len(taken) - done)
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(rest, taken[done:]))


# ---------------------------------------------------------------- tokenizer round trip

ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=120)
SCRIPTS = st.lists(st.one_of(NON_LATIN, WHITESPACE, WORDS, ANY_TEXT), max_size=8).map("".join)


@settings(max_examples=80, deadline=None)
@given(lines=st.lists(SCRIPTS, max_size=6))
def test_tokenizer_round_trips_any_text_on_both_sides_in_batches(tokenizer, lines):
    """decode(encode(x)) == normalize(x) for mixed scripts, controls, emoji and long lines, on the
    source side too, and batch encoding equals line-by-line encoding (same count, same ids)."""
    for encode, decode, normalize in ((tokenizer.src.encode, tokenizer.src.decode, tokenizer.src.normalize),
                                      (tokenizer.tgt.encode, tokenizer.tgt.decode, tokenizer.tgt.normalize)):
        ids = encode(lines)
        assert len(ids) == len(lines)
        assert ids == [encode([line])[0] for line in lines]
        assert decode(ids) == normalize(lines)
        assert all(1 not in seq for seq in ids)  # byte fallback: no input ever needs <unk>
