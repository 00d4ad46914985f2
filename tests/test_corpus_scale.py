"""`mtrain tokenize` at corpus scale: streaming reads that match whole-file reads, the hash set,
the SentencePiece reservoir, byte-identical output to the whole-corpus pipeline, several corpora
with tags, the overlap with the evaluation splits, hub datasets streamed from a local folder, bad
lines deep in a file, Ctrl-C, and (slow) peak memory that stays flat as the corpus grows."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mtrain import corpus as corpus_mod
from mtrain.cli import app
from mtrain.config import load_config
from mtrain.corpus import HashSet, Cleaner, iter_line_blocks, iter_text_pair, normalize, read_lines, read_split
from mtrain.data import SIDES, TokenizedData, to_ragged_arrays
from mtrain.errors import MtrainError
from mtrain.prepare import Reservoir, tokenize_corpus
from mtrain.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def tokenize(*args: str):
    return runner.invoke(app, ["tokenize", *args])


def assert_one_line_error(result, *fragments: str, code: int = 1) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, last
    return last


def words_corpus(folder: Path, rng: random.Random, sizes: dict[str, int], prefix: str = "w") -> Path:
    """Random sentences over a small vocabulary, one marker word per line so no two lines (and no
    line of another split or corpus) are equal by chance."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = [f"{prefix}{i}" for i in range(40)]
    for split, n in sizes.items():
        src = [" ".join([f"{prefix}{split}{i}", *rng.choices(vocab, k=rng.randint(2, 7))]) for i in range(n)]
        tgt = [" ".join([f"{prefix}{split}{i}x", *rng.choices(vocab, k=rng.randint(2, 7))]) for i in range(n)]
        write_pair(folder, split, src, tgt)
    return folder


def write_pair(folder: Path, split: str, src: list[str], tgt: list[str]) -> None:
    (folder / f"{split}.de").write_text("".join(f"{x}\n" for x in src), encoding="utf-8")
    (folder / f"{split}.en").write_text("".join(f"{x}\n" for x in tgt), encoding="utf-8")


# ---------------------------------------------------------------- reading in blocks

def whole_file_lines(data: bytes) -> list[str]:
    """The whole-file reader's definition: decode, drop a leading BOM, split on "\\n" only, a final
    newline ends the last line, a CR before a line end is dropped."""
    text = data.decode("utf-8")
    text = text[1:] if text.startswith("\ufeff") else text
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


LINE_TEXT = st.text(alphabet=st.sampled_from(list("ab \t\r\u00e4\u2028\x85\ufeff\u4e2d")), max_size=12)


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(LINE_TEXT, max_size=20), final_newline=st.booleans(), bom=st.booleans(),
       block=st.integers(1, 40))
def test_blocks_give_the_lines_of_a_whole_file_read(tmp_path_factory, lines, final_newline, bom, block):
    data = ("\ufeff" if bom else "") + "\n".join(lines) + ("\n" if final_newline and lines else "")
    path = tmp_path_factory.mktemp("blocks") / "x.de"
    path.write_bytes(data.encode("utf-8"))
    got = [line for chunk in iter_line_blocks(path, block_bytes=block) for line in chunk]
    assert got == whole_file_lines(data.encode("utf-8")) == read_lines(path)


def test_invalid_utf8_deep_in_a_file_names_its_line(tmp_path):
    """Blocks of 64 bytes: the bad byte is many blocks in, and the line number still counts from the
    file's start (and in a .gz the same)."""
    lines = [f"Zeile {i}" for i in range(1, 5001)]
    data = "\n".join(lines).encode("utf-8").replace(b"Zeile 4001\n", b"Zeile \xe9 4001\n")
    for name, raw in (("train.de", data), ("train.de.gz", gzip.compress(data))):
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(MtrainError, match=rf"{name}:4001: invalid UTF-8 \(byte 0xe9\)"):
            for _ in iter_line_blocks(tmp_path / name, block_bytes=64):
                pass


