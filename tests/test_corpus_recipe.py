"""The corpus recipes' configs and scripts (scripts/recipe-tatoeba.sh, scripts/recipe-mixed.sh, both
through scripts/recipe-corpus.sh), their report (scripts/corpus_report.py) and the table of single-
corpus and mixed models (scripts/mixing_table.py): the curve rows, the reuse of recorded scores, and
the whole scripts on small corpora of those shapes."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mtrain.config import load_config
from test_recipe import ROOT, VENV_PATH, load_script

corpus_report = load_script(ROOT / "scripts" / "corpus_report.py", "corpus_report")
mixing_table = load_script(ROOT / "scripts" / "mixing_table.py", "mixing_table")
TESTS = ("test", "flores200-devtest", "newstest2014")


@pytest.mark.parametrize("name", ["tatoeba-de-en.yaml", "mixed-de-en.yaml"])
def test_corpus_config_trains_to_a_time_budget_with_a_comment_per_key(name):
    path = ROOT / "configs" / name
    t = load_config(path).train
    assert t.max_time and t.cooldown_steps == 0 and t.patience == 0  # early stopping could skip the cooldown
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("  ") and ":" in line and not line.strip().startswith("#") and not line.endswith(":"):
            assert "#" in line, f"{name}: no comment on {line.strip()!r}"


def test_mixed_config_weights_give_the_shares_its_comment_states():
    """0.27 : 1 over 28,995 + 162,894 pairs: 40.8k Multi30k pairs an epoch (1.41 passes), 151.1k Tatoeba."""
    from mtrain.config import corpus_weights
    from mtrain.data import quotas

    weights = corpus_weights(load_config(ROOT / "configs" / "mixed-de-en.yaml").data)
    assert list(weights) == ["multi30k", "tatoeba"]
    multi30k, tatoeba = quotas([28_995, 162_894], list(weights.values()))
    assert round(multi30k / 28_995, 2) == 1.41 and round(tatoeba / 162_894, 2) == 0.93
    assert round(multi30k, -2) == 40_800 and round(tatoeba, -2) == 151_100


def test_mixing_table_reuses_only_a_whole_score_of_the_model_alone_made_after_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    score = {"bleu": 42.2, "chrf": 61.7, "n_lines": 1000}

    def write(name: str, content: str, ns: int) -> None:
        (run / name).write_text(content)
        os.utime(run / name, ns=(ns, ns))

    write("averaged.pt", "", 2_000)
    write("test2016.json", json.dumps(score), 1_000)
    assert mixing_table.recorded(run, "test2016", 1000) is None  # scored before the model changed: stale
    write("test2016.json", json.dumps(score), 3_000)
    assert mixing_table.recorded(run, "test2016", 1000) == score
    assert mixing_table.recorded(run, "test2016", 999) is None  # another reference
    write("test2016.json", '{"bleu": 4', 3_000)  # an interrupted write
    assert mixing_table.recorded(run, "test2016", 1000) is None
    (run / "test2016.json").unlink()
    write("test2016.sacrebleu.json", json.dumps(score), 3_000)  # the Multi30k recipe's: only as its report says
    meta = {"checkpoint": "runs/x/averaged.pt", "eval_lines": "all", "text": "raw"}
    for change, reused in (({}, True), ({"checkpoint": "runs/x/averaged.pt + runs/y/averaged.pt"}, False),
                           ({"eval_lines": "100"}, False), ({"text": "lc-tok"}, False)):
        write("results.json", json.dumps(meta | change), 4_000)
        assert (mixing_table.recorded(run, "test2016", 1000) == score) is reused, change
    assert mixing_table.recorded(run, "test", 1000) is None


def test_mixing_table_has_a_row_per_model_and_bleu_over_chrf_per_test():
    cell = {"bleu": 40.271, "chrf": 55.93}
    text = mixing_table.table({"mixed": {column: cell for column, _, _ in mixing_table.TESTS}})
    header, rule, row = text.splitlines()
    assert header == "| model | test2016 | Tatoeba test | FLORES-200 devtest | newstest2014 |"
    assert rule.count("---") == 5 and row == "| mixed |" + " 40.27 / 55.93 |" * 4


def test_curve_has_one_row_per_validation_in_training_minutes():
    records = [{"event": "train", "step": 100, "train_s": 60.0},
               {"event": "valid", "step": 100, "bleu": 10.123, "chrf": 30.0, "loss": 4.0, "train_s": 72.0},
               {"event": "valid", "step": 200, "bleu": 20.0, "chrf": 40.0, "loss": 3.0},  # logged before train_s existed
               {"event": "valid", "step": 300, "bleu": 25.0, "chrf": 45.0, "loss": 2.5, "train_s": 3000.0}]
    assert corpus_report.curve(records) == [
        {"step": 100, "train_min": 1.2, "valid_bleu": 10.12, "valid_chrf": 30.0, "valid_loss": 4.0},
        {"step": 300, "train_min": 50.0, "valid_bleu": 25.0, "valid_chrf": 45.0, "valid_loss": 2.5}]


def write_corpus(folder: Path, lines: dict[str, list[str]], cuts: dict[str, tuple[int, int]]) -> None:
    """folder/{split}.de and .en: lines[a:b] of each side for each split's (a, b)."""
    for split, (a, b) in cuts.items():
        for lang in ("de", "en"):
            (folder / f"{split}.{lang}").write_text("\n".join(lines[lang][a:b]) + "\n", encoding="utf-8")


