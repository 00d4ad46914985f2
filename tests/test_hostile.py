"""Huge and hostile input: `mtrain translate`, `mtrain score` and `mtrain tokenize` keep exactly one
output line per input line (nbest lines with --nbest) through 10 MB lines, a million-line stdin,
NUL bytes, direction marks, zero-width characters and combining-mark storms, in bounded memory,
with one warning line where text is cut; invalid UTF-8 is one error line naming file and line,
and leaves no output behind. Config values and files, fuzzed with hypothesis, give a valid Config
or one error line, never a traceback."""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_translate import REAL, checkpoint, tokenizer  # noqa: F401 (fixtures)
from typer.testing import CliRunner

from mtrain import translate as translate_module
from mtrain.cli import app
from mtrain.config import SECTIONS, Config, check_ranges, load_config
from mtrain.errors import MtrainError
from mtrain.translate import char_cap, encode_capped, stream_lines

ROOT = Path(__file__).resolve().parents[1]
MAX_RSS_MB = 1500  # generous: the peaks measured are 250 to 600 MB (see each test)
HOSTILE = {
    "nul": "Ein\x00Mann fährt\x00 Fahrrad.",
    "direction marks": "\u200fEin Mann \u202efährt Fahrrad.\u202c",
    "zero width": "Ein\u200bMann f\ufeffährt\u200d Fahrrad.",
    "invisible only": "\u200b\ufeff\u200f",
    "combining storm": "Ein Mann e" + "\u0301" * 20_000,
    "no spaces": "x" * 100_000,
}
CUT = ("combining storm", "no spaces")  # over the max_len (48) of the test checkpoint


def run(*args, input: str | bytes | None = None):
    return CliRunner().invoke(app, [str(arg) for arg in args], input=input)


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


def cut_warning(counts: str) -> str:
    return f"warning: {counts} longer than the model's max_len (48 tokens) were cut to fit"


