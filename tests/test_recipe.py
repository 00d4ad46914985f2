"""The Multi30k recipe: its configs resolve and dry-run on real data, the Moses lowercased
tokenization matches the Multi30k repo's own, the report's wall-time arithmetic, the bench runner,
and the one helper that finds the corpus for quickstart.sh, recipe-multi30k.sh and .ci/run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mtrain.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DIRECTIONS = {"de-en": ("de", "en"), "en-de": ("en", "de")}


def load_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


eval_tok = load_script(ROOT / "scripts" / "eval_tok.py", "eval_tok")
report = load_script(ROOT / "scripts" / "recipe_report.py", "recipe_report")
bench = load_script(ROOT / "benchmarks" / "__main__.py", "bench_main")


def recipe(direction: str) -> Path:
    return ROOT / "configs" / f"multi30k-{direction}.yaml"


# ---------------------------------------------------------------- configs

@pytest.mark.parametrize("direction", DIRECTIONS)
def test_recipe_config_resolves(direction):
    cfg = load_config(recipe(direction))
    m, t = cfg.model, cfg.train
    assert (cfg.data.src, cfg.data.tgt) == DIRECTIONS[direction]
    assert m.d_model % m.n_heads == 0 and m.d_model // m.n_heads == 64  # the paper's d_head
    assert m.d_ff == 4 * m.d_model
    assert cfg.tokenizer.joint and m.share_embeddings  # joint vocabulary -> three-way tying
    assert t.warmup_steps < t.max_steps
    # Checkpoints land on max_steps and the averaged window covers the end of the run.
    assert t.max_steps % t.save_every == 0 and t.average_last * t.save_every < t.max_steps
    # A train record is logged at every validation step (the BLEU-vs-time curve reads its elapsed_s).
    assert t.eval_every % t.log_every == 0
    assert cfg.decode.beam == 5  # the test2016 scores are beam 5
    if t.cooldown_steps:
        # Early stopping must not skip the cooldown, and the averaged checkpoints lie inside it.
        assert t.patience == 0 and t.cooldown_steps < t.max_steps
        assert t.average_last * t.save_every <= t.cooldown_steps


def test_every_recipe_key_has_a_why_comment():
    for direction in DIRECTIONS:
        for line in recipe(direction).read_text(encoding="utf-8").splitlines():
            if line.startswith("  ") and ":" in line:
                assert "#" in line, f"{recipe(direction).name}: no comment on {line.strip()!r}"


def test_recipes_differ_only_in_direction_vocabulary_length_and_lenpen():
    """Same model and base schedule both ways; en->de trains longer (bf16, more steps, an lr cooldown, no
    early stopping) and decodes with its own length penalty (docs/recipe.md says why)."""
    de_en, en_de = (yaml.safe_load(recipe(d).read_text()) for d in DIRECTIONS)
    length_keys = {"max_steps", "amp", "patience", "average_last", "cooldown_steps"}
    assert {k: v for k, v in en_de["train"].items() if k not in length_keys} == \
        {k: v for k, v in de_en["train"].items() if k not in length_keys}
    assert {k: v for k, v in en_de["model"].items() if k != "vocab_size"} == de_en["model"]
    assert set(en_de.get("decode", {})) | set(de_en.get("decode", {})) <= {"lenpen"}


@pytest.fixture(scope="module")
def tokenized_en_de(multi30k_slice, tmp_path_factory):
    from mtrain.prepare import tokenize_corpus

    out = tmp_path_factory.mktemp("multi30k-tok-en-de")
    cfg = load_config(recipe("en-de"), ["tokenizer.vocab_size=1000"])
    tokenize_corpus(cfg, data_dir=multi30k_slice, out_dir=out, splits=["train", "valid", "test2016"])
    return out


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_recipe_dry_run_on_real_data(direction, tokenized_slice, tokenized_en_de, capsys):
    from mtrain.train import train

    data_dir = tokenized_slice if direction == "de-en" else tokenized_en_de
    meta = json.loads((data_dir / "meta.json").read_text())
    assert (meta["src"], meta["tgt"]) == DIRECTIONS[direction]
    cfg = load_config(recipe(direction))
    summary = train(cfg, data_dir, None, device="cpu", dry_run=True)
    d, ff, V, m = cfg.model.d_model, cfg.model.d_ff, 1000, cfg.model
    # Hand count: one tied embedding; per layer attention 4(d*d + d), FFN 2*d*ff + ff + d, LayerNorms 2d each.
    attention, ffn, norm = 4 * (d * d + d), 2 * d * ff + ff + d, 2 * d
    expected = V * d + m.n_encoder_layers * (attention + ffn + 2 * norm) + m.n_decoder_layers * (2 * attention + ffn + 3 * norm)
    assert summary["parameters"] == expected
    assert summary["model"]["vocab_size"] == V  # from the data, not the config
    assert summary["tokens_per_batch"]["max"] <= cfg.train.max_tokens
    assert summary["train_sentences"] == 2000 and summary["valid_sentences"] == 100


def test_recipe_script_rejects_an_unknown_direction():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-multi30k.sh"), "fr-en"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr


# PATH for scripts that call `python`/`mtrain`: this interpreter's venv first.
VENV_PATH = f"{Path(sys.executable).parent}:{os.environ['PATH']}"


def _source_multi30k_data(repo: Path, text: str = "raw", check: bool = True) -> subprocess.CompletedProcess:
    (repo / "scripts").mkdir(parents=True)
    # The data helper finds tok/ with tok_bleu.sh's find_tokref, and makes lc-tok text with eval_tok.py.
    for name in ("multi30k_data.sh", "tok_bleu.sh", "eval_tok.py"):
        (repo / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    cmd = 'set -euo pipefail; . scripts/multi30k_data.sh; echo "${source_args[@]}"'
    env = {**os.environ, "MULTI30K_TEXT": text, "PATH": VENV_PATH}
    return subprocess.run(["bash", "-c", cmd], cwd=repo, capture_output=True, text=True, check=check, env=env)


def test_data_helper_copies_a_shared_corpus_beside_the_checkout(tmp_path):
    shared = tmp_path / "shared" / "corpora" / "multi30k"
    shared.mkdir(parents=True)
    for name in ("train.de", "train.en", "valid.de", "SOURCE.md"):
        (shared / name).write_text(f"{name}\n")
    proc = _source_multi30k_data(tmp_path / "repo")
    assert proc.stdout.split() == ["--data", "data/multi30k"]
    copied = sorted(p.name for p in (tmp_path / "repo" / "data" / "multi30k").iterdir())
    assert copied == ["train.de", "train.en", "valid.de"]  # the corpus files only
    assert (tmp_path / "repo" / "data" / "multi30k" / "valid.de").read_text() == "valid.de\n"


def test_data_helper_falls_back_to_hugging_face_without_a_local_copy(tmp_path):
    proc = _source_multi30k_data(tmp_path / "repo")
    assert proc.stdout.split() == ["--hf-dataset", "bentrevett/multi30k"]
    assert not (tmp_path / "repo" / "data").exists()


def test_data_helper_renames_the_lowercased_tokenized_files_for_text_lc_tok(tmp_path):
    shared = tmp_path / "shared" / "corpora" / "multi30k"
    (shared / "tok").mkdir(parents=True)
    for name in ("train.de", "train.en"):
        (shared / name).write_text("Raw text.\n")
    for split in ("train", "valid", "test2016"):
        for lang in ("de", "en"):
            (shared / "tok" / f"{split}.lc.norm.tok.{lang}").write_text(f"{split} {lang} .\n")
    proc = _source_multi30k_data(tmp_path / "repo", text="lc-tok")
    assert proc.stdout.split() == ["--data", "data/multi30k-lctok"]
    lctok = tmp_path / "repo" / "data" / "multi30k-lctok"
    assert sorted(p.name for p in lctok.iterdir()) == [f"{s}.{l}" for s in ("test2016", "train", "valid") for l in ("de", "en")]
    assert (lctok / "valid.en").read_text() == "valid en .\n"  # tok/valid.lc.norm.tok.en, renamed


def test_data_helper_makes_lc_tok_text_from_the_raw_copy_without_a_tok_folder(tmp_path):
    pytest.importorskip("sacremoses")
    shared = tmp_path / "shared" / "corpora" / "multi30k"
    shared.mkdir(parents=True)
    for split in ("train", "valid", "test2016"):
        for lang in ("de", "en"):
            (shared / f"{split}.{lang}").write_text(f'A {split} {lang} "Dog".\n')
    proc = _source_multi30k_data(tmp_path / "repo", text="lc-tok")
    assert proc.stdout.split() == ["--data", "data/multi30k-lctok"] and "eval_tok.py" in proc.stderr
    lctok = tmp_path / "repo" / "data" / "multi30k-lctok"
    assert sorted(p.name for p in lctok.iterdir()) == [f"{s}.{l}" for s in ("test2016", "train", "valid") for l in ("de", "en")]
    # lowercased; English normalization moves the full stop inside the closing quote, German does not
    assert (lctok / "valid.en").read_text() == "a valid en &quot; dog . &quot;\n"
    assert (lctok / "valid.de").read_text() == "a valid de &quot; dog &quot; .\n"


def test_data_helper_without_tokenized_files_says_where_to_get_them(tmp_path):
    proc = _source_multi30k_data(tmp_path / "repo", text="lc-tok", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "MULTI30K_TEXT=lc-tok" in proc.stderr and "multi30k/dataset" in proc.stderr and len(proc.stderr.splitlines()) == 1


def _recipe_plan(direction: str, **env: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MULTI30K_TEXT", "RUN", "TOK", "ENSEMBLE_WITH")} | {"DRY_RUN": "1", **env}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-multi30k.sh"), direction],
                          capture_output=True, text=True, env=env, check=True)
    return dict(item.split("=", 1) for item in proc.stdout.split())


def test_recipe_text_defaults_per_direction():
    # Both directions train on the original text, so the model writes real (cased, detokenized) text.
    assert _recipe_plan("de-en") == {"direction": "de-en", "text": "raw", "config": "configs/multi30k-de-en.yaml",
                                     "tok": "data/multi30k-tok-de-en", "run": "runs/multi30k-de-en"}
    assert _recipe_plan("en-de") == {"direction": "en-de", "text": "raw", "config": "configs/multi30k-en-de.yaml",
                                     "tok": "data/multi30k-tok-en-de", "run": "runs/multi30k-en-de"}
    # An explicit choice wins over the default, and names its own folders.
    assert _recipe_plan("en-de", MULTI30K_TEXT="lc-tok")["run"] == "runs/multi30k-en-de-lctok"
    assert _recipe_plan("de-en", MULTI30K_TEXT="lc-tok", RUN="/tmp/r")["run"] == "/tmp/r"


def test_recipe_ensemble_with_needs_a_finished_run(tmp_path):
    # Checked before anything is installed or trained, so a typo does not cost an hour of training.
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "averaged.pt").write_bytes(b"")
    assert _recipe_plan("en-de", ENSEMBLE_WITH=str(tmp_path / "done"))["ensemble_with"] == str(tmp_path / "done")
    env = {k: v for k, v in os.environ.items() if k != "RUN"} | {"DRY_RUN": "1", "ENSEMBLE_WITH": str(tmp_path / "missing")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-multi30k.sh"), "en-de"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "no averaged.pt" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_ensemble_recipe_trains_b_after_a_and_keeps_b_distinct():
    # One command for the two-model ensemble: A, then B with ENSEMBLE_WITH=A, inside one total budget. The
    # caller's options reach both runs, but B's seed comes last so it wins (the same seed twice would be A again).
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_A", "RUN_B", "TOTAL_HOURS", "TRAIN_HOURS")} | {"DRY_RUN": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-multi30k-ensemble.sh"), "--set", "train.seed=7"],
                          capture_output=True, text=True, env=env, check=True)
    a, b = proc.stdout.splitlines()
    assert a.startswith("RUN=runs/multi30k-en-de ") and a.endswith("recipe-multi30k.sh en-de --set train.seed=7")
    assert "ENSEMBLE_WITH=runs/multi30k-en-de " in b and "minus A's training time" in b
    assert b.index("train.seed=7") < b.index("train.seed=2") and b.endswith("--set train.cooldown_steps=1800")


@pytest.mark.parametrize("hours, message", [("0", "under a minute"), ("0.01", "under a minute"), ("1.5h", "as a number")])
def test_recipe_refuses_a_budget_that_cannot_train(tmp_path, hours, message):
    # `timeout 0` means no limit at all: a zero budget must not start an unbounded run. Checked before installing.
    env = {**os.environ, "DRY_RUN": "1", "RUN": str(tmp_path / "fresh"), "TRAIN_HOURS": hours}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-multi30k.sh"), "en-de"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr and len(proc.stderr.splitlines()) == 1
    ok = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-multi30k.sh"), "en-de"], capture_output=True, text=True,
                        env=env | {"TRAIN_HOURS": ".5"})
    assert ok.returncode == 0 and "run=" in ok.stdout


def test_recipe_script_rejects_an_unknown_text():
    env = {**os.environ, "MULTI30K_TEXT": "cased"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-multi30k.sh"), "en-de"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "MULTI30K_TEXT=lc-tok" in proc.stderr


def test_tok_bleu_scores_lc_tok_output_as_it_is(tmp_path):
    # The model of MULTI30K_TEXT=lc-tok writes the references' own form ("&apos;" included): identical lines
    # must score 100, which re-tokenizing (escaping "&" again) would break.
    line = "ein mann &apos;s hund , der läuft .\n"
    (tmp_path / "hyp").write_text(line * 3)
    (tmp_path / "ref").write_text(line * 3)
    cmd = f'set -euo pipefail; . "{ROOT}/scripts/tok_bleu.sh"; tok_bleu hyp ref de hyp.tok out.json'
    env = {**os.environ, "MULTI30K_TEXT": "lc-tok", "PATH": VENV_PATH}
    subprocess.run(["bash", "-c", cmd], cwd=tmp_path, check=True, env=env)
    assert (tmp_path / "hyp.tok").read_text() == line * 3
    assert json.loads((tmp_path / "out.json").read_text())["bleu"] == pytest.approx(100.0)


# ---------------------------------------------------------------- Moses lowercased tokenization


def test_eval_tok_english_by_hand():
    pytest.importorskip("sacremoses")
    # lowercase; normalize-punctuation -l en moves a comma inside closing quotes ("Rex", -> "Rex,");
    # the tokenizer splits 's and n't the English way and XML-escapes quotes and apostrophes.
    got = eval_tok.moses_lc_tokenize(['A man\'s dog, "Rex", isn\'t here.'], "en")
    assert got == ["a man &apos;s dog , &quot; rex , &quot; isn &apos;t here ."]


def test_eval_tok_german_by_hand():
    pytest.importorskip("sacremoses")
    # „ and “ normalize to ", which is escaped; German splits the apostrophe off both sides.
    got = eval_tok.moses_lc_tokenize(["Zwei Männer („Hans“) geht's gut."], "de")
    assert got == ["zwei männer ( &quot; hans &quot; ) geht &apos; s gut ."]


def test_eval_tok_reproduces_the_multi30k_tok_files(multi30k_dir):
    pytest.importorskip("sacremoses")
    tok_dir = next((p for p in (multi30k_dir / "tok", ROOT.parent / "shared" / "corpora" / "multi30k" / "tok")
                    if (p / "test2016.lc.norm.tok.en").is_file()), None)
    if tok_dir is None:
        pytest.skip("no tok/ folder beside the Multi30k copy")
    for lang in ("en", "de"):
        raw = (multi30k_dir / f"test2016.{lang}").read_text(encoding="utf-8").splitlines()
        ref = (tok_dir / f"test2016.lc.norm.tok.{lang}").read_text(encoding="utf-8").splitlines()
        assert eval_tok.moses_lc_tokenize(raw, lang) == ref


def test_eval_tok_keeps_one_line_per_line():
    assert eval_tok.split_lines("a\u2028b\r\nc\n") == ["a\u2028b", "c"]
    assert eval_tok.split_lines("") == []


# ---------------------------------------------------------------- report arithmetic

def test_wall_time_adds_resumed_processes_and_validations():
    records = [
        {"event": "train", "step": 50, "elapsed_s": 100.0},
        {"event": "valid", "step": 50, "valid_s": 20.0, "bleu": 10.0},
        {"event": "train", "step": 100, "elapsed_s": 250.0},  # includes the validation above
        # killed; the resumed process counts from 0 again
        {"event": "train", "step": 150, "elapsed_s": 80.0},
        {"event": "valid", "step": 150, "valid_s": 10.0, "bleu": 20.0},
    ]
    curve = report.validation_curve(records)
    assert [(r["step"], r["wall_s"], r["valid_bleu"]) for r in curve] == [(50, 120.0, 10.0), (150, 340.0, 20.0)]
    assert report.train_wall_time(records) == 340.0
    assert report.train_wall_time([]) == 0.0


def test_report_writes_results_and_curve(tmp_path):
    records = [{"event": "train", "step": 10, "elapsed_s": 30.0},
               {"event": "valid", "step": 10, "valid_s": 5.0, "bleu": 12.5, "chrf": 40.0, "loss": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"torn', encoding="utf-8")
    (tmp_path / "s.json").write_text(json.dumps({"bleu": 30.0, "chrf": 55.0, "ter": 50.0, "signatures": {}}))
    (tmp_path / "t.json").write_text(json.dumps({"bleu": 33.0, "signatures": {"bleu": "case:lc|tok:none"}}))
    report.main(["--run", str(tmp_path), "--sacrebleu", str(tmp_path / "s.json"), "--tok-bleu", str(tmp_path / "t.json"),
                 "--meta", "direction=de-en"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["bleu"], results["tok_bleu_lc"], results["train_wall_s"]) == (30.0, 33.0, 35.0)
    assert results["direction"] == "de-en" and results["best_valid_bleu"] == 12.5
    assert (tmp_path / "bleu_vs_time.csv").read_text().splitlines()[1].startswith("10,35.0,")
    assert (tmp_path / "bleu_vs_time.png").stat().st_size > 0


def test_report_names_the_metric_and_replots_a_saved_curve(tmp_path):
    """lc-tok runs are scored lowercased (case:lc in the signature): the curve's axis says so; a
    committed bleu_vs_time.csv re-plots without its run folder."""
    assert report.bleu_metric("nrefs:1|case:lc|eff:no|tok:none") == "lowercased tokenized BLEU"
    assert report.bleu_metric("nrefs:1|case:mixed|eff:no|tok:13a") == "cased sacreBLEU"
    rows = [{"step": 250, "wall_s": 60.0, "wall_min": 1.0, "valid_bleu": 10.5, "valid_chrf": 30.0, "valid_loss": 4.0},
            {"step": 500, "wall_s": 120.0, "wall_min": 2.0, "valid_bleu": 20.0, "valid_chrf": 40.0, "valid_loss": ""}]
    report.write_curve_csv(rows, tmp_path / "curve.csv")
    back = report.read_curve_csv(tmp_path / "curve.csv")
    assert [(r["step"], r["wall_min"], r["valid_bleu"], r["valid_loss"]) for r in back] == [
        (250.0, 1.0, 10.5, 4.0), (500.0, 2.0, 20.0, None)]
    report.main(["--curve-csv", str(tmp_path / "curve.csv"), "--out", str(tmp_path / "c.png"),
                 "--direction", "en-de", "--test-bleu", "21.0", "--lowercased"])
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        report.main(["--curve-csv", str(tmp_path / "curve.csv")])  # no --out


def test_test_curve_scores_step_checkpoints_at_their_wall_time(tmp_path, monkeypatch, capsys):
    curve = load_script(ROOT / "scripts" / "test_curve.py", "test_curve")
    records = [{"event": "train", "step": 250, "elapsed_s": 60.0}, {"event": "valid", "step": 250, "valid_s": 6.0, "bleu": 20.0},
               {"event": "train", "step": 500, "elapsed_s": 120.0}, {"event": "valid", "step": 500, "valid_s": 6.0, "bleu": 35.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    for name in ("step-500.pt", "step-250.pt", "step-750.pt", "last.pt", "step-x.pt"):
        (tmp_path / name).write_bytes(b"")
    assert [step for step, _ in curve.step_checkpoints(tmp_path)] == [250, 500, 750]  # numeric order
    scored = {"step-250.pt": 21.0, "step-500.pt": 33.0}
    monkeypatch.setattr(curve, "greedy_bleu", lambda path, src, ref: scored[path.name])
    curve.main(["--run", str(tmp_path), "--src", "s", "--ref", "r"])
    out = json.loads(capsys.readouterr().out)
    # step 750 has no validation record (no wall time): skipped; 33.0 >= the peer's 32.5 first at step 500
    assert [p["step"] for p in out["points"]] == [250, 500]
    assert out["first_at_or_above_peer"] == {"step": 500, "wall_min": 2.1, "valid_bleu": 35.0, "test_bleu_greedy": 33.0}
    assert (tmp_path / "test_vs_time.csv").read_text().splitlines()[1] == "250,1.1,20.0,21.0"
    assert (tmp_path / "bleu_vs_time.png").stat().st_size > 0


# ---------------------------------------------------------------- benchmark runner

def test_bench_runner_reads_the_last_json_line_and_tabulates():
    assert bench.last_json_object('note\n{"a": 1}\n{"mtrain_tok_s": 2.5}\n') == {"mtrain_tok_s": 2.5}
    assert bench.last_json_object("no json here\n") is None
    text = bench.table([{"name": "train_step", "wall_s": 3.0, "result": {"mtrain_tok_s": 1234.5}},
                        {"name": "decode", "wall_s": 1.0, "result": None, "error": "exit status 1"}])
    assert "1,234.5" in text and "FAILED: exit status 1" in text


@pytest.mark.slow
def test_recipe_script_end_to_end_smoke(multi30k_dir, tmp_path):
    # The whole script on en-de's lowercased tokenized text for a few updates: tokenize, train, average,
    # score 10 test lines at LENPEN, report. The scores of 4 updates mean nothing; the plumbing does.
    # The config's lr cooldown (3300 updates) must shrink with the run: a longer one is refused.
    env = dict(os.environ)
    env |= {"MULTI30K_TEXT": "lc-tok", "VIRTUAL_ENV": sys.prefix, "PATH": VENV_PATH,
            "RUN": str(tmp_path / "run"), "TOK": str(tmp_path / "tok"), "EVAL_LINES": "10", "LENPEN": "1.0"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-multi30k.sh"), "en-de", "--max-steps", "4",
                           "--set", "train.cooldown_steps=2"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["text"] == "lc-tok" and results["decode"] == "beam 5, lenpen 1.0" and results["eval_lines"] == "10"
    assert results["train_steps"] == 4
    # Trained on lowercased tokenized text, test2016 is scored as it is: lowercased, no re-tokenization.
    assert results["tok_bleu_lc_signature"].startswith("nrefs:1|case:lc|eff:no|tok:none")
    assert len((tmp_path / "run" / "test2016.hyp").read_text().splitlines()) == 10


@pytest.mark.slow
def test_ensemble_recipe_end_to_end_smoke(multi30k_dir, tmp_path):
    # Both models for a few updates, then A + B on 10 test lines: B is scored together with A, inside A's leftover budget.
    env = {k: v for k, v in os.environ.items() if k not in ("MULTI30K_TEXT", "RUN", "TRAIN_HOURS", "ENSEMBLE_WITH")}
    env |= {"VIRTUAL_ENV": sys.prefix, "PATH": VENV_PATH, "RUN_A": str(tmp_path / "a"), "RUN_B": str(tmp_path / "b"),
            "TOK": str(tmp_path / "tok"), "EVAL_LINES": "10", "LENPEN": "1.0",
            "B_SETTINGS": "--set train.seed=2 --set train.max_steps=3 --set train.cooldown_steps=1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recipe-multi30k-ensemble.sh"), "--set", "train.max_steps=4",
                           "--set", "train.cooldown_steps=2"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert a["train_steps"] == 4 and b["train_steps"] == 3  # B's own settings win over the shared ones
    assert b["checkpoint"] == f"{tmp_path / 'b' / 'averaged.pt'} + {tmp_path / 'a' / 'averaged.pt'}"
    assert "model B gets the rest of the 3 h" in proc.stderr

