"""Config: defaults, YAML files, overrides, unknown keys and type coercion."""

from pathlib import Path

import pytest
import yaml

from mtrain.config import Config, config_from_dict, load_config, to_dict, to_yaml
from mtrain.errors import MtrainError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_defaults_are_the_paper_base_model():
    cfg = load_config()
    assert (cfg.model.d_model, cfg.model.d_ff, cfg.model.n_heads) == (512, 2048, 8)
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_eps) == (0.9, 0.98, 1e-9)
    assert cfg.train.label_smoothing == 0.1


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # Every key the file states must differ from the default (the files state differences only).
    stated = yaml.safe_load(path.read_text())
    defaults = to_dict(Config())
    for section, values in stated.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) != defaults[section][key], f"{path.name}: {section}.{key} repeats the default"


def test_override_coerces_types():
    cfg = load_config(None, ["train.lr_scale=3e-4", "train.max_steps=1e3", "model.share_embeddings=false"])
    assert cfg.train.lr_scale == pytest.approx(3e-4) and isinstance(cfg.train.lr_scale, float)
    assert cfg.train.max_steps == 1000 and isinstance(cfg.train.max_steps, int)
    assert cfg.model.share_embeddings is False


def test_yaml_string_float_is_coerced(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr_scale: 3e-4\n")  # PyYAML reads 3e-4 as a string
    assert load_config(path).train.lr_scale == pytest.approx(3e-4)


def test_off_and_no_stay_strings_where_a_string_is_expected(tmp_path):
    """YAML 1.1 reads off/no as False; `amp: off` and Norwegian `src: no` must survive as text,
    while boolean keys still take yes/no/on/off."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  amp: off\n  compile: on\ndata:\n  src: no\n")
    cfg = load_config(path, ["model.share_embeddings=no", "data.tgt=yes"])
    assert (cfg.train.amp, cfg.data.src, cfg.data.tgt) == ("off", "no", "yes")
    assert cfg.train.compile is True and cfg.model.share_embeddings is False
    assert load_config(None, ["train.amp=off"]).train.amp == "off"


def test_later_override_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 5\n")
    assert load_config(path, ["train.max_steps=7"]).train.max_steps == 7


def test_unknown_key_lists_valid_keys():
    with pytest.raises(MtrainError) as err:
        load_config(None, ["train.max_step=10"])
    message = str(err.value)
    assert "train.max_step" in message and "max_steps" in message and "\n" not in message


def test_unknown_section():
    with pytest.raises(MtrainError, match="valid sections"):
        load_config(None, ["optim.lr=1"])


def test_wrong_type_names_key():
    with pytest.raises(MtrainError, match="train.max_steps"):
        load_config(None, ["train.max_steps=lots"])
    with pytest.raises(MtrainError, match="expected an integer"):
        load_config(None, ["train.max_steps=2.5"])


def test_malformed_override():
    with pytest.raises(MtrainError, match="section.key=value"):
        load_config(None, ["max_steps"])


def test_yaml_round_trip():
    cfg = load_config(None, ["model.d_model=256", "decode.beam=4"])
    assert config_from_dict(yaml.safe_load(to_yaml(cfg))) == cfg


def test_missing_config_file(tmp_path):
    with pytest.raises(MtrainError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_log_to_is_a_list_from_yaml_or_comma_separated_text(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  log_to: [tensorboard, wandb]\n", encoding="utf-8")
    assert load_config(path).train.log_to == ("tensorboard", "wandb")
    assert load_config(None, ["train.log_to=wandb,tensorboard"]).train.log_to == ("wandb", "tensorboard")
    assert load_config(None, ["train.log_to="]).train.log_to == ()
    cfg = load_config(None, ["train.log_to=tensorboard"])
    assert config_from_dict(to_dict(cfg)) == cfg and "- tensorboard" in to_yaml(cfg)


def test_unknown_log_to_target_is_a_one_line_error():
    with pytest.raises(MtrainError, match=r"^train\.log_to: unknown 'tensorbord'; use tensorboard and/or wandb") as err:
        load_config(None, ["train.log_to=tensorbord"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("module", ["mtrain", "mtrain.cli"])
def test_help_lists_every_command_however_the_cli_is_started(module):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for command in ("tokenize", "train", "translate", "eval", "average", "score", "export"):
        assert command in done.stdout
