"""Bad input over every command, as one table: missing, empty, misaligned, mis-encoded, binary and
huge inputs, CRLF and BOMs, bad config keys and values, impossible vocabulary sizes, checkpoints
of another model, impossible search settings. Each either works (CRLF, BOM, long lines are
normal text) or fails with exit code 1 (2 for usage errors) and one `error:` line that names the
problem and its fix, never a traceback, and never leaves a partial output file behind."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mtrain.cli import app

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("train", "valid", "test2016")
TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "train.max_tokens=512", "train.eval_max_sentences=4", "train.num_threads=1"]
LONG_LINE = " ".join(["Hund"] * 10_000)
# '<problem>; <fix>', or a problem stated as what the value must be.
FIX_WORDS = ("; ", " use ", " must ", "expected ", " pass ", "re-run")


@dataclass
class Env:
    """Well-formed inputs that a case copies and breaks one piece of."""

    tmp: Path
    raw: Path  # a small raw corpus: {train,valid,test2016}.{de,en}
    tok: Path  # a tokenized folder (`mtrain tokenize` output)
    ckpt: Path  # a tiny random-weight checkpoint of a model on `tok`

    def corpus(self, **changes: bytes) -> Path:
        """A copy of the raw corpus with some files replaced ({"train_de": b"..."}; None deletes)."""
        folder = self.tmp / "corpus"
        shutil.copytree(self.raw, folder)
        for name, data in changes.items():
            path = folder / name.replace("_", ".")
            if data is None:
                path.unlink()
            else:
                path.write_bytes(data)
        return folder

    def file(self, name: str, data: bytes | str) -> Path:
        path = self.tmp / name
        path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        return path

    def run_dir(self, last: Path | None = None) -> Path:
        """A run folder, holding `last` as last.pt when given (to resume)."""
        folder = self.tmp / "run"
        folder.mkdir(exist_ok=True)
        if last is not None:
            shutil.copy(last, folder / "last.pt")
        return folder

    def text(self, name: str) -> str:
        return (self.raw / name).read_text(encoding="utf-8")


@dataclass
class Case:
    """args(env) builds the inputs and returns the command line. `needles` must appear in the
    error line ({tmp} is replaced by the case's folder). `outputs` (relative to it) must not
    exist afterwards. ok=True: the input is acceptable; `check(env, result)` says it was handled."""

    args: Callable[[Env], list[str]]
    needles: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    code: int = 1
    ok: bool = False
    check: Callable[[Env, object], None] | None = None
    id: str = ""


def tokenize(env: Env, data: Path, *extra: str) -> list[str]:
    return ["tokenize", "--data", str(data), "--out", str(env.tmp / "tok-out"), "--vocab-size", "400", *extra]


def train(env: Env, *extra: str, data: Path | None = None, run: Path | None = None) -> list[str]:
    args = ["train", "--data", str(data or env.tok), "--out", str(run or env.tmp / "run"), "--device", "cpu",
            "--max-steps", "1"]
    for item in TINY:
        args += ["--set", item]
    return args + list(extra)


def translate(env: Env, source: Path, *extra: str, ckpt: Path | None = None) -> list[str]:
    return ["translate", "--checkpoint", str(ckpt or env.ckpt), "--input", str(source), "--output",
            str(env.tmp / "out.en"), "--device", "cpu", "--max-len-b", "3", *extra]


def evaluate(env: Env, hyp: Path, ref: Path, *extra: str) -> list[str]:
    return ["eval", "--hyp", str(hyp), "--ref", str(ref), *extra]


def translate_eval(env: Env, source: Path, *extra: str) -> list[str]:
    return ["eval", "--checkpoint", str(env.ckpt), "--src", str(source), "--ref", str(env.raw / "valid.en"),
            "--output-hyp", str(env.tmp / "hyp.en"), "--device", "cpu", *extra]


def crlf(text: str) -> bytes:
    return text.replace("\n", "\r\n").encode("utf-8")


def bom(text: str) -> bytes:
    return b"\xef\xbb\xbf" + text.encode("utf-8")


def binary() -> bytes:
    return random.Random(0).randbytes(3000)


def invalid_utf8(text: str) -> bytes:
    lines = text.encode("utf-8").split(b"\n")
    lines[2] = b"caf\xe9 au lait"  # Latin-1: line 3 is not UTF-8
    return b"\n".join(lines)


def two_lines_short(text: str) -> bytes:
    return "".join(text.splitlines(keepends=True)[:-2]).encode("utf-8")


# ---------------------------------------------------------------- checks for accepted input

def tokenized_text_is_clean(env: Env, result) -> None:
    """CR and BOM are line-ending/encoding marks, not text: they must not reach the cache."""
    for split in SPLITS:
        for side in ("src", "tgt"):
            text = (env.tmp / "tok-out" / f"{split}.{side}.txt").read_text(encoding="utf-8")
            assert "\r" not in text and "\ufeff" not in text


def long_train_line_dropped(env: Env, result) -> None:
    assert "longer than 250 tokens 1" in result.stderr
    assert LONG_LINE not in (env.tmp / "tok-out" / "train.src.txt").read_text(encoding="utf-8")


def one_line_per_input(n: int) -> Callable[[Env, object], None]:
    def check(env: Env, result) -> None:
        text = (env.tmp / "out.en").read_text(encoding="utf-8")
        assert text.count("\n") == n and "\r" not in text and "\ufeff" not in text
    return check


def same_translation_as_clean_input(env: Env, result) -> None:
    """A BOM or CRLF in the input must not change any translation."""
    ours = (env.tmp / "out.en").read_text(encoding="utf-8")
    clean = CliRunner().invoke(app, translate(env, env.file("clean.de", env.text("valid.de")[:400]),
                                               "--output", str(env.tmp / "clean.en")))
    assert clean.exit_code == 0, clean.output
    assert ours == (env.tmp / "clean.en").read_text(encoding="utf-8")


def scores_as_clean(env: Env, result) -> None:
    """A BOM or CRLF in hypothesis/reference files scores the same as the clean files."""
    clean = CliRunner().invoke(app, evaluate(env, env.raw / "valid.en", env.raw / "valid.en", "--json"))
    assert clean.exit_code == 0, clean.output
    assert result.stdout.strip() == clean.stdout.strip()


def cut_with_a_warning(env: Env, result) -> None:
    assert "warning: 1 input line(s) longer than" in result.stderr
    one_line_per_input(3)(env, result)


# ---------------------------------------------------------------- the table

TABLE: dict[str, list[Case]] = {
    "tokenize": [
        Case(lambda e: tokenize(e, e.tmp / "nowhere"), ("nowhere", "folder not found", "--data"), ("tok-out",), id="missing folder"),
        Case(lambda e: tokenize(e, e.corpus(train_en=None)), ("train.en", "file not found"), ("tok-out",), id="missing file"),
        Case(lambda e: tokenize(e, e.corpus(train_de=b"", train_en=b"")), ("empty",), ("tok-out",), id="empty files"),
        Case(lambda e: tokenize(e, e.corpus(valid_en=two_lines_short(e.text("valid.en")))),
             ("valid.en", "lines", "alignment"), ("tok-out",), id="different line counts"),
        Case(lambda e: tokenize(e, e.corpus(train_de=invalid_utf8(e.text("train.de")))),
             ("train.de:3", "invalid UTF-8", "iconv"), ("tok-out",), id="invalid UTF-8"),
        Case(lambda e: tokenize(e, e.corpus(train_de=binary())), ("train.de", "invalid UTF-8"), ("tok-out",), id="binary file"),
        Case(lambda e: tokenize(e, e.corpus(train_de=(LONG_LINE + "\n" + e.text("train.de")).encode(),
                                            train_en=(LONG_LINE + "\n" + e.text("train.en")).encode())),
             ok=True, check=long_train_line_dropped, id="10,000-token line"),
        Case(lambda e: tokenize(e, e.corpus(**{f"{s}_{l}": crlf(e.text(f"{s}.{l}")) for s in SPLITS for l in ("de", "en")})),
             ok=True, check=tokenized_text_is_clean, id="CRLF"),
        Case(lambda e: tokenize(e, e.corpus(**{f"{s}_{l}": bom(e.text(f"{s}.{l}")) for s in SPLITS for l in ("de", "en")})),
             ok=True, check=tokenized_text_is_clean, id="BOM"),
        Case(lambda e: tokenize(e, e.raw, "--set", "tokenizer.vocab=300"), ("tokenizer.vocab", "vocab_size"), ("tok-out",),
             id="unknown config key"),
        Case(lambda e: tokenize(e, e.raw, "--config", str(e.file("c.yaml", "tokeniser:\n  vocab_size: 300\n"))),
             ("c.yaml", "unknown section", "tokenizer"), ("tok-out",), id="unknown config section"),
        Case(lambda e: tokenize(e, e.raw, "--set", "tokenizer.vocab_size=lots"), ("tokenizer.vocab_size", "integer"),
             ("tok-out",), id="wrong value type"),
        Case(lambda e: tokenize(e, e.raw, "--vocab-size", "many"), ("--vocab-size",), ("tok-out",), code=2,
             id="wrong option type"),
        Case(lambda e: tokenize(e, e.raw, "--vocab-size", "50000"), ("--vocab-size 50000", "too large", "smaller"),
             ("tok-out",), id="vocab size larger than the corpus supports"),
        Case(lambda e: tokenize(e, e.raw, "--vocab-size", "-5"), ("tokenizer.vocab_size=-5", "at least 1"), ("tok-out",),
             id="negative vocab size"),
        Case(lambda e: tokenize(e, e.raw, "--out", str(e.file("tok-file", "x"))), ("tok-file", "File exists"),
             id="--out is a file"),
        Case(lambda e: tokenize(e, e.raw, "--set", "data.max_len=-1"), ("data.max_len=-1", "at least 1"), ("tok-out",),
             id="negative max_len"),
    ],
    "train": [
        Case(lambda e: train(e, data=e.tmp / "nowhere"), ("nowhere", "mtrain tokenize"), ("run",), id="missing data folder"),
        Case(lambda e: train(e, data=e.corpus()), ("meta.json", "mtrain tokenize"), ("run",), id="raw, untokenized folder"),
        Case(lambda e: train(e, data=_damaged_tok(e, "meta.json", b'{"format": 1, "spl')), ("meta.json",), ("run",),
             id="truncated meta.json"),
        Case(lambda e: train(e, data=_damaged_tok(e, "train.src.ids.npy", b"\x93NUMPY garbage")), ("train.src.ids.npy",),
             ("run",), id="damaged ids file"),
        Case(lambda e: train(e, data=_edited_tok(e, "train.tgt.ids.npy", lambda b: b[: len(b) // 2])),
             ("train.tgt.ids.npy", "damaged"), ("run",), id="truncated ids file"),
        Case(lambda e: train(e, data=_edited_array(e, "valid.src.offsets.npy", lambda a: a * 2)),
             ("valid.src.offsets.npy", "does not index"), ("run",), id="offsets that do not index the ids"),
        Case(lambda e: train(e, data=_edited_array(e, "train.src.ids.npy", lambda a: a + 5000)),
             ("train.src.ids.npy", "outside the vocabulary"), ("run",), id="ids from a larger vocabulary"),
        Case(lambda e: train(e, data=_edited_json(e, "meta.json", lambda m: m.update(tgt_vocab_size=999))),
             ("meta.json", "tgt_vocab_size 999"), ("run",), id="edited meta.json"),
        Case(lambda e: train(e, data=_edited_json(e, "stats.json", lambda m: m["splits"]["train"].update(lines=7))),
             ("stats.json", "says train has 7 lines"), ("run",), id="stats.json that disagrees with the ids"),
        Case(lambda e: train(e, data=_foreign_spm(e)), ("spm.model", "not the SentencePiece model"), ("run",),
             id="spm.model of another run"),
        # Over train.max_tokens (512) is what matters; 10,000 tokens would only make the test slow.
        Case(lambda e: train(e, "--set", "train.eval_max_sentences=1", data=_tokenized(e, valid=" ".join(["Hund"] * 1000))),
             ok=True, id="1,000-token line in the valid split"),
        Case(lambda e: train(e, run=e.file("run-file", "x")), ("run-file", "File exists"), id="--out is a file"),
        Case(lambda e: train(e, "--set", "train.max_step=3"), ("train.max_step", "max_steps"), ("run",), id="unknown config key"),
        Case(lambda e: train(e, "--set", "train.lr_scale=fast"), ("train.lr_scale", "number"), ("run",), id="wrong value type"),
        Case(lambda e: train(e, "--set", "model.n_heads=3"), ("n_heads",), ("run",), id="d_model not divisible by n_heads"),
        Case(lambda e: train(e, "--max-steps", "ten"), ("--max-steps",), ("run",), code=2, id="wrong option type"),
        Case(lambda e: train(e, "--set", "train.max_tokens=-1"), ("max_tokens",), ("run",), id="negative max_tokens"),
        Case(lambda e: train(e, "--set", "model.max_len=-1"), ("model.max_len=-1",), ("run",), id="negative model.max_len"),
        Case(lambda e: train(e, "--max-steps", "-3"), ("train.max_steps=-3", "at least 0"), ("run",), id="negative max_steps"),
        Case(lambda e: train(e, "--set", "model.d_model=64", "--set", "model.n_heads=2", run=e.run_dir(e.ckpt)),
             ("last.pt", "model config differs", "d_model: 32 -> 64", "new --out"), id="checkpoint of another model config"),
        Case(lambda e: train(e, "--set", "model.max_len=48", run=e.run_dir(e.ckpt)), ("last.pt", "no training state"),
             id="resume from a model-only checkpoint"),
        Case(lambda e: train(e, "--set", "train.eval_every=0"), ("train.eval_every=0", "at least 1"), ("run",),
             id="zero validation interval"),
    ],
    "translate": [
        Case(lambda e: translate(e, e.file("in.de", "Hallo\n"), ckpt=e.tmp / "none.pt"), ("none.pt", "not found"),
             ("out.en",), id="missing checkpoint"),
        Case(lambda e: translate(e, e.tmp / "none.de"), ("none.de", "not found"), ("out.en",), id="missing input"),
        Case(lambda e: translate(e, e.file("in.de", "")), ok=True, check=one_line_per_input(0), id="empty input"),
        Case(lambda e: translate(e, e.file("in.de", invalid_utf8(e.text("valid.de")))), ("in.de:3", "invalid UTF-8"),
             ("out.en",), id="invalid UTF-8"),
        Case(lambda e: translate(e, e.file("in.de", binary())), ("in.de", "invalid UTF-8"), ("out.en",), id="binary file"),
        Case(lambda e: translate(e, e.file("in.de", f"Hallo\n{LONG_LINE}\nTschüss\n")), ok=True, check=cut_with_a_warning,
             id="10,000-token line"),
        Case(lambda e: translate(e, e.file("in.de", crlf(e.text("valid.de")[:400]))), ok=True,
             check=same_translation_as_clean_input, id="CRLF"),
        Case(lambda e: translate(e, e.file("in.de", bom(e.text("valid.de")[:400]))), ok=True,
             check=same_translation_as_clean_input, id="BOM"),
        Case(lambda e: translate(e, e.file("in.de", "Hallo\n"), "--output", str(e.run_dir())), ("run", "Is a directory"),
             id="--output is a folder"),
        Case(lambda e: translate(e, e.file("in.de", "Hallo\n"), "--beam", "0"), ("--beam 0", "at least 1"), ("out.en",), id="--beam 0"),
        Case(lambda e: translate(e, e.file("in.de", "Hallo\n"), "--beam", "wide"), ("--beam",), ("out.en",), code=2,
             id="wrong option type"),
        Case(lambda e: translate(e, e.file("in.de", "Hallo\n"), "--max-len-b", "-1"), ("--max-len-b -1", "negative"),
             ("out.en",), id="negative --max-len-b"),
        Case(lambda e: translate(e, e.file("in.de", "Hallo\n"), "--max-len-a", "-0.5"), ("--max-len-a", "negative"),
             ("out.en",), id="negative --max-len-a"),
        Case(lambda e: translate(e, e.file("in.de", "Hallo\n"), "--max-tokens", "-4"), ("--max-tokens -4",), ("out.en",),
             id="negative --max-tokens"),
        Case(lambda e: translate(e, e.file("in.de", "Hallo\n"), "--set", "decode.beam_size=2"), ("decode.beam_size", "beam"),
             ("out.en",), id="unknown config key"),
        Case(lambda e: translate(e, e.file("in.de", "Hallo\n"), ckpt=e.file("text.pt", "not a checkpoint\n")),
             ("text.pt", "checkpoint"), ("out.en",), id="a text file as checkpoint"),
    ],
    "eval": [
        Case(lambda e: evaluate(e, e.tmp / "none.en", e.raw / "valid.en"), ("none.en", "not found"), id="missing hypotheses"),
        Case(lambda e: evaluate(e, e.raw / "valid.en", e.tmp / "none.en"), ("none.en", "not found"), id="missing reference"),
        Case(lambda e: evaluate(e, e.file("hyp.en", ""), e.file("ref.en", "")), ("no lines",), id="empty files"),
        Case(lambda e: evaluate(e, e.file("hyp.en", two_lines_short(e.text("valid.en"))), e.raw / "valid.en"),
             ("98 lines", "100"), id="different line counts"),
        Case(lambda e: evaluate(e, e.file("hyp.en", invalid_utf8(e.text("valid.en"))), e.raw / "valid.en"),
             ("hyp.en:3", "invalid UTF-8"), id="invalid UTF-8"),
        Case(lambda e: evaluate(e, e.file("hyp.en", binary()), e.raw / "valid.en"), ("hyp.en", "invalid UTF-8"), id="binary file"),
        Case(lambda e: evaluate(e, e.file("hyp.en", f"{LONG_LINE}\n"), e.file("ref.en", "Hund\n")), ok=True, id="10,000-token line"),
        # A Windows-edited reference against mtrain's own output (and the other way round).
        Case(lambda e: evaluate(e, e.raw / "valid.en", e.file("ref.en", crlf(e.text("valid.en"))), "--json"),
             ok=True, check=scores_as_clean, id="CRLF reference"),
        Case(lambda e: evaluate(e, e.raw / "valid.en", e.file("ref.en", bom(e.text("valid.en"))), "--json"),
             ok=True, check=scores_as_clean, id="BOM reference"),
        Case(lambda e: evaluate(e, e.file("hyp.en", bom(e.text("valid.en"))), e.raw / "valid.en", "--json"),
             ok=True, check=scores_as_clean, id="BOM hypotheses"),
        Case(lambda e: translate_eval(e, e.raw / "valid.de", "--beam", "0"), ("--beam 0",), ("hyp.en",), id="--beam 0"),
        Case(lambda e: translate_eval(e, e.file("src.de", two_lines_short(e.text("valid.de")))), ("src.de", "98 lines"),
             ("hyp.en",), id="source and reference line counts differ"),
        Case(lambda e: evaluate(e, e.raw / "valid.en", e.raw / "valid.en", "--worst", "-1"), ("--worst -1",), id="negative --worst"),
        Case(lambda e: evaluate(e, e.raw / "valid.en", e.raw / "valid.en", "--tokenize", "spaces"), ("--tokenize spaces",),
             id="unknown BLEU tokenizer"),
    ],
    "average": [
        Case(lambda e: ["average", str(e.tmp / "none.pt"), "--out", str(e.tmp / "avg.pt")], ("none.pt", "not found"),
             ("avg.pt",), id="missing checkpoint"),
        Case(lambda e: ["average", "--out", str(e.tmp / "avg.pt")], ("Missing argument",), ("avg.pt",), code=2, id="no checkpoints"),
        Case(lambda e: ["average", str(e.ckpt), str(_other_model(e)), "--out", str(e.tmp / "avg.pt")],
             ("other.pt", "differs", "one run"), ("avg.pt",), id="checkpoints of different models"),
        Case(lambda e: ["average", str(e.ckpt), str(e.ckpt), "--out", str(e.run_dir())], ("run", "Is a directory"),
             id="--out is a folder"),
        Case(lambda e: ["average", str(e.ckpt), str(e.file("empty.pt", b"")), "--out", str(e.tmp / "avg.pt")],
             ("empty.pt",), ("avg.pt",), id="empty checkpoint file"),
    ],
}


def _damaged_tok(env: Env, name: str, data: bytes) -> Path:
    return _edited_tok(env, name, lambda _: data)


def _edited_tok(env: Env, name: str, edit: Callable[[bytes], bytes]) -> Path:
    """A copy of the tokenized folder with one file's bytes edited."""
    folder = env.tmp / "tok-copy"
    shutil.copytree(env.tok, folder)
    (folder / name).write_bytes(edit((folder / name).read_bytes()))
    return folder


def _edited_array(env: Env, name: str, edit: Callable[[np.ndarray], np.ndarray]) -> Path:
    def rewrite(data: bytes) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, edit(np.load(io.BytesIO(data))))
        return buffer.getvalue()

    return _edited_tok(env, name, rewrite)


