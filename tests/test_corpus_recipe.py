"""The Tatoeba recipe's config and script (scripts/recipe-tatoeba.sh) and its report
(scripts/corpus_report.py): the curve rows, and the whole script on a small corpus of that shape."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mtrain.config import load_config
from test_recipe import ROOT, VENV_PATH, load_script

corpus_report = load_script(ROOT / "scripts" / "corpus_report.py", "corpus_report")
TESTS = ("test", "flores200-devtest", "newstest2014")


def test_tatoeba_config_trains_to_a_time_budget_with_a_comment_per_key():
    path = ROOT / "configs" / "tatoeba-de-en.yaml"
    t = load_config(path).train
    assert t.max_time and t.cooldown_steps == 0 and t.patience == 0  # early stopping could skip the cooldown
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("  ") and ":" in line and not line.strip().startswith("#"):
            assert "#" in line, f"tatoeba-de-en.yaml: no comment on {line.strip()!r}"


def test_curve_has_one_row_per_validation_in_training_minutes():
    records = [{"event": "train", "step": 100, "train_s": 60.0},
               {"event": "valid", "step": 100, "bleu": 10.123, "chrf": 30.0, "loss": 4.0, "train_s": 72.0},
               {"event": "valid", "step": 200, "bleu": 20.0, "chrf": 40.0, "loss": 3.0},  # logged before train_s existed
               {"event": "valid", "step": 300, "bleu": 25.0, "chrf": 45.0, "loss": 2.5, "train_s": 3000.0}]
    assert corpus_report.curve(records) == [
        {"step": 100, "train_min": 1.2, "valid_bleu": 10.12, "valid_chrf": 30.0, "valid_loss": 4.0},
        {"step": 300, "train_min": 50.0, "valid_bleu": 25.0, "valid_chrf": 45.0, "valid_loss": 2.5}]


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
    for split, (a, b) in cuts.items():
        for lang in ("de", "en"):
            (data / f"{split}.{lang}").write_text("\n".join(lines[lang][a:b]) + "\n", encoding="utf-8")
    config = yaml.safe_load((ROOT / "configs" / "tatoeba-de-en.yaml").read_text())
    config["model"] |= {"d_model": 32, "d_ff": 64, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1}
    config["train"] |= {"max_time": "20s", "warmup_steps": 10, "eval_every": 20, "save_every": 10, "average_last": 2,
                        "num_threads": 1, "max_tokens": 512}
    config["tokenizer"] = {"vocab_size": 400}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RUN", "TOK", "DATA", "CONFIG")}
    env |= {"VIRTUAL_ENV": sys.prefix, "PATH": VENV_PATH, "RUN": str(tmp_path / "run"), "TOK": str(tmp_path / "tok"),
            "DATA": str(data), "CONFIG": str(tmp_path / "config.yaml")}
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