def test_pairs_read_side_by_side_in_blocks(tmp_path):
    src, tgt = [f"s{i}" for i in range(1000)], [f"t{i} " * (i % 7) for i in range(1000)]
    write_pair(tmp_path, "train", src, tgt)
    chunks = list(iter_text_pair(tmp_path / "train.de", tmp_path / "train.en", block_bytes=50))
    assert len(chunks) > 10 and all(len(s) == len(t) for s, t in chunks)
    assert [x for s, _ in chunks for x in s] == src and [x for _, t in chunks for x in t] == read_lines(tmp_path / "train.en")


def test_a_side_that_ends_early_names_its_first_missing_line_and_both_counts(tmp_path):
    src = [f"s{i}" for i in range(3000)]
    tgt = src[:1700] + src[1701:]  # one target line missing in the middle: the side ends a line early
    write_pair(tmp_path, "train", src, tgt)
    with pytest.raises(MtrainError) as err:
        list(iter_text_pair(tmp_path / "train.de", tmp_path / "train.en", block_bytes=100))
    assert str(err.value).startswith(f"{tmp_path / 'train.en'}:3000: 2999 lines, but {tmp_path / 'train.de'} has "
                                     "3000 lines") and "fix the alignment" in str(err.value)


# ---------------------------------------------------------------- the hash set and the sample

@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.lists(st.integers(0, 40), max_size=30), max_size=25))
def test_hash_set_marks_first_occurrences_like_a_python_set(chunks):
    hashes, seen = HashSet(), set()
    for chunk in chunks:
        new = hashes.add_new(np.array(chunk, dtype=np.uint64))
        expected = []
        for value in chunk:
            expected.append(value not in seen)
            seen.add(value)
        assert new.tolist() == expected
    assert len(hashes) == len(seen)
    assert all(run.size > 2 * later.size for run, later in zip(hashes.runs, hashes.runs[1:]))  # O(log n) runs


def test_normalize_equates_what_sentencepiece_equates():
    assert normalize("  Ein\u00a0Hund\t läuft ") == normalize("Ein Hund läuft") == "Ein Hund läuft"
    assert normalize("\uff21\uff22") == "AB" and normalize("ﬁ") == "fi"  # NFKC
    assert normalize("Ein Hund") != normalize("ein Hund")  # case stays


def test_reservoir_holds_everything_in_order_while_it_fits_then_a_seeded_sample():
    items = [str(i) for i in range(100)]
    fits = Reservoir(100, seed=3)
    for start in range(0, 100, 7):
        fits.add(items[start:start + 7], items[start:start + 7])
    assert fits.src == items and fits.tgt == items
    samples = []
    for seed in (1, 1, 2):
        sample = Reservoir(10, seed)
        for start in range(0, 100, 7):
            sample.add(items[start:start + 7], [f"t{x}" for x in items[start:start + 7]])
        assert len(sample) == 10 and len(set(sample.src)) == 10
        assert [f"t{x}" for x in sample.src] == sample.tgt  # pairs stay together
        samples.append(sample.src)
    assert samples[0] == samples[1] != samples[2]


def test_reservoir_is_uniform():
    """Each of 100 items is kept with probability 10 / 100: over 2000 seeds an item is kept
    Binomial(2000, 0.1) times (mean 200, sd 13.4); every count within 5 sd of the mean."""
    counts = np.zeros(100, dtype=int)
    for seed in range(2000):
        sample = Reservoir(10, seed)
        for start in range(0, 100, 13):
            chunk = list(range(start, min(100, start + 13)))
            sample.add(chunk, chunk)
        counts[sample.src] += 1
    assert np.abs(counts - 200).max() < 5 * 13.4


# ---------------------------------------------------------------- output identical to the whole-corpus pipeline

