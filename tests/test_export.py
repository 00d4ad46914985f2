"""`mtrain export`: the exported CTranslate2 and Marian models compute what the checkpoint computes
(teacher-forced log-probabilities, greedy translations), int8 keeps the BLEU, the position table
covers the longest allowed input and output, and every bad request is one line with nothing written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from conftest import write_slice  # noqa: E402
from mtrain.cli import app  # noqa: E402
from mtrain.config import DecodeConfig, load_config  # noqa: E402
from mtrain.export.parity import CheckSet, greedy, max_logprob_diff  # noqa: E402
from mtrain.tokenizer import EOS_ID  # noqa: E402

SMALL = ["model.d_model=64", "model.d_ff=128", "model.n_heads=2", "model.n_encoder_layers=2",
         "model.n_decoder_layers=2", "model.dropout=0.1", "train.max_tokens=1024", "train.warmup_steps=100",
         "train.lr_scale=0.5", "train.max_steps=350", "train.eval_every=350", "train.save_every=350",
         "train.eval_max_sentences=8", "train.log_every=50", "train.num_threads=2",
         "train.amp=off"]  # float32 everywhere: the same model on every host


@pytest.fixture(scope="module")
def corpus(multi30k_dir, tmp_path_factory) -> Path:
    """4000 training pairs and 200 test pairs of real Multi30k, tokenized (joint unigram 1000)."""
    from mtrain.prepare import tokenize_corpus

    raw = write_slice(multi30k_dir, tmp_path_factory.mktemp("export-raw"), {"train": 4000, "valid": 20, "test2016": 200})
    out = tmp_path_factory.mktemp("export-tok")
    tokenize_corpus(load_config(None, ["tokenizer.vocab_size=1000"]), data_dir=raw, out_dir=out,
                    splits=["train", "valid", "test2016"])
    return out


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A small model trained for a few hundred updates: it translates badly, but it translates."""
    from mtrain.train import train

    run = tmp_path_factory.mktemp("export-run")
    train(load_config(None, SMALL), corpus, run, device="cpu")
    return run / "last.pt"


@pytest.fixture(scope="module")
def test_set(corpus) -> CheckSet:
    from mtrain.data import TokenizedData

    split = TokenizedData(corpus).split("test2016")
    return CheckSet(split.src_text(), split.tgt_text(), "test2016")


def export(*args) -> object:
    return CliRunner().invoke(app, ["export", *map(str, args)])


def exported_model(folder: Path, fmt: str):
    from mtrain.export import load_exported

    meta = json.loads((folder / "export.json").read_text())
    return load_exported(fmt, folder, meta["max_len"])


