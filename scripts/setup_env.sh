# The Python environment that quickstart.sh and the recipe scripts run in. Source it from the
# repository root:  . scripts/setup_env.sh [EXTRAS]     (EXTRAS e.g. '[export]')
#
# Which Python: an activated virtualenv ($VIRTUAL_ENV), or else the python3 on PATH when it belongs to
# an environment (a virtualenv or the active conda env) that already has torch, e.g. one with your
# CUDA build: a fresh .venv would train on the CPU build instead. Otherwise .venv, made here once.
# torch is installed only where it is missing (TORCH_SPEC, default torch==2.13.0: the CPU build).
#
# mtrain is installed from this checkout, editable. Where pip reaches no package index (an offline
# cluster node), its isolated build cannot fetch setuptools; the checkout is then installed with the
# setuptools and dependencies the environment already has, and the dependencies are checked.

_active_env_has_torch() {
    python3 - 2>/dev/null <<'PY'
import os
import sys

import torch  # noqa: F401  (fails without torch)

sys.exit(0 if sys.prefix != sys.base_prefix or os.environ.get("CONDA_PREFIX") == sys.prefix else 1)
PY
}

if [ -z "${VIRTUAL_ENV:-}" ] && ! _active_env_has_torch; then
    [ -d .venv ] || python3 -m venv .venv
    . .venv/bin/activate
fi
echo "python: $(command -v python) ($(python -c 'import sys; print(sys.prefix)'))" >&2
python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
_pip_log=$(mktemp)
if ! python -m pip install -q --retries 1 --timeout 15 -e ".${1:-}" 2> "$_pip_log"; then
    if python -c "import setuptools" 2>/dev/null && python -m pip install -q --no-build-isolation --no-deps -e ".${1:-}" 2>> "$_pip_log" \
        && python -c "import mtrain.cli, numpy, sentencepiece, sacrebleu, typer, tqdm, yaml" 2>> "$_pip_log"; then
        echo "note: pip reached no package index; installed this checkout with the packages already here" >&2
    else
        cat "$_pip_log" >&2
        echo "error: could not install mtrain into $(python -c 'import sys; print(sys.prefix)'): see pip's messages above" >&2
        rm -f "$_pip_log"
        return 1
    fi
fi
rm -f "$_pip_log"
