"""`mtrain eval` and `mtrain.evaluate.score`: the numbers equal sacrebleu's API and CLI, options
pass through, bad input fails in one line, and the checkpoint path scores a Multi30k slice."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU, CHRF, TER
from typer.testing import CliRunner

from mtrain.cli import app
from mtrain.evaluate import score, worst_sentences

HYP = [
    "The cat sat on the mat.",
    "A dog runs in the park!",
    "Hello World",
    "Two MEN are playing football on a green field.",
    "A woman with a red hat is reading a newspaper.",
]
REF = [
    "The cat is sitting on the mat.",
    "The dog runs in a park.",
    "hello world",
    "Two men are playing soccer on a field.",
    "A woman in a red hat reads the newspaper.",
]
REF2 = [
    "A cat sat on the mat.",
    "A dog is running in the park.",
    "Hello, world",
    "Two men play football on the green grass.",
    "A woman wearing a red hat is reading a paper.",
]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path):
    return write(tmp_path / "hyp.txt", HYP), write(tmp_path / "ref.txt", REF), write(tmp_path / "ref2.txt", REF2)


def run_cli(*args: str):
    return CliRunner().invoke(app, ["eval", *map(str, args)])


def eval_json(*args) -> dict:
    result = run_cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def sacrebleu_cli(refs: list[Path], hyp: Path, *options: str, width: int = 6) -> dict[str, dict]:
    """Run sacrebleu's own command line; returns {"bleu"|"chrf"|"ter": its JSON entry}."""
    cmd = [sys.executable, "-m", "sacrebleu", *map(str, refs), "-i", str(hyp), "-m", "bleu", "chrf", "ter",
           "-f", "json", "-w", str(width), *options]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    entries = json.loads(out)
    return dict(zip(("bleu", "chrf", "ter"), entries))


def api_scores(hyps, refs, bleu=None, chrf=None, ter=None) -> dict[str, float]:
    metrics = {"bleu": bleu or BLEU(), "chrf": chrf or CHRF(), "ter": ter or TER()}
    return {key: metric.corpus_score(hyps, refs).score for key, metric in metrics.items()}


def assert_matches(ours: dict, api: dict, cli: dict, width: int = 6) -> None:
    for key in ("bleu", "chrf", "ter"):
        assert ours[key] == api[key], key  # same function, full precision
        assert f"{ours[key]:.{width}f}" == f"{cli[key]['score']:.{width}f}", key
        assert ours["signatures"][key] == cli[key]["signature"], key


def test_equals_sacrebleu_api_and_cli(files):
    hyp, ref, _ = files
    ours = eval_json("--hyp", hyp, "--ref", ref)
    assert ours["n_lines"] == len(HYP)
    assert_matches(ours, api_scores(HYP, [REF]), sacrebleu_cli([ref], hyp))


def test_multiple_references(files):
    hyp, ref, ref2 = files
    ours = eval_json("--hyp", hyp, "--ref", ref, "--ref", ref2)
    assert_matches(ours, api_scores(HYP, [REF, REF2]), sacrebleu_cli([ref, ref2], hyp))
    assert all(sig.startswith("nrefs:2|") for sig in ours["signatures"].values())
    # A second reference can only add matches: BLEU and chrF rise, TER falls (hand-made refs differ).
    single = eval_json("--hyp", hyp, "--ref", ref)
    assert ours["bleu"] > single["bleu"] and ours["chrf"] > single["chrf"] and ours["ter"] < single["ter"]


def test_lowercase_passes_through(files):
    hyp, ref, _ = files
    ours = eval_json("--hyp", hyp, "--ref", ref, "--lowercase")
    api = api_scores(HYP, [REF], bleu=BLEU(lowercase=True), chrf=CHRF(lowercase=True))
    assert_matches(ours, api, sacrebleu_cli([ref], hyp, "--lowercase", "--chrf-lowercase"))
    assert "case:lc" in ours["signatures"]["bleu"] and "case:lc" in ours["signatures"]["chrf"]
    # "Hello World" / "MEN" differ from the references only by case.
    mixed = eval_json("--hyp", hyp, "--ref", ref)
    assert ours["bleu"] > mixed["bleu"] and ours["chrf"] > mixed["chrf"]


@pytest.mark.parametrize("tokenize", ["intl", "none", "char"])
def test_tokenize_passes_through(files, tokenize):
    hyp, ref, _ = files
    ours = eval_json("--hyp", hyp, "--ref", ref, "--tokenize", tokenize)
    api = api_scores(HYP, [REF], bleu=BLEU(tokenize=tokenize))
    assert_matches(ours, api, sacrebleu_cli([ref], hyp, "--tokenize", tokenize))
    assert f"tok:{tokenize}|" in ours["signatures"]["bleu"]


def test_tokenizer_changes_bleu(files):
    # With tok:none, "mat." and "mat" differ; 13a splits the period off, so BLEU must differ.
    hyp, ref, _ = files
    assert eval_json("--hyp", hyp, "--ref", ref, "--tokenize", "none")["bleu"] != eval_json("--hyp", hyp, "--ref", ref)["bleu"]


