"""Reading and checking corpora, cleaning, the id cache, token-budget batching and collation."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtrain.corpus import (
    clean_pairs,
    parse_corpora,
    read_hf_dataset,
    read_lines,
    read_split,
)
from mtrain.data import (
    Ragged,
    Split,
    TokenizedData,
    collate,
    make_batches,
    target_tokens,
    to_ragged_arrays,
)
from mtrain.errors import MtrainError

PAIRS = (["Ein Hund.", "Zwei Katzen\tschlafen.", "Ja"], ["A dog.", "Two cats sleep.", "Yes"])


# --- reading -----------------------------------------------------------------------------------
def test_read_lines_strips_bom_and_crlf_and_keeps_odd_separators(tmp_path):
    path = tmp_path / "x.de"
    path.write_bytes("\ufeffa b\r\nc\u2028d\x85e\tf\r\n\r\nlast".encode("utf-8"))
    # U+2028 and U+0085 stay inside their line (str.splitlines would split there); no final newline is fine.
    assert read_lines(path) == ["a b", "c\u2028d\x85e\tf", "", "last"]


def test_read_lines_gz(tmp_path):
    path = tmp_path / "train.de.gz"
    path.write_bytes(gzip.compress("eins\nzwei\n".encode("utf-8")))
    assert read_lines(path) == ["eins", "zwei"]


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "train.de"
    path.write_bytes(b"ok\nok\nbad \xff byte\nok\n")
    with pytest.raises(MtrainError) as err:
        read_lines(path)
    assert str(err.value).startswith(f"{path}:3: invalid UTF-8") and "iconv" in str(err.value)


def _write_pair(folder, split, src_lines, tgt_lines):
    (folder / f"{split}.de").write_text("".join(f"{x}\n" for x in src_lines), encoding="utf-8")
    (folder / f"{split}.en").write_text("".join(f"{x}\n" for x in tgt_lines), encoding="utf-8")


def test_line_count_mismatch_shows_both_counts(tmp_path):
    _write_pair(tmp_path, "train", ["a", "b", "c"], ["x", "y"])
    with pytest.raises(MtrainError) as err:
        read_split(tmp_path, "train", "de", "en")
    message = str(err.value)
    assert f"{tmp_path / 'train.en'}:3: 2 lines" in message and f"{tmp_path / 'train.de'} has 3" in message


def test_missing_files(tmp_path):
    with pytest.raises(MtrainError, match=r"train\.de: file not found; put train\.de \+ train\.en"):
        read_split(tmp_path, "train", "de", "en")
    (tmp_path / "train.de").write_text("a\n", encoding="utf-8")
    with pytest.raises(MtrainError, match=r"train\.en: file not found \(but .*train\.de exists\)"):
        read_split(tmp_path, "train", "de", "en")


def test_text_tsv_and_jsonl_give_the_same_pairs(tmp_path):
    text, tsv, jsonl = (tmp_path / name for name in ("text", "tsv", "jsonl"))
    for folder in (text, tsv, jsonl):
        folder.mkdir()
    src, tgt = PAIRS[0][:1] + PAIRS[0][2:], PAIRS[1][:1] + PAIRS[1][2:]  # the TAB line only fits plain text
    _write_pair(text, "valid", src, tgt)
    (tsv / "valid.tsv").write_text("de\ten\n" + "".join(f"{s}\t{t}\n" for s, t in zip(src, tgt)), encoding="utf-8")
    rows = [{"de": src[0], "en": tgt[0]}, {"translation": {"en": tgt[1], "de": src[1], "fr": "Oui"}}]
    (jsonl / "valid.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    expected = (src, tgt)
    assert read_split(text, "valid", "de", "en") == expected
    assert read_split(tsv, "valid", "de", "en") == expected  # header row "de<TAB>en" skipped
    assert read_split(jsonl, "valid", "de", "en") == expected


def test_plain_text_keeps_a_tab_inside_a_line(tmp_path):
    _write_pair(tmp_path, "train", *PAIRS)
    assert read_split(tmp_path, "train", "de", "en") == PAIRS


def test_tsv_and_jsonl_errors_name_the_line(tmp_path):
    (tmp_path / "train.tsv").write_text("a\tx\nb\ty\tz\n", encoding="utf-8")
    with pytest.raises(MtrainError, match=r"train\.tsv:2: expected 2 TAB-separated columns .* found 3"):
        read_split(tmp_path, "train", "de", "en")
    (tmp_path / "valid.jsonl").write_text('{"de": "a", "en": "x"}\n{"de": "b"}\n', encoding="utf-8")
    with pytest.raises(MtrainError, match=r"valid\.jsonl:2: expected an object with string fields 'de' and 'en'"):
        read_split(tmp_path, "valid", "de", "en")
    (tmp_path / "test.jsonl").write_text('{"de": "a", "en": "x"\n', encoding="utf-8")
    with pytest.raises(MtrainError, match=r"test\.jsonl:1: invalid JSON"):
        read_split(tmp_path, "test", "de", "en")


def test_no_data_anywhere_says_both_ways(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MtrainError) as err:
        parse_corpora(None)
    message = str(err.value)
    assert "data/multi30k" in message and "--hf-dataset bentrevett/multi30k" in message and "\n" not in message


def test_data_and_hf_dataset_are_exclusive(tmp_path):
    with pytest.raises(MtrainError, match="pass only one of them"):
        parse_corpora([str(tmp_path)], hf_dataset="bentrevett/multi30k")


def test_corpora_are_named_after_their_folder_or_as_given(tmp_path):
    for name in ("europarl", "bt"):
        (tmp_path / name).mkdir()
    corpora = parse_corpora([str(tmp_path / "europarl"), f"back={tmp_path / 'bt'}"])
    assert [(c.name, c.folder) for c in corpora] == [("europarl", tmp_path / "europarl"), ("back", tmp_path / "bt")]
    assert parse_corpora(None, hf_dataset="bentrevett/multi30k")[0].name == "multi30k"


def test_two_corpora_with_one_name_are_refused(tmp_path):
    (tmp_path / "a" / "news").mkdir(parents=True)
    (tmp_path / "b" / "news").mkdir(parents=True)
    with pytest.raises(MtrainError, match=r"two corpora named 'news' .*--data NAME="):
        parse_corpora([str(tmp_path / "a" / "news"), str(tmp_path / "b" / "news")])
    with pytest.raises(MtrainError, match="two corpora named 'x'"):
        parse_corpora([f"x={tmp_path / 'a'}", f"x={tmp_path / 'b'}"])


def test_hf_dataset_failure_is_one_line(monkeypatch):
    import datasets

    def offline(name, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)\nmore details")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(MtrainError) as err:
        read_hf_dataset("bentrevett/multi30k", ["train"], "de", "en")
    assert "\n" not in str(err.value) and "Couldn't reach" in str(err.value) and "--data" in str(err.value)


def test_hf_dataset_split_names_and_row_shapes(monkeypatch):
    import datasets

    fake = {
        "train": [{"de": "Ein Hund.", "en": "A dog."}],
        "validation": [{"translation": {"de": "Ja", "en": "Yes"}}],
        "test": [{"de": "Nein", "en": "No"}],
    }
    monkeypatch.setattr(datasets, "load_dataset", lambda name, streaming=False: fake)
    got = read_hf_dataset("bentrevett/multi30k", ["train", "valid", "test2016"], "de", "en")
    assert got == {"train": (["Ein Hund."], ["A dog."]), "valid": (["Ja"], ["Yes"]), "test2016": (["Nein"], ["No"])}
    with pytest.raises(MtrainError, match="no split 'dev2' .*train, validation, test"):
        read_hf_dataset("bentrevett/multi30k", ["dev2"], "de", "en")
    with pytest.raises(MtrainError, match=r"\[train\] row 1: no string fields 'de' and 'fr'"):
        read_hf_dataset("bentrevett/multi30k", ["train"], "de", "fr")


# --- cleaning ----------------------------------------------------------------------------------
# A hand-made corpus; with max_len=5 and max_ratio=2 each pair is dropped by the FIRST rule it breaks.
HAND_MADE = [
    ("a b", "x y", "kept"),
    ("", "x", "empty_side"),
    ("a", "   ", "empty_side"),  # whitespace only is empty
    ("a b c d e f", "x y z u v w", "too_long"),  # 6 tokens > 5
    ("a", "x y z", "length_ratio"),  # 3 / 1 > 2
    ("a b", "x y z u", "kept"),  # 4 / 2 == 2 is not above the limit
    ("a b", "x y", "duplicate"),  # of the first pair
    ("a b", "x y ", "duplicate"),  # differs by a trailing space only: the same after normalization
    ("a\u00a0b", "x \uff59", "duplicate"),  # a no-break space, a full-width y: NFKC makes them the first pair
    ("", "", "empty_side"),  # counted once, not twice
    ("a b c d e f", "x", "too_long"),  # breaks too_long and length_ratio; too_long comes first
    ("a", "x y z", "length_ratio"),  # repeats a dropped pair: still a ratio drop, not a duplicate
    ("a b", "x y z u", "duplicate"),  # of the sixth pair
    ("a b", "X y", "kept"),  # case is kept apart
]


def test_cleaning_counts_on_hand_made_corpus():
    src = [s for s, _, _ in HAND_MADE]
    tgt = [t for _, t, _ in HAND_MADE]
    kept_src, kept_tgt, dropped = clean_pairs(src, tgt, max_len=5, max_ratio=2.0)
    assert dropped == {"empty_side": 3, "too_long": 2, "length_ratio": 2, "overlap": 0, "duplicate": 4}
    assert list(zip(kept_src, kept_tgt)) == [(s, t) for s, t, why in HAND_MADE if why == "kept"]
    _, _, no_dedup = clean_pairs(src, tgt, max_len=5, max_ratio=2.0, dedup=False)
    assert no_dedup == {"empty_side": 3, "too_long": 2, "length_ratio": 2, "overlap": 0, "duplicate": 0}


def test_a_side_without_spaces_is_too_long_by_its_characters():
    """One whitespace token of 5 * 64 + 1 characters breaks max_len=5; 5 * 64 does not."""
    src, tgt = ["x" * 321, "y" * 320, "ein Hund"], ["a dog", "a cat", "z" * 321]
    kept_src, _, dropped = clean_pairs(src, tgt, max_len=5, max_ratio=400.0)
    assert kept_src == ["y" * 320] and dropped["too_long"] == 2


# --- the cache ---------------------------------------------------------------------------------
def test_ragged_arrays_round_trip():
    seqs = [[5, 6, 7], [], [8]]
    ids, offsets = to_ragged_arrays(seqs)
    assert ids.dtype == np.int32 and offsets.dtype == np.int64
    assert offsets.tolist() == [0, 3, 3, 4]
    ragged = Ragged(ids, offsets)
    assert len(ragged) == 3 and ragged.lengths.tolist() == [3, 0, 1]
    assert [ragged[i].tolist() for i in range(3)] == seqs


def test_tokenized_slice_loads_and_matches_its_inputs(tokenized_slice, multi30k_slice):
    meta = json.loads((tokenized_slice / "meta.json").read_text(encoding="utf-8"))
    assert meta["joint"] and meta["src_vocab_size"] == meta["tgt_vocab_size"] == 1000
    assert meta["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert meta["splits"] == ["train", "valid", "test2016"] and (meta["src"], meta["tgt"]) == ("de", "en")
    for name, n in (("train", 2000), ("valid", 100), ("test2016", 100)):
        split = TokenizedData(tokenized_slice).split(name)
        assert len(split) == n and isinstance(split.src.ids, np.memmap)
        assert split.src.ids.dtype == np.int32 and split.tgt.offsets.dtype == np.int64
        assert split.src_text() == read_lines(multi30k_slice / f"{name}.de")  # raw text, line for line
        assert split.tgt_text() == read_lines(multi30k_slice / f"{name}.en")
        assert int(split.src.ids.min()) > 3 and int(split.tgt.ids.max()) < 1000  # no specials, in vocab


def test_stats_agree_with_the_cached_ids(tokenized_slice):
    stats = TokenizedData(tokenized_slice).stats
    # Multi30k train's only drops are lines 14215, 16867, 20149 (the 3 duplicates SOURCE.md mentions)
    # and 16510, 16664 (source "@@", ratio 8), so its first 2000 pairs lose nothing.
    assert stats["cleaning"]["input_pairs"] == stats["cleaning"]["kept_pairs"] == 2000
    assert set(stats["cleaning"]["dropped"].values()) == {0}
    for name in ("train", "valid", "test2016"):
        split, entry = TokenizedData(tokenized_slice).split(name), stats["splits"][name]
        assert entry["lines"] == len(split)
        assert entry["src_tokens"]["total"] == int(split.src.lengths.sum())
        assert entry["tgt_tokens"]["max"] == int(split.tgt.lengths.max())
        assert entry["src_tokens"]["mean"] == pytest.approx(split.src.lengths.mean(), abs=1e-4)
        assert entry["tgt_tokens"]["std"] == pytest.approx(split.tgt.lengths.std(), abs=1e-4)
        ratio = split.tgt.lengths / split.src.lengths
        assert entry["tgt_src_ratio"]["mean"] == pytest.approx(ratio.mean(), abs=1e-4)
    assert stats["tgt_src_ratio"] == stats["splits"]["train"]["tgt_src_ratio"]


def test_load_errors(tokenized_slice, tmp_path):
    with pytest.raises(MtrainError, match="no tokenized split 'test2017'"):
        TokenizedData(tokenized_slice).split("test2017")
    with pytest.raises(MtrainError, match=r"meta\.json: not found; .* run `mtrain tokenize"):
        TokenizedData(tmp_path).split("train")


# --- batching ----------------------------------------------------------------------------------
def _check_batches(batches, src_lengths, tgt_lengths, max_tokens):
    every = np.concatenate(batches)
    assert sorted(every.tolist()) == list(range(len(src_lengths)))  # each index exactly once
    for batch in batches:
        width = max(src_lengths[batch].max() + 1, tgt_lengths[batch].max() + 1)
        assert len(batch) * width <= max_tokens


lengths_st = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=1, max_size=300)


@settings(max_examples=150, deadline=None)
@given(pairs=lengths_st, max_tokens=st.integers(61, 700), seed=st.integers(0, 5), shuffle=st.booleans())
def test_batches_respect_budget_and_cover_every_index(pairs, max_tokens, seed, shuffle):
    src_lengths, tgt_lengths = (np.array(x) for x in zip(*pairs))
    batches = make_batches(src_lengths, tgt_lengths, max_tokens, seed=seed, epoch=1, shuffle=shuffle)
    _check_batches(batches, src_lengths, tgt_lengths, max_tokens)


def test_batches_deterministic_in_seed_and_epoch():
    rng = np.random.default_rng(0)
    src_lengths, tgt_lengths = rng.integers(1, 50, 2000), rng.integers(1, 50, 2000)
    run = lambda seed, epoch: [b.tolist() for b in make_batches(src_lengths, tgt_lengths, 500, seed, epoch)]
    assert run(1, 3) == run(1, 3)
    assert run(1, 3) != run(1, 4) and run(1, 3) != run(2, 3)
    # Same sentences, same number of batches: shuffling changes the order, not the packing quality.
    assert sorted(map(len, run(1, 3))) == sorted(map(len, run(1, 4)))


def test_unshuffled_batches_are_sorted_by_length():
    src_lengths, tgt_lengths = np.array([9, 1, 5, 3, 7]), np.array([0, 2, 5, 8, 1])
    batches = make_batches(src_lengths, tgt_lengths, 20, seed=0, epoch=0, shuffle=False)
    # costs max(s, t) + 1 = [10, 3, 6, 9, 8]; ascending: 1 (3), 2 (6), 4 (8), 3 (9), 0 (10);
    # greedy under 20 tokens: [1, 2] costs 2*6=12, adding 4 would cost 3*8=24; [4, 3] = 18; [0] = 10.
    assert [b.tolist() for b in batches] == [[1, 2], [4, 3], [0]]


def test_oversized_sentence():
    src_lengths, tgt_lengths = np.array([3, 30, 4]), np.array([3, 2, 4])
    with pytest.raises(MtrainError, match=r"sentence 1 has 31 tokens with EOS, more than max_tokens=20"):
        make_batches(src_lengths, tgt_lengths, 20, seed=0, epoch=0)
    batches = make_batches(src_lengths, tgt_lengths, 20, seed=0, epoch=0, shuffle=False, allow_oversize=True)
    assert [b.tolist() for b in batches] == [[0, 2], [1]]


# --- collation ---------------------------------------------------------------------------------
def _toy_split(tmp_path) -> Split:
    src = Ragged(*to_ragged_arrays([[5, 6, 7], [8], []]))
    tgt = Ragged(*to_ragged_arrays([[9, 10], [11, 12, 13, 14], [15]]))
    return Split("toy", src, tgt, tmp_path)


def test_collate_places_bos_eos_and_pad(tmp_path):
    src, tgt_in, tgt_out = collate(_toy_split(tmp_path), [0, 1, 2])
    assert all(t.dtype == torch.long for t in (src, tgt_in, tgt_out))
    assert src.tolist() == [[5, 6, 7, 3], [8, 3, 0, 0], [3, 0, 0, 0]]
    assert tgt_in.tolist() == [[2, 9, 10, 0, 0], [2, 11, 12, 13, 14], [2, 15, 0, 0, 0]]
    assert tgt_out.tolist() == [[9, 10, 3, 0, 0], [11, 12, 13, 14, 3], [15, 3, 0, 0, 0]]


def test_collate_cuts_each_side_to_max_len_ending_in_eos(tmp_path):
    """max_len=3: src [5, 6, 7] + EOS and tgt [11 .. 14] + EOS are cut to 3 positions, ending in EOS;
    the shorter rows are as without a cut. target_tokens counts what is left (3 + 3 + 2)."""
    src, tgt_in, tgt_out = collate(_toy_split(tmp_path), [0, 1, 2], max_len=3)
    assert src.tolist() == [[5, 6, 3], [8, 3, 0], [3, 0, 0]]
    assert tgt_in.tolist() == [[2, 9, 10], [2, 11, 12], [2, 15, 0]]
    assert tgt_out.tolist() == [[9, 10, 3], [11, 12, 3], [15, 3, 0]]
    lengths = _toy_split(tmp_path).tgt.lengths
    assert target_tokens(lengths, [np.arange(3)], max_len=3) == int((tgt_out != 0).sum()) == 8
    assert target_tokens(lengths, [np.arange(3)]) == 10


def test_collate_follows_index_order(tmp_path):
    src, tgt_in, tgt_out = collate(_toy_split(tmp_path), np.array([2, 0]))
    assert src.tolist() == [[3, 0, 0, 0], [5, 6, 7, 3]]
    assert tgt_out.tolist() == [[15, 3, 0], [9, 10, 3]]
    assert tgt_in.shape == tgt_out.shape == (2, 3)


def test_collate_real_batches(tokenized_slice):
    split = TokenizedData(tokenized_slice).split("train")
    batches = make_batches(split.src.lengths, split.tgt.lengths, 1024, seed=1, epoch=0)
    _check_batches(batches, split.src.lengths, split.tgt.lengths, 1024)
    for batch in batches[:5]:
        src, tgt_in, tgt_out = collate(split, batch)
        assert src.shape[1] == split.src.lengths[batch].max() + 1
        for row, index in enumerate(batch):
            ids = split.src[index].tolist()
            assert src[row, : len(ids) + 1].tolist() == ids + [3] and not src[row, len(ids) + 1 :].any()
            tgt, pad = split.tgt[index].tolist(), [0] * (tgt_in.shape[1] - len(split.tgt[index]) - 1)
            assert tgt_in[row].tolist() == [2] + tgt + pad and tgt_out[row].tolist() == tgt + [3] + pad



# ---------------------------------------------------------------- subword sampling

def test_subword_sampler_is_a_function_of_seed_and_epoch(tokenized_slice):
    """Epoch e's sampled ids are the same whenever they are drawn (what exact resume needs),
    differ between epochs, and are another segmentation of the very same text."""
    from mtrain.data import SubwordSampler

    split, tok = TokenizedData(tokenized_slice).split("train"), TokenizedData(tokenized_slice).tokenizer
    a = SubwordSampler(split, tok, alpha=0.2, seed=1, max_tokens=4096)
    b = SubwordSampler(split, tok, alpha=0.2, seed=1, max_tokens=4096)
    e1, e2 = a(1), a(2)
    assert np.array_equal(b(2).src.ids, e2.src.ids) and np.array_equal(a(1).tgt.ids, e1.tgt.ids)
    n = len(split)
    changed = [sum(not np.array_equal(s[i], split_side[i]) for i in range(n))
               for s, split_side in ((e1.src, split.src), (e1.tgt, split.tgt))]
    assert min(changed) > n // 4  # alpha 0.2 re-segments many lines
    assert sum(not np.array_equal(e1.src[i], e2.src[i]) for i in range(n)) > n // 4
    for sampled in (e1, e2):
        assert tok.src.decode([sampled.src[i] for i in range(n)]) == tok.src.decode([split.src[i] for i in range(n)])
        assert tok.tgt.decode([sampled.tgt[i] for i in range(n)]) == tok.tgt.decode([split.tgt[i] for i in range(n)])


def test_subword_sampler_keeps_cached_ids_for_lines_too_long_to_batch(tokenized_slice):
    """With max_tokens at the cached corpus's longest line, every sampled line that came out longer
    falls back to its cached ids, and the epoch still batches."""
    from mtrain.data import SubwordSampler

    split, tok = TokenizedData(tokenized_slice).split("train"), TokenizedData(tokenized_slice).tokenizer
    cost = np.maximum(split.src.lengths, split.tgt.lengths) + 1
    max_tokens = int(cost.max())
    free = SubwordSampler(split, tok, alpha=0.1, seed=3, max_tokens=10**6)(1)
    capped = SubwordSampler(split, tok, alpha=0.1, seed=3, max_tokens=max_tokens)(1)
    too_long = np.maximum(free.src.lengths, free.tgt.lengths) + 1 > max_tokens
    assert too_long.any()  # alpha 0.1 about doubles the pieces, so the test has something to check
    for i in range(len(split)):
        expected = (split.src[i], split.tgt[i]) if too_long[i] else (free.src[i], free.tgt[i])
        assert np.array_equal(capped.src[i], expected[0]) and np.array_equal(capped.tgt[i], expected[1])
    _check_batches(make_batches(capped.src.lengths, capped.tgt.lengths, max_tokens, seed=1, epoch=1),
                   capped.src.lengths, capped.tgt.lengths, max_tokens)


def test_subword_sampler_refuses_text_that_does_not_match_the_ids(tokenized_slice, tmp_path):
    import shutil

    from mtrain.data import SubwordSampler

    copy = tmp_path / "tok"
    shutil.copytree(tokenized_slice, copy)
    lines = (copy / "train.tgt.txt").read_text().splitlines(keepends=True)
    (copy / "train.tgt.txt").write_text("".join(lines[:-1]))
    with pytest.raises(MtrainError, match=r"train\.tgt\.txt: .* lines but .* cached sentences; re-run"):
        SubwordSampler(TokenizedData(copy).split("train"), TokenizedData(copy).tokenizer, alpha=0.2, seed=1, max_tokens=4096)