def whole_corpus_tokenize(cfg, data_dir: Path, out: Path, splits: list[str]) -> None:
    """The pipeline before streaming, kept as the reference: every split read whole, the training
    split cleaned with exact (src, tgt) duplicates, SentencePiece trained on all kept lines, each
    split encoded in one go and saved by np.save. (On this data an exact and a normalized
    duplicate are the same pairs.)"""
    corpus = {split: read_split(data_dir, split, cfg.data.src, cfg.data.tgt) for split in splits}
    kept, seen = ([], []), set()
    for s, t in zip(*corpus[splits[0]]):
        n_src, n_tgt = len(s.split()), len(t.split())
        if n_src == 0 or n_tgt == 0 or max(n_src, n_tgt) > cfg.data.max_len or max(n_src, n_tgt) > cfg.data.max_ratio * min(n_src, n_tgt):
            continue
        if (s, t) not in seen:
            seen.add((s, t))
            kept[0].append(s)
            kept[1].append(t)
    corpus[splits[0]] = kept
    tok = Tokenizer.train(list(kept[0]), list(kept[1]), cfg.tokenizer)
    out.mkdir()
    tok.save(out)
    for split in splits:
        for side, lines, encode in zip(SIDES, corpus[split], (tok.src.encode, tok.tgt.encode)):
            ids, offsets = to_ragged_arrays(encode(lines))
            np.save(out / f"{split}.{side}.ids.npy", ids)
            np.save(out / f"{split}.{side}.offsets.npy", offsets)
            (out / f"{split}.{side}.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def assert_same_files(reference: Path, streamed: Path) -> None:
    names = sorted(p.name for p in reference.iterdir())
    assert names and set(names) <= {p.name for p in streamed.iterdir()}
    for name in names:
        assert (reference / name).read_bytes() == (streamed / name).read_bytes(), name


def test_multi30k_output_is_byte_identical_to_the_whole_corpus_pipeline(multi30k_slice, tmp_path, monkeypatch):
    """Same ids, offsets, text and spm.model, though the streamed run reads 16 kB blocks (about 20
    chunks, so deduplication merges hash runs across them, measured by worker processes)."""
    cfg = load_config(None, ["tokenizer.vocab_size=1000"])
    splits = ["train", "valid", "test2016"]
    whole_corpus_tokenize(cfg, multi30k_slice, tmp_path / "whole", splits)
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 16_384)
    tokenize_corpus(cfg, multi30k_slice, tmp_path / "streamed", splits)
    assert_same_files(tmp_path / "whole", tmp_path / "streamed")


@pytest.mark.slow
def test_all_of_multi30k_is_byte_identical_with_the_default_settings(multi30k_dir, tmp_path):
    cfg = load_config(None, [])
    splits = ["train", "valid", "test2016"]
    whole_corpus_tokenize(cfg, multi30k_dir, tmp_path / "whole", splits)
    tokenize_corpus(cfg, multi30k_dir, tmp_path / "streamed", splits)
    assert_same_files(tmp_path / "whole", tmp_path / "streamed")


def test_a_corpus_larger_than_the_sample_trains_sentencepiece_on_the_sample(tmp_path):
    data = words_corpus(tmp_path / "raw", random.Random(0), {"train": 600, "valid": 10})
    cfg = load_config(None, ["tokenizer.vocab_size=300", "tokenizer.input_sentence_size=400"])
    stats = tokenize_corpus(cfg, data, tmp_path / "tok", ["train", "valid"])
    assert stats["tokenizer_sample"] == {"pairs": 200, "of_pairs": 600, "input_sentence_size": 400}
    again = tokenize_corpus(cfg, data, tmp_path / "tok2", ["train", "valid"])  # seeded: the same sample
    assert again == stats and (tmp_path / "tok" / "spm.model").read_bytes() == (tmp_path / "tok2" / "spm.model").read_bytes()


# ---------------------------------------------------------------- several corpora, tags