@pytest.fixture(scope="module")
def exports(trained, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    folders = {}
    for name, extra in (("ctranslate2", []), ("int8", ["--quantization", "int8"]), ("huggingface", [])):
        fmt = "huggingface" if name == "huggingface" else "ctranslate2"
        result = export("--checkpoint", trained, "--format", fmt, "--out", root / name, "--json", *extra)
        assert result.exit_code == 0, result.output
        folders[name] = root / name
    return folders


# ---------------------------------------------------------------- parity on a trained model

@pytest.mark.parametrize("fmt", ["ctranslate2", "huggingface"])
def test_float32_exports_translate_like_mtrain(trained, exports, test_set, fmt):
    """200 test sentences: identical greedy translations (at least 99%), and every reference
    token's log-probability within 1e-4."""
    from mtrain.checkpoint import load_model

    model, tokenizer, ckpt = load_model(trained)
    other = exported_model(exports[fmt], fmt)
    stats = ckpt["stats"]
    mine = greedy(model, tokenizer, test_set.sources, stats)
    theirs = greedy(other, tokenizer, test_set.sources, stats)
    assert len(mine) == len(theirs) == 200
    assert sum(a == b for a, b in zip(mine, theirs)) >= 198
    assert len(set(mine)) > 20  # a model that translates, not one that says the same thing to everything
    diff, tokens = max_logprob_diff(model, other, tokenizer, test_set.sources, test_set.references)
    assert tokens > 2000 and diff < 1e-4


def test_int8_keeps_the_bleu(trained, exports, test_set):
    """int8 loses at most what the export's own check allows (QUANTIZED_BLEU_DROP) on 200 test
    sentences. How much it loses depends on the CPU's int8 kernels: on an AVX2-only AMD EPYC, where
    CTranslate2's oneDNN kernels saturate (int8_saturates), this weak model (BLEU about 6.5) lost
    0.70, and nothing with CT2_USE_MKL=1."""
    import sacrebleu

    from mtrain.checkpoint import load_model
    from mtrain.export.parity import QUANTIZED_BLEU_DROP

    model, tokenizer, ckpt = load_model(trained)
    bleu = {}
    for name in ("ctranslate2", "int8"):
        hyps = greedy(exported_model(exports[name], "ctranslate2"), tokenizer, test_set.sources, ckpt["stats"])
        bleu[name] = sacrebleu.corpus_bleu(hyps, [test_set.references]).score
    assert bleu["ctranslate2"] > 1.0  # it learned something, so the comparison means something
    assert bleu["int8"] >= bleu["ctranslate2"] - QUANTIZED_BLEU_DROP


@pytest.mark.parametrize("machine, vendor, vnni, env, saturates", [
    ("x86_64", "AuthenticAMD", False, {}, True),  # oneDNN, 16-bit sums
    ("x86_64", "AuthenticAMD", False, {"CT2_USE_MKL": "1"}, False),
    ("x86_64", "AuthenticAMD", False, {"CT2_USE_MKL": "true"}, False),
    ("x86_64", "AuthenticAMD", True, {}, False),  # VNNI sums into 32 bits
    ("x86_64", "GenuineIntel", False, {}, False),  # MKL by default
    ("x86_64", "GenuineIntel", False, {"CT2_USE_MKL": "0"}, True),
    ("x86_64", "GenuineIntel", False, {"CT2_USE_MKL": "yes"}, True),  # CTranslate2 reads only 1/true/TRUE as yes
    ("aarch64", "", False, {}, False),
])
def test_int8_saturates_where_ctranslate2_runs_onednn_without_vnni(machine, vendor, vnni, env, saturates):
    from mtrain.export.runtime import int8_saturates

    assert int8_saturates(env=env, fields={"vendor_id": vendor}, vnni=vnni, machine=machine) is saturates


@pytest.mark.parametrize("saturates", [True, False])
def test_the_report_and_translate_name_saturating_int8_kernels(trained, exports, monkeypatch, capsys, saturates):
    """Where the CPU's int8 kernels saturate, the parity report (JSON and text) and loading the int8
    export for translation say so, each once; the float32 export and other CPUs carry no note."""
    from mtrain.checkpoint import load_model
    from mtrain.export import parity, runtime
    from mtrain.translate import load_for_decoding

    monkeypatch.setattr(parity, "int8_saturates", lambda: saturates)
    monkeypatch.setattr(runtime, "int8_saturates", lambda: saturates)
    model, tokenizer, ckpt = load_model(trained)
    check = CheckSet(["Ein Hund läuft durch den Park."], None, "built-in")
    for name, quantization in (("int8", "int8"), ("ctranslate2", None)):
        capsys.readouterr()
        exported = load_for_decoding(exports[name], torch.device("cpu"))[0]
        noted = saturates and quantization == "int8"
        assert capsys.readouterr().err.count("note: CTranslate2 runs int8 on this CPU through oneDNN") == int(noted)
        result = parity.report(model, tokenizer, exported, check, ckpt["stats"], quantization)
        assert ("note" in result) is noted
        assert ("note: " + runtime.SATURATION_NOTE in parity.format_report(result)) is noted


def test_the_report_is_printed_and_stored(exports):
    meta = json.loads((exports["int8"] / "export.json").read_text())
    assert meta["format"] == "ctranslate2" and meta["quantization"] == "int8"
    assert meta["special_tokens"]["eos"] == "</s>" and meta["suppress_tokens"] == ["<pad>", "<s>"]
    report = meta["parity"]
    assert report["passed"] and report["quantization"] == "int8" and 0.0 <= report["greedy_identical"] <= 1.0
    assert {"max_logprob_diff", "bleu_mtrain", "bleu_export", "bleu_diff"} <= set(report)


def test_huggingface_folder_is_a_marian_model(exports, trained):
    """MarianTokenizer makes mtrain's ids (with `</s>`), the card names the architecture, and the
    Auto classes load and translate from the folder alone (transformers 4.x also has the
    "translation" pipeline over them; 5.x removed it): greedy `generate` picks mtrain's greedy
    tokens, or parts from them only where two tokens' scores tie to float32 rounding."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, MarianTokenizer

    from mtrain.checkpoint import load_model

    folder = exports["huggingface"]
    _, tokenizer, _ = load_model(trained)
    hf = MarianTokenizer.from_pretrained(folder)
    lines = ["Ein Hund läuft durch den Park.", "Zwei Männer spielen Fußball auf einer grünen Wiese."]
    for line, ids in zip(lines, tokenizer.src.encode(lines)):
        assert hf(line)["input_ids"] == ids + [EOS_ID]
    card = (folder / "README.md").read_text()
    assert "post-norm" in card and "d_model 64" in card and "pipeline_tag: translation" in card
    auto_tokenizer, auto_model = AutoTokenizer.from_pretrained(folder), AutoModelForSeq2SeqLM.from_pretrained(folder)
    assert type(auto_model).__name__ == "MarianMTModel"
    # Marian's forced_eos_token_id makes the last of max_new_tokens `</s>`: 30 tokens and then `</s>`
    # where mtrain's max_len 30 stops after 30 tokens.
    out = auto_model.generate(**auto_tokenizer(lines, return_tensors="pt", padding=True), num_beams=1,
                              max_new_tokens=31, output_scores=True, return_dict_in_generate=True)
    assert all(auto_tokenizer.batch_decode(out.sequences, skip_special_tokens=True))
    from mtrain.search import greedy_search
    from mtrain.translate import pad_sources

    model, tokenizer, _ = load_model(trained)
    with torch.no_grad():
        mine = greedy_search(model, pad_sources(tokenizer.src.encode(lines), torch.device("cpu")),
                             torch.full((len(lines),), 30))
    for row, ids in enumerate(mine):
        theirs = out.sequences[row, 1:].tolist()  # after the decoder's start token
        theirs = theirs[: theirs.index(EOS_ID)] if EOS_ID in theirs else theirs  # up to </s>
        # Two float32 implementations of one model may only part where two tokens tie to rounding:
        # HF takes its best score, and mtrain's token scores within 1e-4 of the largest finite
        # score's size below it (banned tokens score -inf).
        step = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), None)
        if step is None:
            assert ids == theirs
        else:
            scores = out.scores[step][row]
            tie = 1e-4 * scores[scores.isfinite()].abs().max()
            assert scores[theirs[step]] == scores.max() and scores.max() - scores[ids[step]] < tie


def test_translate_accepts_the_exported_folder(exports, trained, tmp_path):
    """Raw text in, one line out per line in (empty lines stay empty), as with the checkpoint."""
    lines = ["Ein Hund läuft durch den Park.", "", "Ein Mann fährt Fahrrad.", "   "]
    src = tmp_path / "in.de"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    outputs = {}
    for name, model in (("mtrain", trained), ("ct2", exports["ctranslate2"])):
        result = CliRunner().invoke(app, ["translate", "--checkpoint", str(model), "--input", str(src),
                                          "--output", str(tmp_path / name), "--greedy"])
        assert result.exit_code == 0, result.output
        outputs[name] = (tmp_path / name).read_text(encoding="utf-8").split("\n")
    assert outputs["ct2"] == outputs["mtrain"]
    assert len(outputs["ct2"]) == len(lines) + 1 and outputs["ct2"][1] == outputs["ct2"][3] == ""


# ---------------------------------------------------------------- untrained models: structure

def random_checkpoint(folder: Path, data: Path, **model) -> Path:
    from mtrain.checkpoint import make, save_atomic
    from mtrain.config import Config, ModelConfig, to_dict
    from mtrain.data import TokenizedData
    from mtrain.model import Transformer

    tokenized = TokenizedData(data)
    tokenizer = tokenized.tokenizer
    cfg = ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=2, n_decoder_layers=1,
                      vocab_size=tokenizer.tgt.vocab_size,
                      src_vocab_size=0 if tokenizer.joint else tokenizer.src.vocab_size,
                      share_embeddings=tokenizer.joint, **model)
    torch.manual_seed(1)
    path = folder / "model.pt"
    save_atomic(make(to_dict(Config(model=cfg)), Transformer(cfg).state_dict(), tokenizer.to_state(),
                     tokenized.stats, 0), path)
    return path


@pytest.fixture(scope="module")
def separate_vocab(multi30k_slice, tmp_path_factory) -> Path:
    from mtrain.prepare import tokenize_corpus

    out = tmp_path_factory.mktemp("export-sep")
    cfg = load_config(None, ["tokenizer.vocab_size=600", "tokenizer.joint=false", "tokenizer.model_type=bpe"])
    tokenize_corpus(cfg, data_dir=multi30k_slice, out_dir=out, splits=["train", "valid"])
    return out


@pytest.mark.parametrize("fmt", ["ctranslate2", "huggingface"])
def test_separate_vocabularies(separate_vocab, tmp_path, fmt):
    """Source and target SentencePiece models of their own: both exports carry both and match."""
    from mtrain.checkpoint import load_model
    from mtrain.data import TokenizedData

    ckpt_path = random_checkpoint(tmp_path, separate_vocab)
    result = export("--checkpoint", ckpt_path, "--format", fmt, "--out", tmp_path / "out",
                    "--data", separate_vocab, "--check-lines", 30, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(next(line for line in result.output.splitlines() if line.startswith("{")))
    assert report["passed"] and report["max_logprob_diff"] < 1e-4 and report["greedy_identical"] == 1.0
    assert (tmp_path / "out" / "spm.src.model").is_file() and (tmp_path / "out" / "spm.tgt.model").is_file()
    model, tokenizer, _ = load_model(ckpt_path)
    assert model.src_embed is not model.tgt_embed and not tokenizer.joint
    valid = TokenizedData(separate_vocab).split("valid")
    other = exported_model(tmp_path / "out", fmt)
    diff, _ = max_logprob_diff(model, other, tokenizer, valid.src_text()[:10], valid.tgt_text()[:10])
    assert diff < 1e-4


def test_position_table_covers_the_longest_input_and_output(tokenized_slice, tmp_path):
    """An input past max_len is cut to max_len - 1 tokens + `</s>`, and its output may run to
    a * (max_len - 1) + b tokens: the export decodes both ends exactly like mtrain."""
    from mtrain.checkpoint import load_model
    from mtrain.translate import length_slope, translate_lines

    ckpt_path = random_checkpoint(tmp_path, tokenized_slice, max_len=40)
    assert export("--checkpoint", ckpt_path, "--format", "ctranslate2", "--out", tmp_path / "ct2").exit_code == 0
    model, tokenizer, ckpt = load_model(ckpt_path)
    meta = json.loads((tmp_path / "ct2" / "export.json").read_text())
    decode = DecodeConfig(beam=1)
    longest_output = int(length_slope(decode, ckpt["stats"]) * 39 + decode.max_len_b)
    assert meta["max_positions"] >= max(40, longest_output + 1)
    other = exported_model(tmp_path / "ct2", "ctranslate2")
    long_line = " ".join(["Hund", "Katze", "Haus"] * 60)  # far more than 40 tokens
    mine = translate_lines(model, tokenizer, [long_line], decode, "cpu", ckpt["stats"])
    theirs = translate_lines(other, tokenizer, [long_line], decode, "cpu", ckpt["stats"])
    assert mine == theirs
    n_out = len(tokenizer.tgt.encode(mine)[0])
    assert n_out > 39  # the random model runs to the length limit, past the input's length


# ---------------------------------------------------------------- bad requests

def one_line_error(result, *words: str) -> None:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for word in words:
        assert word in lines[0], lines[0]


def nothing_written(parent: Path, name: str) -> bool:
    return not (parent / name).exists() and not any(p.name.startswith(f".{name}.") for p in parent.iterdir())


@pytest.fixture(scope="module")
def small_checkpoint(tokenized_slice, tmp_path_factory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("export-bad"), tokenized_slice)


def test_an_ensemble_is_refused(small_checkpoint, tmp_path):
    result = export("--checkpoint", small_checkpoint, "--checkpoint", small_checkpoint, "--format", "ctranslate2",
                    "--out", tmp_path / "out")
    one_line_error(result, "one checkpoint", "average")
    assert nothing_written(tmp_path, "out")


def test_a_non_empty_folder_needs_force(small_checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    one_line_error(export("--checkpoint", small_checkpoint, "--format", "ctranslate2", "--out", out), "--force")
    assert (out / "keep.txt").read_text() == "mine"
    result = export("--checkpoint", small_checkpoint, "--format", "ctranslate2", "--out", out, "--force")
    assert result.exit_code == 0, result.output
    assert not (out / "keep.txt").exists() and (out / "model.bin").is_file()


def test_the_exported_folder_is_readable_under_the_umask(small_checkpoint, tmp_path):
    previous = os.umask(0o022)
    try:
        result = export("--checkpoint", small_checkpoint, "--format", "ctranslate2", "--out", tmp_path / "out")
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "out" / "export.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("args, words", [
    (["--format", "onnx"], ["onnx", "ctranslate2 or huggingface"]),
    (["--format", "ctranslate2", "--quantization", "int4"], ["int4", "int8"]),
    (["--format", "huggingface", "--quantization", "int8"], ["ctranslate2 only"]),
])
def test_unknown_format_or_quantization(small_checkpoint, tmp_path, args, words):
    one_line_error(export("--checkpoint", small_checkpoint, "--out", tmp_path / "out", *args), *words)
    assert nothing_written(tmp_path, "out")


def test_not_an_mtrain_checkpoint(tmp_path):
    fake = tmp_path / "model.pt"
    torch.save({"weights": torch.zeros(2)}, fake)
    one_line_error(export("--checkpoint", fake, "--format", "ctranslate2", "--out", tmp_path / "out"), "not an mtrain")
    assert nothing_written(tmp_path, "out")


def test_a_model_the_format_cannot_express(small_checkpoint, tmp_path, monkeypatch):
    """A model setting no exporter knows how to write (here: pretend d_ff were one) is refused."""
    import mtrain.export

    monkeypatch.setattr(mtrain.export, "EXPRESSIBLE", mtrain.export.EXPRESSIBLE - {"d_ff"})
    one_line_error(export("--checkpoint", small_checkpoint, "--format", "huggingface", "--out", tmp_path / "out"),
                   "model.d_ff=64", "cannot express")
    assert nothing_written(tmp_path, "out")


def test_a_failed_parity_check_is_an_error_and_writes_nothing(small_checkpoint, tmp_path, monkeypatch):
    """An exporter bug (here: one LayerNorm left out) is caught by the check, not shipped."""
    from mtrain.export import ctranslate2 as exporter

    original = exporter._norm

    def broken(spec, module):
        original(spec, module)
        spec.gamma = spec.gamma * 1.5

    monkeypatch.setattr(exporter, "_norm", broken)
    result = export("--checkpoint", small_checkpoint, "--format", "ctranslate2", "--out", tmp_path / "out")
    one_line_error(result, "parity check failed")
    assert "FAILED" in result.output  # the report is printed too
    assert nothing_written(tmp_path, "out")


def test_missing_export_dependency_says_what_to_install(small_checkpoint, tmp_path, monkeypatch):
    import importlib

    real = importlib.import_module

    def without_ctranslate2(name, *args):
        if name == "ctranslate2":
            raise ImportError("No module named 'ctranslate2'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_ctranslate2)
    one_line_error(export("--checkpoint", small_checkpoint, "--format", "ctranslate2", "--out", tmp_path / "out"),
                   "pip install 'mtrain[export]'")


def test_check_files_must_be_parallel(small_checkpoint, tmp_path):
    (tmp_path / "src").write_text("a\nb\n")
    (tmp_path / "ref").write_text("a\n")
    result = export("--checkpoint", small_checkpoint, "--format", "ctranslate2", "--out", tmp_path / "out",
                    "--check", tmp_path / "src", "--check-ref", tmp_path / "ref")
    one_line_error(result, "one reference per source line")


def test_an_int8_export_on_saturating_kernels_says_so_once(trained, tmp_path, monkeypatch, capsys):
    """The parity check loads the export it checks: the note comes in the report, not a second time."""
    from mtrain.export import parity, runtime

    monkeypatch.setattr(parity, "int8_saturates", lambda: True)
    monkeypatch.setattr(runtime, "int8_saturates", lambda: True)
    result = export("--checkpoint", trained, "--format", "ctranslate2", "--quantization", "int8",
                    "--out", tmp_path / "int8")
    assert result.exit_code == 0, result.output
    said = result.output + capsys.readouterr().err
    assert said.count("note: " + runtime.SATURATION_NOTE) == 1