def test_perfect_hypothesis(tmp_path):
    # Every n-gram matches and lengths are equal: precisions 1, BP 1 -> BLEU 100; no edits -> TER 0.
    ref = write(tmp_path / "ref.txt", REF)
    ours = eval_json("--hyp", ref, "--ref", ref)
    assert ours["bleu"] == pytest.approx(100.0)
    assert ours["ter"] == 0.0
    assert ours["chrf"] == pytest.approx(100.0)


def test_ter_hand_derived():
    # One substitution against a 4-word reference: TER = 1 / 4.
    result = score(["a b c d"], [["a b c e"]])
    assert result["ter"] == pytest.approx(25.0)


def test_brevity_penalty_hand_derived():
    # 6 of the reference's 8 tokens, all in order: every precision is 1 and BP = exp(1 - 8/6),
    # so BLEU = 100 * BP.
    result = score(["a b c d e f"], [["a b c d e f g h"]])
    assert result["bleu_bp"] == pytest.approx(math.exp(1 - 8 / 6))
    assert result["bleu"] == pytest.approx(100 * math.exp(1 - 8 / 6))
    assert score(["a b c d"], [["a b c d"]])["bleu_bp"] == 1.0


def test_tokenize_none_accepts_tokenized_text_quietly(caplog):
    # 100+ lines ending in " ." make sacrebleu warn "forgot to detokenize"; --tokenize none says
    # the text is tokenized on purpose, so that warning must not appear (13a still warns).
    lines = [f"ein hund läuft nummer {i} ." for i in range(120)]
    with caplog.at_level("WARNING", logger="sacrebleu"):
        assert score(lines, [lines], tokenize="none", warn=False)["bleu"] == pytest.approx(100.0)
    assert "detokenize" not in caplog.text
    with caplog.at_level("WARNING", logger="sacrebleu"):
        score(lines, [lines], warn=False)
    assert "detokenize" in caplog.text


def test_score_returns_the_contract():
    result = score(HYP, [REF, REF2])
    assert set(result) == {"bleu", "chrf", "ter", "bleu_bp", "signatures", "n_lines"}
    assert set(result["signatures"]) == {"bleu", "chrf", "ter"}
    assert result["n_lines"] == len(HYP)
    assert all(isinstance(result[k], float) and math.isfinite(result[k]) for k in ("bleu", "chrf", "ter"))


def test_human_output_has_signatures(files):
    hyp, ref, _ = files
    result = run_cli("--hyp", hyp, "--ref", ref)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("BLEU|nrefs:1|") and "tok:13a" in lines[0]
    assert lines[1].startswith("chrF2|nrefs:1|")
    assert lines[2].startswith("TER|nrefs:1|")
    bleu = BLEU().corpus_score(HYP, [REF]).score
    assert f"= {bleu:.2f} " in lines[0]


def test_json_is_the_only_stdout(files):
    # A separate process, so stdout and stderr cannot mix: stdout is exactly one JSON object.
    hyp, ref, _ = files
    bad_hyp = write(hyp.parent / "marked.txt", ["▁The cat sat"] + HYP[1:])
    proc = subprocess.run([sys.executable, "-m", "mtrain", "eval", "--hyp", str(bad_hyp), "--ref", str(ref), "--json", "--worst", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert isinstance(obj, dict) and proc.stdout.strip().count("\n") == 0
    assert "warning" in proc.stderr


def test_mismatched_line_counts(tmp_path, files):
    _, ref, _ = files
    short = write(tmp_path / "short.txt", HYP[:3])
    result = run_cli("--hyp", short, "--ref", ref)
    assert result.exit_code == 1
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in result.output
    assert "3" in message and "5" in message and "short.txt" in message and "ref.txt" in message


def test_second_reference_with_other_count(tmp_path, files):
    hyp, ref, _ = files
    ref2 = write(tmp_path / "r2.txt", REF2[:4])
    result = run_cli("--hyp", hyp, "--ref", ref, "--ref", ref2)
    assert result.exit_code == 1 and "r2.txt has 4" in result.stderr


def test_marker_warning(tmp_path, files):
    _, ref, _ = files
    for marked in ("▁The cat sat on the mat.", "The <unk> sat on the mat.", "The cat sat </s>"):
        hyp = write(tmp_path / "marked.txt", [marked] + HYP[1:])
        result = run_cli("--hyp", hyp, "--ref", ref)
        assert result.exit_code == 0
        assert "warning" in result.stderr and "line 1" in result.stderr
    clean = run_cli("--hyp", files[0], "--ref", ref)
    assert "warning" not in clean.stderr


def test_worst_ordering(tmp_path):
    # Line 1 is perfect (100), line 2 shares no word with its reference (0),
    # line 3 matches half its words: the two worst are 2, then 3.
    ref = write(tmp_path / "ref.txt", ["a man rides a horse .", "the sky is blue today", "two dogs play in snow"])
    hyp = write(tmp_path / "hyp.txt", ["a man rides a horse .", "green apples fall down quickly", "two dogs run on grass"])
    out = eval_json("--hyp", hyp, "--ref", ref, "--worst", "2")
    assert [row["line"] for row in out["worst"]] == [2, 3]
    assert out["worst"][0]["bleu"] == 0.0 and 0.0 < out["worst"][1]["bleu"] < 100.0
    assert out["worst"][0]["hyp"] == "green apples fall down quickly"
    assert out["worst"][0]["refs"] == ["the sky is blue today"]
    human = run_cli("--hyp", hyp, "--ref", ref, "--worst", "1")
    assert "line 2" in human.stdout and "line 3" not in human.stdout and "green apples" in human.stdout


def test_worst_ties_keep_line_order():
    # No hypothesis shares a word with its reference: all score 0, so line order decides.
    rows = worst_sentences(["x y", "p q", "m n"], [["a b", "a b", "a b"]], 2)
    assert [(row["line"], row["bleu"]) for row in rows] == [(1, 0.0), (2, 0.0)]


def test_invalid_utf8_names_file_and_line(tmp_path, files):
    _, ref, _ = files
    bad = tmp_path / "bad.txt"
    bad.write_bytes("ok\nok\ncaf".encode() + b"\xe9\nok\nok\n")
    result = run_cli("--hyp", bad, "--ref", ref)
    assert result.exit_code == 1 and "bad.txt:3:" in result.stderr and "UTF-8" in result.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--ref", "R"], "exactly one of"),
        (["--hyp", "H", "--checkpoint", "C", "--src", "S", "--ref", "R"], "exactly one of"),
        (["--checkpoint", "C", "--ref", "R"], "--src"),
        (["--hyp", "H", "--ref", "R", "--beam", "4"], "--beam"),
        (["--hyp", "H", "--ref", "R", "--tokenize", "nope"], "13a"),
    ],
)
def test_option_errors(files, args, needle):
    hyp, ref, _ = files
    args = [str(hyp) if a == "H" else str(ref) if a in ("R", "S") else a for a in args]
    result = run_cli(*args)
    assert result.exit_code == 1 and needle in result.stderr and "Traceback" not in result.output


