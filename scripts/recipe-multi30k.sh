#!/usr/bin/env bash
# The Multi30k recipe, one command: venv -> tokenize -> train -> evaluate on test2016 -> report.
#   scripts/recipe-multi30k.sh [de-en|en-de] [extra `mtrain train` options, e.g. --set train.num_threads=2]
# Uses configs/multi30k-<dir>.yaml for tokenize AND train (the vocabulary is part of the config).
# Re-running the same command resumes training where it stopped; a finished run is only re-scored.
# Writes runs/multi30k-<dir>/{averaged.pt, test2016.hyp, results.json, bleu_vs_time.csv, bleu_vs_time.png}.
# TRAIN_HOURS (default 2.75) caps training wall time over all resumed invocations together: at the
# cap training stops (SIGTERM: the step finishes, last.pt is saved), the last train.average_last step
# checkpoints are averaged, and the run is scored; re-running after that only re-scores.
# On a quiet 2-core machine max_steps ends first (de-en: 35.2 min measured in bf16, see docs/recipe.md).
# RUN=... and TOK=... override the run and tokenized-data folders; EVAL_LINES=N scores only the first
# N test sentences (a smoke test of the script, not a result).
# MULTI30K_TEXT=lc-tok trains on the Multi30k repo's lowercased Moses-tokenized files (tok/*.lc.norm.tok.*), as the
# papers reporting tokenized BLEU usually do, into runs/multi30k-<dir>-lctok; every score is then lowercased
# tokenized (there is no cased output to score). MULTI30K_TEXT=raw trains on the original text.
# Default: raw for both directions, so the model writes real (cased, detokenized) text; lc-tok gained en-de 0.64
# valid BLEU and nothing on test2016 (docs/recipe.md).
# LENPEN=x scores with length penalty x instead of the config's decode.lenpen.
# ENSEMBLE_WITH=OTHER_RUN scores this run's averaged.pt together with OTHER_RUN/averaged.pt, as an ensemble
# (e.g. a second seed of the same config on the same tokenized data; docs/recipe.md#ensembles).
# DRY_RUN=1 prints the resolved direction, text, config and folders and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-de-en}
[ $# -gt 0 ] && shift
case "$DIR" in
    de-en) SRC=de TGT=en ;;
    en-de) SRC=en TGT=de ;;
    *) echo "usage: $0 [de-en|en-de] [mtrain train options]" >&2; exit 2 ;;
esac
export MULTI30K_TEXT=${MULTI30K_TEXT:-raw}
case "$MULTI30K_TEXT" in
    raw) VARIANT="" ;;
    lc-tok) VARIANT=-lctok ;;
    *) echo "MULTI30K_TEXT=$MULTI30K_TEXT: use MULTI30K_TEXT=raw (the original text, the default) or MULTI30K_TEXT=lc-tok (lowercased tokenized)" >&2; exit 2 ;;
esac
CONFIG=configs/multi30k-$DIR.yaml
TOK=${TOK:-data/multi30k-tok-$DIR$VARIANT}
RUN=${RUN:-runs/multi30k-$DIR$VARIANT}
ENSEMBLE_WITH=${ENSEMBLE_WITH:-}
OTHER_CKPT=${ENSEMBLE_WITH:+$ENSEMBLE_WITH/averaged.pt}  # the ensemble's second member, when ENSEMBLE_WITH is set
if [ -n "$OTHER_CKPT" ] && [ ! -f "$OTHER_CKPT" ]; then  # fail now, not after training
    echo "ENSEMBLE_WITH=$ENSEMBLE_WITH: no averaged.pt there; finish that run first (RUN=$ENSEMBLE_WITH $0 $DIR)" >&2; exit 2
fi
# A fresh run needs a training budget: `timeout 0` would mean no limit at all, and a negative one is an error.
if ! [[ "${TRAIN_HOURS:-2.75}" =~ ^[0-9]*\.?[0-9]+$ ]]; then
    echo "TRAIN_HOURS=${TRAIN_HOURS}: give the training budget in hours as a number, e.g. TRAIN_HOURS=1.5" >&2; exit 2
fi
BUDGET=$(awk -v h="${TRAIN_HOURS:-2.75}" 'BEGIN { printf "%d", h * 3600 }')
if [ ! -f "$RUN/metrics.jsonl" ] && [ "$BUDGET" -lt 60 ]; then
    echo "TRAIN_HOURS=${TRAIN_HOURS:-2.75} gives $RUN under a minute of training; raise it (e.g. TRAIN_HOURS=1.5)" >&2; exit 2
fi
if [ -n "${DRY_RUN:-}" ]; then
    echo "direction=$DIR text=$MULTI30K_TEXT config=$CONFIG tok=$TOK run=$RUN${ENSEMBLE_WITH:+ ensemble_with=$ENSEMBLE_WITH}"; exit 0
fi

# A virtualenv or conda env with torch already (e.g. your CUDA build), else .venv with the CPU build.
. scripts/setup_env.sh ''
# sacremoses (Moses tokenizer in Python) for the lowercased tokenized BLEU; pinned in benchmarks/requirements.txt.
# Without it (and no package index to fetch it from) only that score is skipped.
python -c "import sacremoses" 2>/dev/null || python -m pip install -q --retries 1 --timeout 15 \
    "$(grep -E '^sacremoses' benchmarks/requirements.txt | cut -d'#' -f1 | xargs)" || true