def test_two_corpora_with_a_tag(tmp_path):
    rng = random.Random(1)
    main = words_corpus(tmp_path / "main", rng, {"train": 300, "valid": 10, "test2016": 10})
    back = words_corpus(tmp_path / "bt", rng, {"train": 200}, prefix="b")
    # One pair of bt repeats one of main: deduplication works across corpora.
    (back / "train.de").write_text((back / "train.de").read_text() + read_lines(main / "train.de")[5] + "\n")
    (back / "train.en").write_text((back / "train.en").read_text() + read_lines(main / "train.en")[5] + "\n")
    out = tmp_path / "tok"
    result = tokenize("--data", str(main), "--data", f"back={back}", "--out", str(out), "--vocab-size", "300",
                      "--tag", "back")
    assert result.exit_code == 0, result.output
    assert "cleaned train of main: 300 pairs -> 300 kept" in result.output
    assert "cleaned train of back: 201 pairs -> 200 kept, 1 dropped" in result.output
    data = TokenizedData(out)
    tag_id = data.tokenizer.src.control_id("<back>")
    assert data.corpora == [
        {"name": "main", "source": str(main), "pairs": 300, "tag": None, "tag_id": None},
        {"name": "back", "source": str(back), "pairs": 200, "tag": "<back>", "tag_id": tag_id}]
    assert data.stats["cleaning"]["corpora"]["back"]["dropped"]["duplicate"] == 1
    train, valid = data.split("train"), data.split("valid")
    firsts = [int(train.src[i][0]) for i in range(len(train))]
    assert firsts[300:] == [tag_id] * 200 and tag_id not in firsts[:300]
    for split in (train, valid):  # nowhere else: not inside a source, not in any target, not in valid
        assert int((np.asarray(split.tgt.ids) == tag_id).sum()) == 0
    assert int((np.asarray(train.src.ids) == tag_id).sum()) == 200 and tag_id not in np.asarray(valid.src.ids)
    # The tag is reserved: text never encodes to it, and decoding drops it.
    tok = data.tokenizer
    assert tag_id not in tok.src.encode(["<back> w1 w2", "back"])[0]
    ids = train.src[300].tolist()
    assert tok.src.decode([ids]) == tok.src.decode([ids[1:]]) and "<back>" not in tok.src.decode([ids])[0]
    assert train.src_text()[300:] == read_lines(back / "train.de")[:200]  # the text files carry no tag


