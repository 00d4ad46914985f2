#!/usr/bin/env bash
# The Multi30k en->de ensemble recipe, one command: model A (the default config), then model B (the same config,
# seed 2, 5500 updates with the lr cooldown over the last 1800), then A and B decoded together on test2016.
#   scripts/recipe-multi30k-ensemble.sh [extra `mtrain train` options for both models]
# TOTAL_HOURS (default 3) caps A's and B's training wall time together: B's TRAIN_HOURS is what A left, so a
# slow host shortens B (its last checkpoints are averaged at the cap) instead of overrunning the budget.
# B_SETTINGS (default: --set train.seed=2 --set train.max_steps=5500 --set train.cooldown_steps=1800) are B's own
# options; they follow the extra options, so they win over the same keys given with --set.
# RUN_A and RUN_B name the run folders (default runs/multi30k-en-de and runs/multi30k-en-de-seed2).
# Re-running resumes whichever model is unfinished; finished ones are only re-scored.
# Results: RUN_A/results.json (A alone) and RUN_B/results.json (A + B; the checkpoint field names both).
# Why this shape (B shorter than A, seed 2) and what it scored: docs/recipe.md#ensembles.
# TRAIN_HOURS, when set, caps A alone (as in recipe-multi30k.sh). DRY_RUN=1 prints the two recipe commands and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_A=${RUN_A:-runs/multi30k-en-de}
RUN_B=${RUN_B:-runs/multi30k-en-de-seed2}
TOTAL_HOURS=${TOTAL_HOURS:-3}
read -ra B_ARGS <<< "${B_SETTINGS:---set train.seed=2 --set train.max_steps=5500 --set train.cooldown_steps=1800}"
if [ -n "${DRY_RUN:-}" ]; then
    echo "RUN=$RUN_A TRAIN_HOURS=${TRAIN_HOURS:-2.75} scripts/recipe-multi30k.sh en-de $*"
    echo "RUN=$RUN_B TRAIN_HOURS=<$TOTAL_HOURS h minus A's training time> ENSEMBLE_WITH=$RUN_A scripts/recipe-multi30k.sh en-de $* ${B_ARGS[*]}"
    exit 0
fi
# The caller's MULTI30K_TEXT or RUN must not leak into the two runs: both use the en-de default text.
unset MULTI30K_TEXT RUN ENSEMBLE_WITH

RUN=$RUN_A scripts/recipe-multi30k.sh en-de "$@"
. scripts/setup_env.sh --activate  # the environment the first recipe run chose
USED_A=$(python scripts/recipe_report.py --run "$RUN_A" --elapsed)
LEFT_B=$(awk -v h="$TOTAL_HOURS" -v used="$USED_A" 'BEGIN { printf "%d", h * 3600 - used }')  # seconds
if [ "$LEFT_B" -lt 300 ]; then
    echo "model A trained ${USED_A} s, leaving under 5 minutes of TOTAL_HOURS=$TOTAL_HOURS for model B; raise TOTAL_HOURS" >&2
    exit 2
fi
HOURS_B=$(awk -v s="$LEFT_B" 'BEGIN { printf "%.4f", s / 3600 }')
echo "model A trained ${USED_A} s; model B gets the rest of the ${TOTAL_HOURS} h: ${HOURS_B} h" >&2
# B's own settings come last, so they win over the caller's (the same seed twice would train A again).
RUN=$RUN_B TRAIN_HOURS=$HOURS_B ENSEMBLE_WITH=$RUN_A scripts/recipe-multi30k.sh en-de "$@" "${B_ARGS[@]}"