# The corpus: a local copy (filled from a shared folder beside the checkout) or Hugging Face.
. scripts/multi30k_data.sh
# The Moses-tokenized, lowercased references of the Multi30k repo (the papers' BLEU); optional.
. scripts/tok_bleu.sh
TOKREF=$(find_tokref test2016 $TGT)
if [ -n "$TOKREF" ] && [ "$MULTI30K_TEXT" = raw ] && ! python -c "import sacremoses" 2>/dev/null; then
    echo "note: sacremoses is not installed here, so the lowercased tokenized BLEU is skipped (pip install sacremoses)" >&2
    TOKREF=""
fi

[ -f "$TOK/meta.json" ] || mtrain tokenize --config "$CONFIG" "${source_args[@]}" --src $SRC --tgt $TGT --out "$TOK"
USED=$(python scripts/recipe_report.py --run "$RUN" --elapsed)
LEFT=$((BUDGET - USED))
# Less than 5 minutes left is not worth a restart (the log misses a few seconds per process anyway).
if [ "$LEFT" -lt 300 ] && [ -f "$RUN/metrics.jsonl" ]; then
    echo "training budget of ${TRAIN_HOURS:-2.75} h used up (${USED} s logged); scoring only (raise TRAIN_HOURS to train on)" >&2
else
    rc=0
    timeout --signal=TERM --kill-after=600 "$LEFT" mtrain train --config "$CONFIG" --data "$TOK" --out "$RUN" "$@" || rc=$?
    if [ "$rc" -eq 124 ]; then
        echo "training stopped at the ${TRAIN_HOURS:-2.75} h budget" >&2
    elif [ "$rc" -ne 0 ]; then
        exit "$rc"
    fi
fi
if [ ! -f "$RUN/averaged.pt" ] || [ "$RUN/last.pt" -nt "$RUN/averaged.pt" ]; then
    # Stopped by the budget (or a signal) before train averaged: average the last step checkpoints here.
    # The run's own config.yaml (written by train) holds --set overrides such as train.average_last.
    RUN_CONFIG="$RUN/config.yaml"; [ -f "$RUN_CONFIG" ] || RUN_CONFIG=$CONFIG
    K=$(python -c "from mtrain.config import load_config; print(load_config('$RUN_CONFIG').train.average_last)")
    mapfile -t STEPS < <(ls "$RUN"/step-*.pt 2>/dev/null | sort -V | tail -n "$K")
    if [ "${#STEPS[@]}" -gt 0 ]; then mtrain average "${STEPS[@]}" --out "$RUN/averaged.pt"; fi
fi

# The average of the last step checkpoints (train.average_last) scores above best.pt.
CKPT="$RUN/averaged.pt"; [ -f "$CKPT" ] || CKPT="$RUN/best.pt"
TEST_SRC="$TOK/test2016.src.txt" TEST_REF="$TOK/test2016.tgt.txt"
if [ -n "${EVAL_LINES:-}" ]; then
    mkdir -p "$RUN/eval-subset"
    head -n "$EVAL_LINES" "$TEST_SRC" > "$RUN/eval-subset/src"; TEST_SRC="$RUN/eval-subset/src"
    head -n "$EVAL_LINES" "$TEST_REF" > "$RUN/eval-subset/ref"; TEST_REF="$RUN/eval-subset/ref"
    if [ -n "$TOKREF" ]; then head -n "$EVAL_LINES" "$TOKREF" > "$RUN/eval-subset/tokref"; TOKREF="$RUN/eval-subset/tokref"; fi
fi
# The length penalty is the config's decode.lenpen (chosen on the valid split; see docs/recipe.md),
# unless LENPEN=x is given (e.g. a text or setting whose own valid sweep chose another one).
LENPEN=${LENPEN:-$(python -c "from mtrain.config import load_config; print(load_config('$CONFIG').decode.lenpen)")}
CKPT_ARGS=(--checkpoint "$CKPT")
[ -n "$OTHER_CKPT" ] && CKPT_ARGS+=(--checkpoint "$OTHER_CKPT")
echo "scoring $CKPT${OTHER_CKPT:+ with $OTHER_CKPT (ensemble)} on test2016 (beam 5, lenpen $LENPEN)" >&2
# Trained on lowercased tokenized text, the output has that form too: score it as it is.
score_args=(); [ "$MULTI30K_TEXT" = lc-tok ] && score_args=(--lowercase --tokenize none)
mtrain eval "${CKPT_ARGS[@]}" --src "$TEST_SRC" --ref "$TEST_REF" --beam 5 --lenpen "$LENPEN" \
    --output-hyp "$RUN/test2016.hyp" "${score_args[@]}" --json > "$RUN/test2016.sacrebleu.json"
tok_args=()
if [ -n "$TOKREF" ]; then
    tok_bleu "$RUN/test2016.hyp" "$TOKREF" $TGT "$RUN/test2016.hyp.lc.tok" "$RUN/test2016.tok-bleu.json"
    tok_args=(--tok-bleu "$RUN/test2016.tok-bleu.json")
else
    echo "note: no tok/test2016.lc.norm.tok.$TGT (data/multi30k/tok or $MULTI30K_SHARED/tok); skipping tokenized BLEU" >&2
fi
python scripts/recipe_report.py --run "$RUN" --sacrebleu "$RUN/test2016.sacrebleu.json" "${tok_args[@]}" \
    --meta direction=$DIR --meta config=$CONFIG --meta checkpoint="$CKPT${OTHER_CKPT:+ + $OTHER_CKPT}" --meta decode="beam 5, lenpen $LENPEN" \
    --meta text=$MULTI30K_TEXT --meta tok_ref="${TOKREF:-none}" --meta eval_lines="${EVAL_LINES:-all}" --meta train_hours_cap="${TRAIN_HOURS:-2.75}"
cat "$RUN/results.json"
