"""scripts/setup_env.sh, the environment setup of the quickstart and the recipe scripts, run
against stand-in `python3` and `python` programs that answer its questions and log what pip is
asked to do: which environment it picks, what it installs, and what it does without a package index."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The stand-in interpreter: "has torch" unless NO_TORCH is set, its folder as sys.executable's,
# FAKE_PREFIX as sys.prefix; pip calls are logged, and the first one fails when OFFLINE is set.
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
  -)  [ -z "${NO_TORCH:-}" ] ;;  # the environment check (a heredoc on stdin)
  "-c import torch") [ -z "${NO_TORCH:-}" ] ;;
  *"print(os.path.dirname(sys.executable))"*) dirname "$0" ;;
  *"print(sys.prefix)"*) echo "$FAKE_PREFIX" ;;
  "-m pip "*) echo "$*" >> "$PIP_LOG"
              if [ -n "${OFFLINE:-}" ] && [ ! -e "$PIP_LOG.failed" ]; then touch "$PIP_LOG.failed"; exit 1; fi ;;
  "-c import "*) ;;  # the offline import check
  *) echo "unexpected: $*" >&2; exit 3 ;;
esac
"""


@pytest.fixture
def fake_env(tmp_path):
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python3", "python"):
        (bin_dir / name).write_text(FAKE_PYTHON)
        (bin_dir / name).chmod(0o755)
    work = tmp_path / "checkout"
    (work / "scripts").mkdir(parents=True)
    (work / "scripts" / "setup_env.sh").write_text((ROOT / "scripts" / "setup_env.sh").read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_PREFIX=str(tmp_path / "env"), PIP_LOG=str(tmp_path / "pip.log"))

    def source(argument: str, caller_args: str = "--set train.num_threads=2", **extra: str):
        script = f"set -euo pipefail; set -- {caller_args}; . scripts/setup_env.sh {argument}; echo \"args: $*\""
        proc = subprocess.run(["bash", "-c", script], cwd=work, env={**env, **extra}, capture_output=True, text=True)
        log = Path(env["PIP_LOG"])
        return proc, log.read_text().splitlines() if log.exists() else []

    return source, work


def test_an_environment_that_has_torch_is_used_and_mtrain_installed_into_it(fake_env):
    source, work = fake_env
    proc, pip = source("''")
    assert proc.returncode == 0, proc.stderr
    assert not (work / ".venv").exists()
    assert pip == ["-m pip install -q --retries 1 --timeout 15 -e ."]  # torch is there: only mtrain
    assert proc.stdout.strip() == "args: --set train.num_threads=2"  # the caller's own arguments are intact


def test_an_extra_is_installed_and_activate_installs_nothing(fake_env):
    source, _ = fake_env
    proc, pip = source("'[export]'")
    assert proc.returncode == 0, proc.stderr
    assert pip == ["-m pip install -q --retries 1 --timeout 15 -e .[export]"]
    proc, pip_after = source("--activate")
    assert proc.returncode == 0 and pip_after == pip


def test_without_a_package_index_the_checkout_is_installed_from_what_is_there(fake_env):
    source, _ = fake_env
    proc, pip = source("''", OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert pip[1] == "-m pip install -q --no-build-isolation --no-deps -e ."
    assert "could not install from a package index" in proc.stderr


@pytest.mark.parametrize("argument", ["--set", "'.[export]'", "export"])
def test_anything_but_one_of_its_arguments_stops_it(fake_env, argument):
    source, _ = fake_env
    proc, pip = source(argument)
    assert proc.returncode == 2 and pip == []
    assert re.search(r"give '' \(mtrain alone\), an extra such as '\[export\]', or --activate", proc.stderr)


def test_every_script_passes_it_one_argument():
    """A file sourced without arguments sees its caller's: a recipe's own train options became pip
    extras that way."""
    lines = [line for path in (ROOT / "scripts").glob("*.sh") for line in path.read_text().splitlines()]
    calls = [line for line in lines if re.match(r"\s*\. scripts/setup_env\.sh", line)]
    uses = [line for line in lines if ". scripts/setup_env.sh" in line and not line.lstrip().startswith("#")]
    assert len(calls) >= 5 and len(calls) == len(uses)  # the pattern misses no call
    for line in calls:
        assert re.match(r"\s*\. scripts/setup_env\.sh ('[^']*'|--activate)(\s|$)", line), line