def _edited_json(env: Env, name: str, edit: Callable[[dict], None]) -> Path:
    def rewrite(data: bytes) -> bytes:
        obj = json.loads(data)
        edit(obj)
        return json.dumps(obj).encode()

    return _edited_tok(env, name, rewrite)


def _foreign_spm(env: Env) -> Path:
    """The tokenized folder with the spm.model of another `mtrain tokenize` run (another vocabulary)."""
    from mtrain.config import load_config
    from mtrain.prepare import tokenize_corpus

    tokenize_corpus(load_config(None, ["tokenizer.vocab_size=350"]), env.raw, env.tmp / "tok-other", ["train", "valid"])
    return _edited_tok(env, "spm.model", lambda _: (env.tmp / "tok-other" / "spm.model").read_bytes())


def _tokenized(env: Env, valid: str) -> Path:
    """`mtrain tokenize` of the raw corpus with `valid` as an extra first valid pair (valid is not cleaned)."""
    from mtrain.config import load_config
    from mtrain.prepare import tokenize_corpus

    raw = env.corpus(valid_de=f"{valid}\n{env.text('valid.de')}".encode(), valid_en=f"{valid}\n{env.text('valid.en')}".encode())
    tokenize_corpus(load_config(None, ["tokenizer.vocab_size=400"]), raw, env.tmp / "tok-long", ["train", "valid"])
    return env.tmp / "tok-long"