def test_untagged_corpora_make_the_model_of_one_corpus_of_both(tmp_path):
    """Two corpora without tags: the same spm.model and ids as their concatenation in one folder."""
    rng = random.Random(2)
    a = words_corpus(tmp_path / "a", rng, {"train": 150, "valid": 5})
    b = words_corpus(tmp_path / "b", rng, {"train": 100}, prefix="b")
    both = tmp_path / "both"
    both.mkdir()
    for lang in ("de", "en"):
        (both / f"train.{lang}").write_text((a / f"train.{lang}").read_text() + (b / f"train.{lang}").read_text())
        shutil.copy(a / f"valid.{lang}", both / f"valid.{lang}")
    cfg = load_config(None, ["tokenizer.vocab_size=300"])
    tokenize_corpus(cfg, [str(a), str(b)], tmp_path / "two", ["train", "valid"])
    tokenize_corpus(cfg, both, tmp_path / "one", ["train", "valid"])
    for name in ("spm.model", "train.src.ids.npy", "train.tgt.offsets.npy", "valid.src.ids.npy"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


def test_each_evaluation_split_comes_from_the_first_corpus_that_has_it(tmp_path):
    """Two corpora, each with its own tests: valid (in both) is the first's, test2016 the first's,
    test only the second's; --drop-overlap drops training pairs of either corpus that repeat a test
    of the other, and a split no corpus has names the first corpus's folder."""
    rng = random.Random(6)
    a = words_corpus(tmp_path / "a", rng, {"train": 200, "valid": 8, "test2016": 6})
    b = words_corpus(tmp_path / "b", rng, {"train": 150, "valid": 9, "test": 7}, prefix="b")
    a_train, b_train = read_split(a, "train", "de", "en"), read_split(b, "train", "de", "en")
    b_test, a_test = read_split(b, "test", "de", "en"), read_split(a, "test2016", "de", "en")
    write_pair(a, "train", a_train[0] + b_test[0][:2], a_train[1] + b_test[1][:2])  # a repeats 2 of b's test
    write_pair(b, "train", b_train[0] + a_test[0][:3], b_train[1] + a_test[1][:3])  # b repeats 3 of a's test2016
    out = tmp_path / "tok"
    result = tokenize("--data", str(a), "--data", str(b), "--out", str(out), "--vocab-size", "300",
                      "--splits", "train,valid,test2016,test", "--drop-overlap")
    assert result.exit_code == 0, result.output
    data = TokenizedData(out)
    for split, folder in (("valid", a), ("test2016", a), ("test", b)):
        src, tgt = read_split(folder, split, "de", "en")
        assert data.split(split).src_text() == src and data.split(split).tgt_text() == tgt, split
    assert json.loads((out / "meta.json").read_text())["eval_sources"] == {"valid": "a", "test2016": "a", "test": "b"}
    assert data.stats["overlap"]["test"] == {"src": 2, "pairs": 2}
    assert data.stats["overlap"]["test2016"] == {"src": 3, "pairs": 3}
    assert data.stats["cleaning"]["corpora"]["a"]["dropped"]["overlap"] == 2
    assert data.stats["cleaning"]["corpora"]["b"]["dropped"]["overlap"] == 3

    result = tokenize("--data", str(a), "--data", str(b), "--out", str(tmp_path / "none"),
                      "--splits", "train,valid,newstest")
    assert_one_line_error(result, str(a / "newstest.de"), "file not found")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("extra, needles", [
    (["--set", "data.weights=main=1,nope=2"], ("data.weights: no corpus named 'nope'", "main, bt")),
    (["--set", "data.weights=main=1"], ("data.weights: no weight for corpus 'bt'",)),
    (["--set", "data.weights=main=1,bt=0"], ("data.weights: bt=0: a weight must be above 0",)),
    (["--set", "data.weights=main=1,bt=-2"], ("bt=-2: a weight must be above 0",)),
    (["--set", "data.weights=main=1,bt=x"], ("'bt=x' is not NAME=WEIGHT",)),
    (["--tag", "nope"], ("data.tags: no corpus named 'nope'",)),
], ids=["unknown weight", "missing weight", "zero weight", "negative weight", "not a number", "unknown tag"])
def test_corpus_settings_that_do_not_fit_fail_before_any_work(tmp_path, extra, needles):
    rng = random.Random(3)
    main = words_corpus(tmp_path / "main", rng, {"train": 20, "valid": 5, "test2016": 5})
    bt = words_corpus(tmp_path / "bt", rng, {"train": 20})
    result = tokenize("--data", str(main), "--data", str(bt), "--out", str(tmp_path / "out"), *extra)
    assert_one_line_error(result, *needles)
    assert not (tmp_path / "out").exists()


def test_two_corpora_with_one_name_fail_before_any_work(tmp_path):
    rng = random.Random(4)
    a = words_corpus(tmp_path / "a" / "news", rng, {"train": 20, "valid": 5, "test2016": 5})
    b = words_corpus(tmp_path / "b" / "news", rng, {"train": 20})
    result = tokenize("--data", str(a), "--data", str(b), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "two corpora named 'news'", "--data NAME=")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- overlap with the evaluation splits

def test_overlap_counts_planted_lines_and_the_option_drops_them(tmp_path):
    """Training pairs planted from valid/test (exact, source only, spacing and NFKC variants,
    repeated, or dropped by a length rule) give exactly the counts their construction implies."""
    rng = random.Random(5)
    data = words_corpus(tmp_path / "raw", rng, {"train": 400, "valid": 30, "test2016": 20})
    train, valid, test = (read_split(data, split, "de", "en") for split in ("train", "valid", "test2016"))
    valid[0][29], valid[1][29] = valid[0][0], valid[1][0]  # valid repeats its first pair: each line counts
    write_pair(data, "valid", *valid)
    planted = [(valid[0][i], valid[1][i]) for i in range(5)]  # whole pairs: valid src 0-4 (+29), pairs 0-4 (+29)
    planted += [(valid[0][i], "ein anderer Satz hier") for i in (5, 6, 7)]  # sources only: src 5-7
    planted += [("  " + valid[0][8].replace(" ", "\u00a0 ", 1), valid[1][8] + " ")]  # src 8 and pair 8, normalized
    planted += [(valid[0][0], valid[1][0])]  # planted twice: the eval lines count once
    planted += [(test[0][i], test[1][i]) for i in (0, 1)]  # test src 0-1, pairs 0-1
    planted += [(valid[0][9], ""), (valid[0][10], " ".join(["w1"] * 40))]  # empty side, ratio: not training data
    pairs = list(zip(*train)) + planted
    rng.shuffle(pairs)
    write_pair(data, "train", [p[0] for p in pairs], [p[1] for p in pairs])
    expected = {"valid": {"src": 10, "pairs": 7}, "test2016": {"src": 2, "pairs": 2}}

    result = tokenize("--data", str(data), "--out", str(tmp_path / "tok"), "--vocab-size", "300")
    assert result.exit_code == 0, result.output
    stats = TokenizedData(tmp_path / "tok").stats
    assert stats["overlap"] == expected
    assert "evaluation text also in train (after normalization): valid 10 of 30 source lines, 7 pairs; " \
           "test2016 2 of 20 source lines, 2 pairs; --drop-overlap drops them from training" in result.output

    result = tokenize("--data", str(data), "--out", str(tmp_path / "clean"), "--vocab-size", "300", "--drop-overlap")
    assert result.exit_code == 0, result.output
    stats = TokenizedData(tmp_path / "clean").stats
    assert stats["overlap"] == expected  # what the training data held before the drop
    assert stats["cleaning"]["dropped"]["overlap"] == 12 and stats["cleaning"]["dropped"]["duplicate"] == 0
    kept = {normalize(line) for line in TokenizedData(tmp_path / "clean").split("train").src_text()}
    assert not kept & {normalize(line) for line in valid[0] + test[0]}


def test_the_cleaner_keeps_its_overlap_counts_across_chunks():
    evals = {"valid": (["a b", "c d"], ["x", "y"])}
    cleaner = Cleaner(max_len=10, max_ratio=3.0, evals=evals)
    cleaner.clean(["a  b", "e f"], ["x", "z"])
    cleaner.clean(["c d"], ["w"])
    assert cleaner.overlap() == {"valid": {"src": 2, "pairs": 1}}


# ---------------------------------------------------------------- Hugging Face datasets, streamed

def test_hf_dataset_streams_a_local_folder_like_the_same_files(tmp_path, monkeypatch):
    """`--hf-dataset FOLDER` (JSON lines per split, as on the hub) streams through `datasets`
    offline and makes the same cache as the same pairs given as text files."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    text = words_corpus(tmp_path / "text", random.Random(6), {"train": 200, "valid": 10, "test2016": 10})
    hub = tmp_path / "hub"
    hub.mkdir()
    for split, hf_split in (("train", "train"), ("valid", "validation"), ("test2016", "test")):
        src, tgt = read_split(text, split, "de", "en")
        rows = [json.dumps({"translation": {"de": s, "en": t}}, ensure_ascii=False) for s, t in zip(src, tgt)]
        (hub / f"{hf_split}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    cfg = load_config(None, ["tokenizer.vocab_size=300"])
    splits = ["train", "valid", "test2016"]
    tokenize_corpus(cfg, None, tmp_path / "from-hub", splits, hf_dataset=str(hub))
    tokenize_corpus(cfg, text, tmp_path / "from-text", splits)
    for name in ("spm.model", "train.src.ids.npy", "valid.tgt.ids.npy", "test2016.src.txt"):
        assert (tmp_path / "from-hub" / name).read_bytes() == (tmp_path / "from-text" / name).read_bytes(), name
    assert TokenizedData(tmp_path / "from-hub").meta["source"] == f"hf:{hub}"


# ---------------------------------------------------------------- bad input deep in a file, Ctrl-C

@pytest.fixture()
def long_corpus(tmp_path, monkeypatch):
    """5000 training pairs read in 4 kB blocks: a line 4001 is dozens of blocks into the pass."""
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 4096)
    return words_corpus(tmp_path / "raw", random.Random(7), {"train": 5000, "valid": 10, "test2016": 10})


def test_invalid_utf8_deep_in_the_training_split_stops_in_the_pass_and_leaves_no_folder(long_corpus, tmp_path):
    path = long_corpus / "train.de"
    lines = path.read_bytes().split(b"\n")
    lines[4000] = b"caf\xe9 " + lines[4000]
    path.write_bytes(b"\n".join(lines))
    result = tokenize("--data", str(long_corpus), "--out", str(tmp_path / "out"), "--vocab-size", "300")
    assert_one_line_error(result, f"{path}:4001: invalid UTF-8", "iconv")
    assert not (tmp_path / "out").exists()


def test_a_missing_target_line_deep_in_the_file_leaves_an_earlier_folder_incomplete(long_corpus, tmp_path):
    out = tmp_path / "out"
    assert tokenize("--data", str(long_corpus), "--out", str(out), "--vocab-size", "300").exit_code == 0
    lines = read_lines(long_corpus / "train.en")
    (long_corpus / "train.en").write_text("".join(f"{x}\n" for x in lines[:3000] + lines[3001:]), encoding="utf-8")
    result = tokenize("--data", str(long_corpus), "--out", str(out), "--vocab-size", "300")
    assert_one_line_error(result, f"{long_corpus / 'train.en'}:5000: 4999 lines, but {long_corpus / 'train.de'} has 5000")
    assert not (out / "meta.json").exists() and not (out / "train.src.txt").exists()
    with pytest.raises(MtrainError, match="meta.json: not found"):
        TokenizedData(out)


def test_ctrl_c_during_the_pass_leaves_no_folder(long_corpus, tmp_path, monkeypatch):
    """Ctrl-C while worker processes measure chunks."""
    calls = {"n": 0}
    original = Cleaner.finish

    def interrupted(self, *args):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(Cleaner, "finish", interrupted)
    result = tokenize("--data", str(long_corpus), "--out", str(tmp_path / "out"), "--vocab-size", "300")
    assert result.exit_code == 130 and "interrupted" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- memory (slow)

def synthetic_corpus(source: Path, pairs: int, out: Path) -> Path:
    """Each pair: two random Multi30k training pairs joined (as benchmarks/data_scale.py builds them)."""
    out.mkdir(parents=True)
    src, tgt = read_lines(source / "train.de"), read_lines(source / "train.en")
    rng = np.random.default_rng(0)
    with open(out / "train.de", "w", encoding="utf-8") as s_out, open(out / "train.en", "w", encoding="utf-8") as t_out:
        for start in range(0, pairs, 50_000):
            a, b = (rng.integers(0, len(src), min(50_000, pairs - start)) for _ in range(2))
            s_out.write("".join(f"{src[i]} {src[j]}\n" for i, j in zip(a, b)))
            t_out.write("".join(f"{tgt[i]} {tgt[j]}\n" for i, j in zip(a, b)))
    for lang in ("de", "en"):
        shutil.copy(source / f"valid.{lang}", out / f"valid.{lang}")
    return out


def peak_rss_mb(args: list[str]) -> float:
    proc = subprocess.Popen([sys.executable, "-m", "mtrain", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read().decode()
    return usage.ru_maxrss / 1024


@pytest.mark.slow
def test_peak_memory_stays_flat_as_the_corpus_grows(multi30k_dir, tmp_path):
    """100k and 500k pairs (~27 MB and ~135 MB of text), with a SentencePiece sample that both fill:
    the larger corpus's peak RSS is within 40 MB of the smaller's (its hashes take 8 bytes a pair,
    3 MB more; holding the extra text as Python strings would take over 250 MB)."""
    peaks = {}
    for pairs in (100_000, 500_000):
        corpus = synthetic_corpus(multi30k_dir, pairs, tmp_path / f"c{pairs}")
        peaks[pairs] = peak_rss_mb(["tokenize", "--data", str(corpus), "--out", str(tmp_path / f"t{pairs}"),
                                    "--splits", "train,valid", "--vocab-size", "2000",
                                    "--set", "tokenizer.input_sentence_size=40000"])
        shutil.rmtree(corpus)
    assert peaks[500_000] - peaks[100_000] < 40, peaks