def one_error_line(result) -> str:
    """The one `error:` line of a failed command; anything else on stderr is the progress bar,
    which tqdm draws and clears with carriage returns."""
    shown = [line for line in re.split(r"[\r\n]", result.stderr) if line.strip()]
    errors = [line for line in shown if line.startswith("error: ")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert all(re.match(r"\d+ (lines|pairs) \[", line) for line in shown if line not in errors), result.output
    assert "Traceback" not in result.output
    return errors[0]


# ---------------------------------------------------------------- hostile lines stay lines

@pytest.mark.parametrize("nbest", [1, 2])
def test_hostile_lines_translate_one_for_one(checkpoint, tmp_path, nbest):  # noqa: F811
    lines = [REAL[0], *HOSTILE.values(), "", REAL[2]]
    src = tmp_path / "in.de"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.en"
    result = run("translate", "--checkpoint", checkpoint, "--input", src, "--output", out, "--beam", "2",
                 "--nbest", nbest, "--device", "cpu")
    assert result.exit_code == 0, result.output
    written = out.read_text(encoding="utf-8").split("\n")
    assert written.pop() == "" and len(written) == nbest * len(lines)
    if nbest > 1:
        assert [int(row.split("\t")[0]) for row in written] == [i for i in range(len(lines)) for _ in range(nbest)]
    assert warnings(result.stderr) == [cut_warning(f"{len(CUT)} input line(s)")]


@pytest.mark.parametrize("kind", ["words", "cjk", "letters", "combining storm", "invisible and nul"])
@pytest.mark.parametrize("max_len", [48, 256])
def test_the_character_cap_keeps_the_tokens_that_survive(tokenizer, kind, max_len):  # noqa: F811
    """Encoding only the first char_cap(max_len) characters of a line gives the same first
    max_len - 1 tokens as encoding all of it, for text with and without spaces."""
    cap = char_cap(max_len)
    sentence = " ".join(REAL)
    line = {
        "words": " ".join([sentence] * (3 * cap // len(sentence))),
        "cjk": "漢字かなカナ한국어" * (cap // 3),
        "letters": "abcdefghijklmnopqrstuvwxyzäöüß" * (cap // 10),
        "combining storm": "e" + "\u0301" * 3 * cap,
        "invisible and nul": ("Ein\u200b Mann\x00\u200f f\ufeffährt \u202e" * cap)[: 3 * cap],
    }[kind]
    [ids], n_cut = encode_capped(tokenizer.src, [line], max_len)
    assert n_cut == 1 and ids == tokenizer.src.encode([line])[0][: max_len - 1]


def test_the_character_cap_counts_a_line_as_cut_only_past_it(tokenizer):  # noqa: F811
    cap = char_cap(48)
    lines = ["Hund " * (cap // 5), " " * (cap + 1), REAL[0], ""]
    ids, n_cut = encode_capped(tokenizer.src, lines, 48)
    assert n_cut == 2 and ids[1] == ids[3] == [] and ids[2] == tokenizer.src.encode([REAL[0]])[0]


def test_stream_lines_keeps_the_start_of_an_overlong_line(monkeypatch):
    """An overlong line keeps more than max_chars characters (so it is still cut and counted
    where it is encoded), at most 4 * (max_chars + 1); the rest is read in small blocks, also
    when a character straddles a block boundary; the lines after it are untouched."""
    monkeypatch.setattr(translate_module, "READ_BLOCK", 7)
    long = "a" + "äö€😀" * 100
    exact = "ä€😀x" * 5  # 20 characters in 50 bytes: not cut with max_chars=20
    data = (long + "\r\n" + exact + "\n\n" + long + "\nlast").encode("utf-8")
    got = list(stream_lines(io.BytesIO(data), "mem", max_chars=20))
    assert len(got) == 5 and got[1:3] == [exact, ""] and got[4] == "last"
    for head in (got[0], got[3]):
        assert long.startswith(head) and 20 < len(head) <= 4 * 21


@pytest.mark.parametrize("bad, line, byte", [
    (b"ok\n" + "ä".encode() * 50 + b"\xff" + b"tail\n", 2, 101),  # in the dropped rest
    (b"x" * 200 + "😀".encode()[:2], 1, 201),  # a character cut short by the end of the input
    (b"x" * 90 + b"\xed\xa0\x80" + b"x" * 90 + b"\n", 1, 91),  # an encoded lone surrogate
])
def test_stream_lines_checks_the_rest_it_drops(monkeypatch, bad, line, byte):
    monkeypatch.setattr(translate_module, "READ_BLOCK", 5)
    with pytest.raises(MtrainError, match=rf"^mem:{line}: invalid UTF-8 \(byte {byte} of the line\)"):
        list(stream_lines(io.BytesIO(bad), "mem", max_chars=10))


def test_score_cuts_both_sides_and_says_which(checkpoint, tmp_path):  # noqa: F811
    sources = [REAL[0], "x" * 10_000, REAL[1], " ".join(["Hund"] * 100), HOSTILE["nul"]]
    targets = ["A " * 10_000, "", "dog " * 200, REAL[3], HOSTILE["zero width"]]
    src, tgt = tmp_path / "in.de", tmp_path / "in.en"
    src.write_text("\n".join(sources) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(targets) + "\n", encoding="utf-8")
    result = run("score", "--checkpoint", checkpoint, "--src", src, "--tgt", tgt, "--device", "cpu")
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert len(rows) == len(sources) and all(math.isfinite(float(row[0])) for row in rows)
    assert [int(row[1]) for row in rows][:3] == [48, 1, 48]  # cut to max_len - 1 tokens, + EOS
    assert warnings(result.stderr) == [cut_warning("2 source line(s) and 2 target line(s)")]


def test_a_prefix_longer_than_max_len_is_cut_and_counted(checkpoint, tmp_path):  # noqa: F811
    prefix = tmp_path / "prefix.en"
    prefix.write_text("The " * 300 + "\n\nA\n", encoding="utf-8")
    result = run("translate", "--checkpoint", checkpoint, "--prefix", prefix, "--greedy", "--device", "cpu",
                 input=f"{REAL[0]}\n\n{HOSTILE['no spaces']}\n")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and lines[0].split()[:47] == ["The"] * 47 and lines[2].startswith("A")
    assert warnings(result.stderr) == [cut_warning("1 input line(s) and 1 prefix line(s)")]


# ---------------------------------------------------------------- memory, in a subprocess

# Runs a command and writes its peak RSS (KB) to argv[1]. A child forked from pytest itself would
# count pytest's own resident pages (shared until exec) in its peak; one forked from this small
# interpreter counts little more than its own.
MEASURE = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
           "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
           "sys.exit(code)")


def run_measured(tmp_path: Path, args: list, stdin: Path | None = None) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak RSS in MB) of `python -m mtrain ARGS`."""
    out, err, rss = tmp_path / "stdout.txt", tmp_path / "stderr.txt", tmp_path / "rss.txt"
    with open(stdin or os.devnull, "rb") as source, open(out, "wb") as sink, open(err, "wb") as errors:
        code = subprocess.call([sys.executable, "-c", MEASURE, rss, sys.executable, "-m", "mtrain", *map(str, args)],
                               stdin=source, stdout=sink, stderr=errors, cwd=ROOT)
    return code, out.read_text(encoding="utf-8"), err.read_text(encoding="utf-8"), int(rss.read_text()) // 1024


def ten_mb_line() -> str:
    return ("Ein Mann fährt Fahrrad. " * 420_000)[:10_000_000]


def test_a_10_mb_line_takes_little_memory(checkpoint, tmp_path):  # noqa: F811
    """Measured (AMD EPYC, 2 cores): translate peaks at 253 MB RSS with the 10 MB line, near what
    an empty input costs (245 MB: the interpreter with torch); score with a 10 MB line on each side
    peaks at 253 MB too. Little more than the line's first char_cap(max_len) characters is kept
    when it is read."""
    src = tmp_path / "in.de"
    src.write_text(f"{REAL[0]}\n{ten_mb_line()}\n{REAL[2]}\n", encoding="utf-8")
    code, out, err, rss = run_measured(tmp_path, ["translate", "--checkpoint", checkpoint, "--greedy", "--device",
                                                  "cpu"], stdin=src)
    assert code == 0, err
    assert rss < MAX_RSS_MB
    lines = out.split("\n")
    assert lines.pop() == "" and len(lines) == 3
    alone = run("translate", "--checkpoint", checkpoint, "--greedy", "--device", "cpu", input=f"{REAL[0]}\n{REAL[2]}\n")
    assert [lines[0], lines[2]] == alone.stdout.splitlines()
    assert warnings(err) == [cut_warning("1 input line(s)")]

    tgt = tmp_path / "in.en"
    tgt.write_text(f"A man.\n{ten_mb_line()}\nA woman.\n", encoding="utf-8")
    code, out, err, rss = run_measured(tmp_path, ["score", "--checkpoint", checkpoint, "--src", "-", "--tgt", tgt,
                                                  "--device", "cpu"], stdin=src)
    assert code == 0, err
    assert rss < MAX_RSS_MB
    assert len(out.splitlines()) == 3
    assert warnings(err) == [cut_warning("1 source line(s) and 1 target line(s)")]


def many_lines(path: Path, n: int) -> dict[int, str]:
    """n lines on stdin, empty but for a few real ones (empty lines are answered without the model)."""
    real = {0: REAL[0], 1234: REAL[1], n // 2: REAL[2], n - 1: REAL[3]}
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(f"{real.get(i, '')}\n" for i in range(n))
    return real


def test_a_million_line_stdin_stays_aligned(checkpoint, tmp_path):  # noqa: F811
    """Measured (AMD EPYC, 2 cores): 6 to 7 s, peak RSS 254 MB (input and output go in chunks of
    CHUNK_LINES lines)."""
    n = 1_000_000
    src = tmp_path / "in.de"
    real = many_lines(src, n)
    code, out, err, rss = run_measured(tmp_path, ["translate", "--checkpoint", checkpoint, "--greedy", "--device",
                                                  "cpu"], stdin=src)
    assert code == 0, err
    assert rss < MAX_RSS_MB
    lines = out.split("\n")
    assert lines.pop() == "" and len(lines) == n
    alone = run("translate", "--checkpoint", checkpoint, "--greedy", "--device", "cpu",
                input="".join(f"{line}\n" for line in real.values())).stdout.splitlines()
    assert all(alone) and [lines[i] for i in real] == alone
    assert sum(map(bool, lines)) == len(real)
    assert not warnings(err)


# ---------------------------------------------------------------- invalid UTF-8: one line, no output

BAD_BYTES = [pytest.param(b"\xed\xa0\x80", id="lone-surrogate"), pytest.param(b"\xff", id="ff")]


def broken(tmp_path: Path, name: str, bad: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(REAL[0].encode() + b"\n" + REAL[1].encode()[:9] + bad + b" Hund\n" + REAL[2].encode() + b"\n")
    return path


def assert_no_output(path: Path) -> None:
    assert not path.exists() and not list(path.parent.glob(".*.tmp"))


@pytest.mark.parametrize("bad", BAD_BYTES)
def test_translate_invalid_utf8_names_the_line(checkpoint, tmp_path, bad):  # noqa: F811
    src, out = broken(tmp_path, "in.de", bad), tmp_path / "out.en"
    args = ("translate", "--checkpoint", checkpoint, "--output", out, "--device", "cpu")
    line = one_error_line(run(*args, "--input", src))
    assert line.startswith(f"error: {src}:2: invalid UTF-8 (byte 10 of the line)")
    assert_no_output(out)
    line = one_error_line(run(*args, input=src.read_bytes()))
    assert line.startswith("error: <stdin>:2: invalid UTF-8 (byte 10 of the line)")
    assert_no_output(out)


@pytest.mark.parametrize("side", ["src", "tgt"])
@pytest.mark.parametrize("bad", BAD_BYTES)
def test_score_invalid_utf8_names_the_file_and_line(checkpoint, tmp_path, bad, side):  # noqa: F811
    good = tmp_path / "good.txt"
    good.write_text("\n".join(REAL[:3]) + "\n", encoding="utf-8")
    src, tgt = (broken(tmp_path, "bad.txt", bad), good) if side == "src" else (good, broken(tmp_path, "bad.txt", bad))
    out = tmp_path / "scores.txt"
    result = run("score", "--checkpoint", checkpoint, "--src", src, "--tgt", tgt, "--output", out, "--device", "cpu")
    assert one_error_line(result).startswith(f"error: {tmp_path / 'bad.txt'}:2: invalid UTF-8")
    assert_no_output(out)


@pytest.mark.parametrize("bad", BAD_BYTES)
def test_tokenize_invalid_utf8_names_the_file_and_line(multi30k_slice, tmp_path, bad):
    data = tmp_path / "corpus"
    shutil.copytree(multi30k_slice, data)
    lines = (data / "valid.en").read_bytes().split(b"\n")
    lines[41] = lines[41][:5] + bad + lines[41][5:]
    (data / "valid.en").write_bytes(b"\n".join(lines))
    out = tmp_path / "tok"
    result = run("tokenize", "--data", data, "--out", out, "--vocab-size", "500")
    assert one_error_line(result).startswith(f"error: {data / 'valid.en'}:42: invalid UTF-8 (byte 0x{bad[0]:02x})")
    assert not out.exists()


# ---------------------------------------------------------------- tokenize: hostile text round-trips

def hostile(line: str, i: int) -> str:
    """The line with NUL, direction marks, zero-width characters or a combining storm worked in,
    without changing its whitespace-separated words (so cleaning keeps what it kept)."""
    first, _, rest = line.partition(" ")
    storm = "\u0301" * 300
    return [f"\u200f{first}\x00 {rest}\u202e", f"{first[:2]}\u200b{first[2:]}\ufeff {rest}\u200d",
            f"{first}{storm} {rest}", f"{first}\x00\u202e\ufeff {rest}"][i % 4]


def test_tokenize_keeps_hostile_lines_and_round_trips_them(multi30k_slice, tmp_path):
    from mtrain.corpus import clean_pairs
    from mtrain.corpus import read_lines as read_corpus_lines
    from mtrain.data import TokenizedData

    data = tmp_path / "corpus"
    data.mkdir()
    written = {}
    for path in sorted(multi30k_slice.iterdir()):
        lines = [hostile(line, i) if i % 3 == 0 else line for i, line in enumerate(read_corpus_lines(path))]
        (data / path.name).write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        written[path.name] = lines
    out = tmp_path / "tok"
    result = run("tokenize", "--data", data, "--out", out, "--vocab-size", "600")
    assert result.exit_code == 0, result.output
    tokenized = TokenizedData(out)
    tok = tokenized.tokenizer
    kept_src, kept_tgt, _ = clean_pairs(written["train.de"], written["train.en"], 250, 3.0)
    expected = {"train": (kept_src, kept_tgt), "valid": (written["valid.de"], written["valid.en"]),
                "test2016": (written["test2016.de"], written["test2016.en"])}
    for name, (sources, targets) in expected.items():
        split = tokenized.split(name)
        assert split.src_text() == sources and split.tgt_text() == targets and len(split) == len(sources)
        for side, ragged, lines in ((tok.src, split.src, sources), (tok.tgt, split.tgt, targets)):
            cached = [ragged[i].tolist() for i in range(len(lines))]
            assert side.decode(cached) == side.normalize(lines)  # the cached ids are the lines' ids
            assert side.decode(side.encode(lines)) == side.normalize(lines)
    assert any("\x00" in line for line in kept_src) and any("\ufeff" in line for line in kept_tgt)


def test_tokenize_a_10_mb_line_keeps_the_line_counts(multi30k_slice, tmp_path):
    """Measured (AMD EPYC, 2 cores): peak RSS 594 MB with the 10 MB line in the validation split,
    247 MB without it (tokenize holds the corpus in memory, and that line becomes 2 million ids)."""
    data = tmp_path / "corpus"
    shutil.copytree(multi30k_slice, data)
    with open(data / "valid.de", "a", encoding="utf-8") as handle:
        handle.write(ten_mb_line() + "\n")
    with open(data / "valid.en", "a", encoding="utf-8") as handle:
        handle.write("A man rides a bike.\n")
    out = tmp_path / "tok"
    code, _, err, rss = run_measured(tmp_path, ["tokenize", "--data", data, "--out", out, "--vocab-size", "500"])
    assert code == 0, err
    assert rss < MAX_RSS_MB
    from mtrain.data import TokenizedData

    split = TokenizedData(out).split("valid")
    assert len(split) == len(split.src_text()) == len(split.tgt_text()) == 101
    assert split.src_text()[-1] == ten_mb_line()


# ---------------------------------------------------------------- config values, fuzzed

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])
FIELDS = {f"{section}.{f.name}": f for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
NASTY = st.sampled_from([
    "nan", ".nan", "NaN", "inf", "-inf", ".inf", "-.Inf", "1e400", "-1e400", "1.0e400", "1e-400", "9" * 30,
    "9" * 400, "9" * 5000, "-9223372036854775809", "4294967296", "-1", "-0", "0x1F", "1_000", "١٢٣", "~", "null",
    "", " ", "[]", "{}", "[1, [2, [3]]]", "{a: {b: c}}", "&a [*a]", "[" * 3000, "!!binary aGk=",
    "!!python/object:os.system", "!!int 12x", "!!bool maybe", "!!float x", "2001-13-45", "2001-12-14", "yes",
    "off", "'off'", '"\\0"', "a: b: c", "%", "@x", "`x", "*a", "? a", "- a", "|\n  x", "a\n---\nb", "\x00",
    "\u202e", "\ufeff1", "1\u200b", "tensorboard,wandb", "[tensorboard, [wandb]]", "a\nb", "\r", "\u2028",
])
LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20), st.binary(max_size=8),
                 st.dates())
TREE = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=8)
VALUE = st.one_of(NASTY, st.integers().map(str), st.floats().map(str), st.text(max_size=30),
                  TREE.map(lambda tree: yaml.safe_dump(tree, default_flow_style=True, allow_unicode=True).strip()))
KEY = st.one_of(st.sampled_from(sorted(FIELDS)), st.sampled_from(list(SECTIONS)).map(lambda s: f"{s}.x"),
                st.text(max_size=12))
OVERRIDE = st.one_of(st.builds(lambda key, value: f"{key}={value}", KEY, VALUE), st.text(max_size=30))


def assert_valid(cfg: Config) -> None:
    """Every field of the declared type (finite floats, 64-bit ints, tuples of text), in range."""
    for dotted, field in FIELDS.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(field.type)
        if field.type == "int | str":  # an integer or the word auto (train.max_tokens)
            kind = str if value == "auto" else int
        if kind is None:  # tuple[str, ...]
            assert isinstance(value, tuple) and all(isinstance(item, str) for item in value), dotted
        else:
            assert type(value) is kind, dotted
        assert kind is not float or math.isfinite(value), dotted
        assert kind is not int or -2**63 <= value < 2**63, dotted
    check_ranges(cfg)


def config_or_one_line_error(load) -> Config | None:
    try:
        cfg = load()
    except MtrainError as err:
        assert len(str(err).splitlines()) == 1 and "\n" not in str(err), str(err)
        return None
    assert_valid(cfg)
    return cfg


@FUZZ
@given(overrides=st.lists(OVERRIDE, min_size=1, max_size=3))
def test_any_set_value_gives_a_config_or_one_error_line(overrides):
    config_or_one_line_error(lambda: load_config(None, overrides))


CONFIG_TREE = st.dictionaries(
    st.one_of(st.sampled_from(list(SECTIONS)), st.text(max_size=6), st.integers()),
    st.one_of(st.none(), TREE, st.dictionaries(
        st.one_of(st.sampled_from(sorted({name.split(".")[1] for name in FIELDS})), st.text(max_size=6)),
        st.one_of(TREE, NASTY), max_size=4)),
    max_size=4)
CONFIG_FILE = st.one_of(
    CONFIG_TREE.map(lambda tree: yaml.safe_dump(tree, allow_unicode=True).encode("utf-8")),
    st.text(max_size=200).map(str.encode), NASTY.map(str.encode), st.binary(max_size=50),
    st.lists(st.tuples(st.sampled_from(sorted(FIELDS)), NASTY), max_size=3).map(
        lambda pairs: "".join(f"{key.split('.')[0]}:\n  {key.split('.')[1]}: {value}\n" for key, value in pairs).encode()))


@settings(FUZZ, max_examples=150)
@given(content=CONFIG_FILE)
def test_any_config_file_gives_a_config_or_one_error_line(tmp_path, content):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(content)
    config_or_one_line_error(lambda: load_config(path))


@settings(FUZZ, max_examples=150)
@given(overrides=st.lists(OVERRIDE, min_size=1, max_size=2))
def test_print_config_with_any_set_exits_0_or_1_without_a_traceback(tmp_path, overrides):
    """Exit 0 prints a config that loads back as the same Config; exit 1 prints one error line."""
    result = CliRunner().invoke(app, ["train", "--print-config", *(f"--set={text}" for text in overrides)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 1) and "Traceback" not in result.output
    if result.exit_code == 1:
        one_error_line(result)
        return
    printed = tmp_path / "printed.yaml"
    printed.write_text(result.stdout, encoding="utf-8")
    assert load_config(printed) == load_config(None, overrides)