def recipe_env(tmp_path: Path, config_name: str, **corpora: str) -> dict[str, str]:
    """The environment that runs a recipe script in tmp_path on a tiny model of config_name's kind, with
    a 20-second budget: RUN=tmp_path/run, TOK=tmp_path/tok, CONFIG=tmp_path/config.yaml, plus `corpora`."""
    config = yaml.safe_load((ROOT / "configs" / config_name).read_text())
    config["model"] |= {"d_model": 32, "d_ff": 64, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1}
    config["train"] |= {"max_time": "20s", "warmup_steps": 10, "eval_every": 20, "save_every": 10, "average_last": 2,
                        "num_threads": 1, "max_tokens": 512}
    config["tokenizer"] = {"vocab_size": 400}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RUN", "TOK", "DATA", "CORPORA", "CONFIG")}
    return env | {"VIRTUAL_ENV": sys.prefix, "PATH": VENV_PATH, "RUN": str(tmp_path / "run"),
                  "TOK": str(tmp_path / "tok"), "CONFIG": str(tmp_path / "config.yaml"), **corpora}


@pytest.mark.slow  # tokenize, a 20-second training and three beam-5 evaluations: ~1-2 min on 2 cores
def test_recipe_script_end_to_end_on_a_small_corpus(multi30k_dir, tmp_path):
    """Multi30k lines in the Tatoeba folder's shape, 20 test lines also in train: the script drops
    them (reported), trains to its time budget, scores each test once and writes the report; run
    again, it trains no more and scores nothing again."""
    data = tmp_path / "corpus"
    data.mkdir()
    lines = {lang: (multi30k_dir / f"train.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("de", "en")}
    cuts = {"train": (0, 1500), "valid": (1500, 1530), "test": (1480, 1540), "flores200-devtest": (1600, 1620),
            "newstest2014": (1620, 1640)}  # test's first 20 pairs are train's last 20
    write_corpus(data, lines, cuts)
    env = recipe_env(tmp_path, "tatoeba-de-en.yaml", DATA=str(data))
    script = ["bash", str(ROOT / "scripts" / "recipe-tatoeba.sh")]
    proc = subprocess.run(script, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "run"
    results = json.loads((run / "results.json").read_text())
    assert results["stopped"] == "max_time" and 0.3 <= results["train_minutes"] <= 1.0  # 20 s, in minutes to 0.1
    assert results["overlap_pairs"]["test"] >= 20
    assert results["train_pairs"] <= 1480
    for test, (a, b) in ((t, cuts[t]) for t in TESTS):
        assert results["tests"][test]["n_lines"] == b - a
        assert results["tests"][test]["signatures"]["bleu"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
        assert len((run / f"{test}.hyp").read_text(encoding="utf-8").splitlines()) == b - a
    with open(run / "bleu_vs_time.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert rows and float(rows[-1]["train_min"]) * 60 >= 19.5  # the final validation, past the budget (0.01 min steps)
    scored = {t: (run / f"{t}.json").stat().st_mtime_ns for t in TESTS}
    again = subprocess.run(script, capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already ended" in again.stderr and "scoring" not in again.stderr
    assert scored == {t: (run / f"{t}.json").stat().st_mtime_ns for t in TESTS}


@pytest.mark.slow  # tokenize two corpora, a 20-second training, four beam-5 evaluations, then the table
def test_mixed_recipe_end_to_end_then_the_table(multi30k_dir, tmp_path):
    """Two small corpora in the shapes of Multi30k and Tatoeba: the mixed script tokenizes them together
    (valid and test2016 from the first, the three others from the second, a test repeated in the first
    corpus's training data dropped), trains with the config's weights, scores all four tests once, and
    the table reuses those four scores and scores a copy of the model, which has none, on all four: the
    same numbers."""
    lines = {lang: (multi30k_dir / f"train.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("de", "en")}
    cuts = {"multi30k": {"train": (0, 800), "valid": (800, 830), "test2016": (830, 850)},
            "tatoeba": {"train": (1000, 1800), "valid": (1800, 1820), "test": (780, 800),  # in multi30k's train
                        "flores200-devtest": (1900, 1910), "newstest2014": (1910, 1920)}}
    for corpus, splits in cuts.items():
        (tmp_path / corpus).mkdir()
        write_corpus(tmp_path / corpus, lines, splits)
    run = tmp_path / "run"
    env = recipe_env(tmp_path, "mixed-de-en.yaml", CORPORA=f"multi30k={tmp_path / 'multi30k'} tatoeba={tmp_path / 'tatoeba'}")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-mixed.sh")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((run / "results.json").read_text())
    assert results["stopped"] == "max_time"
    assert results["overlap_pairs"]["test"] == 20 and results["dropped"]["overlap"] == 20
    assert results["config"]["data"]["weights"] == ["multi30k=0.27", "tatoeba=1"]
    a, b = cuts["multi30k"]["valid"]  # valid is the first corpus's, though both have one
    assert (tmp_path / "tok" / "valid.src.txt").read_text(encoding="utf-8").splitlines() == lines["de"][a:b]
    tests = {"test2016": "multi30k", "test": "tatoeba", "flores200-devtest": "tatoeba", "newstest2014": "tatoeba"}
    for test, corpus in tests.items():
        a, b = cuts[corpus][test]
        assert results["tests"][test]["n_lines"] == b - a, test
    scored = {test: (run / f"{test}.json").stat().st_mtime_ns for test in tests}

    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("averaged.pt", "config.yaml"):
        shutil.copy(run / name, copy / name)
    table = subprocess.run([sys.executable, str(ROOT / "scripts" / "mixing_table.py"), "--model", f"mixed={run}",
                            "--model", f"copy={copy}",
                            "--multi30k", str(tmp_path / "multi30k"), "--tatoeba", str(tmp_path / "tatoeba"),
                            "--json", str(tmp_path / "table.json")], capture_output=True, text=True, env=env)
    assert table.returncode == 0, table.stderr[-2000:]
    assert table.stderr.count("scoring") == 4 and str(run) not in table.stderr  # the recipe's four are reused
    assert scored == {test: (run / f"{test}.json").stat().st_mtime_ns for test in tests}
    record = json.loads((tmp_path / "table.json").read_text())
    for column, split, _ in mixing_table.TESTS:
        assert record["mixed"]["tests"][column]["bleu"] == results["tests"][split]["bleu"]
        assert record["copy"]["tests"][column] == record["mixed"]["tests"][column]
        assert len((copy / f"{split}.hyp").read_text(encoding="utf-8").splitlines()) == results["tests"][split]["n_lines"]
    rows = table.stdout.splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == ["| mixed", "| copy"] and rows[0][7:] == rows[1][6:]
