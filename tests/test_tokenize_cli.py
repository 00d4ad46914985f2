"""`mtrain tokenize` end to end through the CLI: the files it writes, and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from mtrain.cli import app
from mtrain.corpus import read_lines
from mtrain.data import TokenizedData

runner = CliRunner()
SPLITS = ("train", "valid", "test2016")


def tokenize(*args: str):
    return runner.invoke(app, ["tokenize", *args])


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in last, last


@pytest.fixture()
def corpus(tmp_path):
    """A small well-formed corpus; tests break one file of it."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for split in SPLITS:
        (folder / f"{split}.de").write_text("Ein Hund.\nZwei Katzen.\n", encoding="utf-8")
        (folder / f"{split}.en").write_text("A dog.\nTwo cats.\n", encoding="utf-8")
    return folder


def test_tokenize_writes_the_contract_files_and_cleans_train(multi30k_slice, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(multi30k_slice, data)
    # Append one pair per cleaning rule to the real slice, whose own 2000 pairs all pass (see test_data).
    bad = [
        ("", "An empty source."),  # empty side
        (" ".join(["Wort"] * 251), " ".join(["word"] * 251)),  # 251 tokens > data.max_len 250
        ("Hund", "a dog is running"),  # ratio 4 > data.max_ratio 3
        (read_lines(data / "train.de")[0], read_lines(data / "train.en")[0]),  # duplicate of the first pair
    ]
    for side, column in (("de", 0), ("en", 1)):
        with open(data / f"train.{side}", "a", encoding="utf-8") as handle:
            handle.writelines(pair[column] + "\n" for pair in bad)
    out = tmp_path / "tok"
    result = tokenize("--data", str(data), "--out", str(out), "--vocab-size", "1000")
    assert result.exit_code == 0, result.output
    assert "cleaned train: 2004 pairs -> 2000 kept, 4 dropped (empty side 1, longer than 250 tokens 1, " \
        "length ratio > 3 1, duplicate 1)" in result.output

    expected = {"spm.model", "meta.json", "stats.json"}
    for split in SPLITS:
        for side in ("src", "tgt"):
            expected |= {f"{split}.{side}.ids.npy", f"{split}.{side}.offsets.npy", f"{split}.{side}.txt"}
    assert expected <= {p.name for p in out.iterdir()}

    stats = TokenizedData(out).stats
    assert stats["cleaning"]["dropped"] == {"empty_side": 1, "too_long": 1, "length_ratio": 1, "overlap": 0, "duplicate": 1}
    assert [stats["splits"][s]["lines"] for s in SPLITS] == [2000, 100, 100]
    assert TokenizedData(out).split("train").src_text() == read_lines(multi30k_slice / "train.de")
    tok = TokenizedData(out).tokenizer
    valid = TokenizedData(out).split("valid")
    assert tok.tgt.decode([valid.tgt[i] for i in range(len(valid))]) == tok.tgt.normalize(valid.tgt_text())


def test_tokenize_separate_bpe(multi30k_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 400), ("valid", 20)):
        for side in ("de", "en"):
            (data / f"{split}.{side}").write_text(
                "".join(line + "\n" for line in read_lines(multi30k_dir / f"{split}.{side}")[:n]), encoding="utf-8"
            )
    out = tmp_path / "tok"
    common = ("--data", str(data), "--out", str(out), "--splits", "train,valid", "--vocab-size", "500")
    assert tokenize(*common).exit_code == 0 and (out / "spm.model").is_file()
    result = tokenize(*common, "--separate", "--model-type", "bpe")  # into the same folder
    assert result.exit_code == 0, result.output
    assert not (out / "spm.model").exists()  # the earlier joint model is gone, not left to confuse loaders
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    assert meta["joint"] is False and meta["splits"] == ["train", "valid"] and meta["tokenizer"]["model_type"] == "bpe"
    assert (out / "spm.src.model").is_file() and (out / "spm.tgt.model").is_file()
    tok = TokenizedData(out).tokenizer
    assert not tok.joint and tok.src.vocab_size == tok.tgt.vocab_size == 500


def test_missing_file(corpus, tmp_path):
    (corpus / "valid.en").unlink()
    out = tmp_path / "out"
    result = tokenize("--data", str(corpus), "--out", str(out))
    assert_one_line_error(result, f"{corpus / 'valid.en'}: file not found", "valid.de exists")
    assert not out.exists()  # checked before any work


def test_missing_split(corpus, tmp_path):
    result = tokenize("--data", str(corpus), "--out", str(tmp_path / "out"), "--splits", "train,dev")
    assert_one_line_error(result, "dev.de: file not found", "--splits")


def test_line_count_mismatch(corpus, tmp_path):
    (corpus / "test2016.en").write_text("A dog.\n", encoding="utf-8")
    result = tokenize("--data", str(corpus), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, f"{corpus / 'test2016.en'}:2: 1 line,", f"{corpus / 'test2016.de'} has 2", "fix the alignment")


def test_invalid_utf8(corpus, tmp_path):
    (corpus / "train.de").write_bytes("Ein Hund.\nZwei Katzen.\nGr\xfc\xdfe\n".encode("latin-1"))
    (corpus / "train.en").write_text("A dog.\nTwo cats.\nGreetings\n", encoding="utf-8")
    result = tokenize("--data", str(corpus), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, f"{corpus / 'train.de'}:3: invalid UTF-8", "re-encode")


def test_no_data_and_no_hf_dataset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = tokenize("--out", str(tmp_path / "out"))
    assert_one_line_error(result, "data/multi30k", "--hf-dataset bentrevett/multi30k")


def test_vocab_size_too_large(corpus, tmp_path):
    result = tokenize("--data", str(corpus), "--out", str(tmp_path / "out"), "--vocab-size", "8000")
    assert_one_line_error(result, "--vocab-size 8000 is too large", "pass a smaller --vocab-size")
    assert not (tmp_path / "out").exists()


def test_unknown_model_type(corpus, tmp_path):
    result = tokenize("--data", str(corpus), "--out", str(tmp_path / "out"), "--model-type", "wordpiece")
    assert_one_line_error(result, "--model-type 'wordpiece'", "unigram, bpe")
    assert not (tmp_path / "out").exists()


def test_spm_from_reuses_a_sentencepiece_model_and_encodes_the_same_ids(tokenized_slice, multi30k_slice, tmp_path):
    """--spm-from a tokenized folder (or a checkpoint, or an spm.model) encodes with that model: on
    the same corpus, the same spm.model and the same ids as the folder it came from; with tags it is
    refused (tags need symbols that only a newly trained model reserves)."""
    from typer.testing import CliRunner

    from mtrain.cli import app

    out = tmp_path / "tok"
    args = ["tokenize", "--data", str(multi30k_slice), "--src", "de", "--tgt", "en", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--spm-from", str(tokenized_slice)])
    assert result.exit_code == 0, result.output
    assert (out / "spm.model").read_bytes() == (tokenized_slice / "spm.model").read_bytes()
    for name in ("train.src.ids.npy", "train.tgt.ids.npy", "valid.tgt.ids.npy"):
        assert (out / name).read_bytes() == (tokenized_slice / name).read_bytes()
    refused = CliRunner().invoke(app, [*args[:-1], str(tmp_path / "tagged"), "--spm-from", str(tokenized_slice),
                                       "--tag", multi30k_slice.name])
    assert refused.exit_code != 0 and "--spm-from" in refused.output and "Traceback" not in refused.output
