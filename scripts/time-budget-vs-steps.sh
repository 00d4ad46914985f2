#!/usr/bin/env bash
# A time budget against the best step-count schedule that fits the same time, on Multi30k de->en:
#   scripts/time-budget-vs-steps.sh [BUDGET ...]      (default: 30m 60m; at most one per CPU core)
# 1. Each budget trains `--max-time BUDGET` (the lr cools down over the last third of the time),
#    all at once, each pinned to its own core with one thread.
# 2. Each step-count schedule then trains exactly the updates its budget reached (N), with the
#    lr cooldown over the same last fraction of the updates (train.cooldown_fraction, 0.33 by default:
#    cooldown_steps = 0.33 N): the most updates a step count can ask for and still fit, since it is
#    the same work. Same cores, all at once, so the two phases run under the same load.
# 3. Every averaged.pt is scored on the valid split (beam 5), and scripts/time_budget_report.py prints
#    the table: updates, training time, wall time, final greedy valid BLEU, averaged.pt beam-5 BLEU.
# Everything else is the config's. A finished run is not trained again.
# RUN=... (default runs/time-budget) holds the runs, TOK=... the tokenized Multi30k (default
# data/multi30k-tok-de-en) and CONFIG=... the config (default configs/multi30k-de-en.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then BUDGETS=("$@"); else BUDGETS=(30m 60m); fi
RUN=${RUN:-runs/time-budget}
TOK=${TOK:-data/multi30k-tok-de-en}
CONFIG=${CONFIG:-configs/multi30k-de-en.yaml}
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # the cores this process may use (nproc alone reads OMP_NUM_THREADS)
if [ "${#BUDGETS[@]}" -gt "$CORES" ]; then
    echo "${#BUDGETS[@]} budgets on $CORES cores: give at most $CORES, one per core" >&2; exit 2
fi
. scripts/setup_env.sh ''
. scripts/multi30k_data.sh
[ -f "$TOK/meta.json" ] || mtrain tokenize --config "$CONFIG" "${source_args[@]}" --src de --tgt en --out "$TOK"
mkdir -p "$RUN"
common=(--config "$CONFIG" --data "$TOK" --device cpu --set train.num_threads=1 --set train.keep_every=0)

# Runs each "name: mtrain train options" on its own core at once (pinned where taskset exists);
# records each one's wall seconds; fails if any of them failed.
side_by_side() {
    local core=0 pids=() name failed=0
    for job in "$@"; do
        name=${job%%:*}
        read -r -a options <<< "${job#*:}"
        pin=(); command -v taskset > /dev/null && pin=(taskset -c $core)
        (
            start=$(date +%s)
            OMP_NUM_THREADS=1 "${pin[@]}" mtrain train "${common[@]}" "${options[@]}" --out "$RUN/$name" \
                > "$RUN/$name.log" 2>&1 || { echo "$name failed: see $RUN/$name.log" >&2; exit 1; }
            echo $(( $(date +%s) - start )) > "$RUN/$name.wall_s"
        ) &
        pids+=($!)
        core=$((core + 1))
    done
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    return $failed
}

# The step-count run cools down over the same fraction of its N updates as the budget did of its time
# (train.cooldown_fraction of the time run's config), rounded half up.
cooldown_steps() { python -c "import sys; from mtrain.config import load_config; f = load_config(sys.argv[1]).train.cooldown_fraction; print(int(f * int(sys.argv[2]) + 0.5))" "$RUN/time-$1/config.yaml" "$2"; }
updates() { python -c "import sys; from mtrain import checkpoint; print(checkpoint.load(sys.argv[1], mmap=True)['train_state']['state']['step'])" "$1"; }

jobs=()
for budget in "${BUDGETS[@]}"; do
    [ -f "$RUN/time-$budget/averaged.pt" ] || jobs+=("time-$budget: --max-time $budget --set train.cooldown_steps=0 --set train.max_steps=1000000")
done
[ "${#jobs[@]}" -eq 0 ] || side_by_side "${jobs[@]}"

jobs=()
for budget in "${BUDGETS[@]}"; do
    n=$(updates "$RUN/time-$budget/last.pt")
    [ -f "$RUN/steps-$budget/averaged.pt" ] || jobs+=("steps-$budget: --max-steps $n --set train.cooldown_steps=$(cooldown_steps "$budget" "$n")")
done
[ "${#jobs[@]}" -eq 0 ] || side_by_side "${jobs[@]}"

. scripts/score_once.sh
for budget in "${BUDGETS[@]}"; do
    for run in "$RUN/time-$budget" "$RUN/steps-$budget"; do
        score_once "$run/averaged.pt" "$TOK/valid.src.txt" "$TOK/valid.tgt.txt" "$run/valid.beam5" --beam 5
    done
done
python scripts/time_budget_report.py --run "$RUN" --budgets "${BUDGETS[@]}"