def _other_model(env: Env) -> Path:
    return make_checkpoint(env.tok, env.tmp / "other.pt", d_model=64)


def make_checkpoint(tok: Path, path: Path, d_model: int = 32) -> Path:
    from mtrain.checkpoint import make, save_atomic
    from mtrain.config import Config, ModelConfig, to_dict
    from mtrain.data import TokenizedData
    from mtrain.model import Transformer

    tokenizer = TokenizedData(tok).tokenizer
    cfg = ModelConfig(d_model=d_model, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      vocab_size=tokenizer.tgt.vocab_size, max_len=48)
    torch.manual_seed(0)
    save_atomic(make(to_dict(Config(model=cfg)), Transformer(cfg).state_dict(), tokenizer.to_state(),
                     TokenizedData(tok).stats, 1), path)
    return path


@pytest.fixture(scope="module")
def base(multi30k_slice, tokenized_slice, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(raw corpus of 300/100/100 lines, tokenized folder, tiny checkpoint)."""
    raw = tmp_path_factory.mktemp("raw")
    for split, n in (("train", 300), ("valid", 100), ("test2016", 100)):
        for lang in ("de", "en"):
            lines = (multi30k_slice / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)
            (raw / f"{split}.{lang}").write_text("".join(lines[:n]), encoding="utf-8")
    ckpt = make_checkpoint(tokenized_slice, tmp_path_factory.mktemp("ckpt") / "best.pt")
    return raw, tokenized_slice, ckpt


CASES = [pytest.param(command, case, id=f"{command}: {case.id}") for command, cases in TABLE.items() for case in cases]


@pytest.mark.parametrize("command, case", CASES)
def test_bad_input(base, tmp_path, command, case):
    env = Env(tmp_path, *base)
    args = case.args(env)
    assert args[0] == command
    result = CliRunner().invoke(app, args)
    escaped = result.exception if not isinstance(result.exception, (SystemExit, type(None))) else None
    assert escaped is None, f"{type(escaped).__name__}: {escaped}"  # a traceback in a real process
    assert "Traceback" not in result.output
    if case.ok:
        assert result.exit_code == 0, result.output
        if case.check is not None:
            case.check(env, result)
        return
    assert result.exit_code == case.code, result.output
    if case.code == 1:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]), result.stderr
        line = errors[0]
        assert any(word in line for word in FIX_WORDS), f"no fix named: {line}"
    else:  # click's usage error: names the option, exits 2
        line = result.stderr
    for needle in case.needles:
        assert needle.format(tmp=tmp_path) in line, line
    for name in case.outputs:
        path = tmp_path / name
        assert not path.exists() or (path.is_dir() and not any(path.glob("*.pt")) and not (path / "meta.json").exists()), \
            f"{name} left behind"
    assert not list(tmp_path.glob("**/.*.tmp")), "a temp file was left behind"


def test_real_processes_print_one_line_and_no_traceback(base, tmp_path):
    """The CliRunner cases above run in-process; two in real processes prove the same for
    `python -m mtrain` (its own exception hook, stderr, exit status)."""
    env = Env(tmp_path, *base)
    commands = [translate(env, env.file("in.de", binary())),
                tokenize(env, env.corpus(valid_en=two_lines_short(env.text("valid.en"))))]
    envs = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "mtrain", *args], cwd=ROOT, env=envs, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for args in commands]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        text = err.decode()
        assert proc.returncode == 1 and out == b"", text
        # What a terminal shows: a progress bar erased with \r leaves only the text after it.
        visible = [line.rsplit("\r", 1)[-1] for line in text.split("\n") if line.rsplit("\r", 1)[-1].strip()]
        assert "Traceback" not in text and len(visible) == 1 and visible[0].startswith("error: "), text
    assert not (tmp_path / "out.en").exists() and not (tmp_path / "tok-out").exists()
