# The Python environment that quickstart.sh and the recipe scripts run in. Source it from the
# repository root, always with one argument (a sourced file would otherwise see the caller's own):
#   . scripts/setup_env.sh ''            mtrain alone
#   . scripts/setup_env.sh '[export]'    with an extra
#   . scripts/setup_env.sh --activate    only choose and activate the environment (no installs)
#
# Which Python: an activated virtualenv ($VIRTUAL_ENV), or else the python3 on PATH when it belongs to
# an environment (a virtualenv or a conda env, activated or not) that already has torch, e.g. one with
# your CUDA build: a fresh .venv would train on the CPU build instead. Otherwise .venv, made here once.
# torch is installed only where it is missing (TORCH_SPEC, default torch==2.13.0: the CPU build).
#
# mtrain is installed from this checkout, editable. Where pip cannot install from a package index
# (an offline cluster node), the checkout is installed with the setuptools and the dependencies the
# environment already has, and those are checked.

case "${1-}" in
    '' | '['*']' | --activate) ;;
    *) echo "scripts/setup_env.sh: got '$1'; give '' (mtrain alone), an extra such as '[export]', or --activate" >&2
       return 2 ;;
esac

_env_python_has_torch() {
    python3 - 2>/dev/null <<'PY'
import os
import sys

import torch  # noqa: F401  (fails without torch)

conda = os.path.isdir(os.path.join(sys.prefix, "conda-meta"))
sys.exit(0 if sys.prefix != sys.base_prefix or conda else 1)
PY
}

if [ -z "${VIRTUAL_ENV:-}" ] && _env_python_has_torch; then
    # python3's own folder first, so that `python` and the `mtrain` script it installs are that environment's
    PATH="$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
elif [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -d .venv ] || python3 -m venv .venv
    . .venv/bin/activate
fi
if ! command -v python > /dev/null; then
    echo "error: no 'python' beside $(command -v python3); activate a virtualenv or conda env, or remove it from PATH to get .venv" >&2
    return 1
fi
echo "python: $(command -v python) ($(python -c 'import sys; print(sys.prefix)'))" >&2
if [ "${1-}" != --activate ]; then
    python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
    _imports="mtrain.cli, matplotlib, numpy, sentencepiece, sacrebleu, typer, tqdm, yaml"
    [ "${1-}" = '[export]' ] && _imports="$_imports, ctranslate2, transformers, safetensors"
    _pip_log=$(mktemp)
    if ! python -m pip install -q --retries 1 --timeout 15 -e ".${1-}" 2> "$_pip_log"; then
        # Offline: pip's isolated build could not fetch setuptools, so build with the one installed here.
        if python -m pip install -q --no-build-isolation --no-deps -e ".${1-}" 2>> "$_pip_log" \
            && python -c "import $_imports" 2>> "$_pip_log"; then
            echo "note: pip could not install from a package index; installed this checkout with the packages already here" >&2
        else
            cat "$_pip_log" >&2
            echo "error: could not install mtrain${1-} into $(python -c 'import sys; print(sys.prefix)') (see pip above). Offline," \
                "the environment needs setuptools>=77 and these modules already: $_imports" >&2
            rm -f "$_pip_log"
            return 1
        fi
    fi
    rm -f "$_pip_log"
fi