def test_scorer_does_not_import_torch():
    # Validation calls score() every eval_every steps; importing it must stay cheap.
    code = "import sys, mtrain.evaluate as e; e.score(['a b'], [['a b']]); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_checkpoint_path_scores_a_multi30k_slice(tokenized_slice, tmp_path):
    """Translate the 100 real test sentences of the slice with a tiny random model and score them."""
    pytest.importorskip("mtrain.translate", reason="mtrain/translate.py (translate_lines) has not landed yet")
    import torch

    from mtrain.checkpoint import make, save_atomic
    from mtrain.config import Config, ModelConfig, to_dict
    from mtrain.data import TokenizedData
    from mtrain.evaluate import read_stripped_lines as read_lines
    from mtrain.model import Transformer

    tokenizer = TokenizedData(tokenized_slice).tokenizer
    model_cfg = ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                            vocab_size=tokenizer.tgt.vocab_size)
    torch.manual_seed(0)
    model = Transformer(model_cfg)
    ckpt = make(to_dict(Config(model=model_cfg)), model.state_dict(), tokenizer.to_state(), TokenizedData(tokenized_slice).stats, 0)
    ckpt_path = tmp_path / "run" / "best.pt"
    save_atomic(ckpt, ckpt_path)

    src, ref = tokenized_slice / "test2016.src.txt", tokenized_slice / "test2016.tgt.txt"
    out_hyp = tmp_path / "out" / "hyp.en"
    # A random model rarely emits EOS, so it writes up to the maximum length: keep that short.
    result = run_cli("--checkpoint", ckpt_path, "--src", src, "--ref", ref, "--beam", "2",
                     "--set", "decode.max_len_b=2", "--output-hyp", out_hyp, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    n = len(read_lines(ref))
    assert summary["n_lines"] == n == 100
    assert all(math.isfinite(summary[k]) for k in ("bleu", "chrf", "ter"))
    hyps = read_lines(out_hyp)
    assert len(hyps) == n
    # What was written is exactly what was scored.
    again = score(hyps, [read_lines(ref)])
    assert {k: again[k] for k in ("bleu", "chrf", "ter")} == {k: summary[k] for k in ("bleu", "chrf", "ter")}
    assert not list(out_hyp.parent.glob(".*.tmp"))  # the atomic write left no temp file
    # --checkpoint twice: an ensemble of the model with itself scores exactly as the model alone.
    twice = run_cli("--checkpoint", ckpt_path, "--checkpoint", ckpt_path, "--src", src, "--ref", ref, "--beam", "2",
                    "--set", "decode.max_len_b=2", "--device", "cpu", "--json")
    assert twice.exit_code == 0, twice.output
    assert {k: json.loads(twice.stdout)[k] for k in ("bleu", "chrf", "ter")} == {k: summary[k] for k in ("bleu", "chrf", "ter")}


def test_unk_rendering_gets_its_own_hint(tmp_path, files):
    _, ref, _ = files
    hyp = write(tmp_path / "unk.txt", ["The ⁇ sat on the mat."] + HYP[1:])
    result = run_cli("--hyp", hyp, "--ref", ref)
    assert "warning" in result.stderr and "<unk>" in result.stderr and "line 1" in result.stderr
