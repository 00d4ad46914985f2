#!/usr/bin/env bash
# A corpus recipe, one command: venv -> tokenize -> train to a time budget -> score -> report.
# scripts/recipe-tatoeba.sh and scripts/recipe-mixed.sh set what it trains on; called directly:
#   CONFIG=configs/x.yaml CORPORA="[NAME=]DIR ..." TESTS="split ..." RUN=runs/x TOK=data/x-tok \
#       scripts/recipe-corpus.sh [extra `mtrain train` options, e.g. --set train.max_time=1h]
# CORPORA: one folder, or several mixed by the config's data.weights; each evaluation split (valid
# and the TESTS) comes from the first corpus that has it. A corpus folder data/X that does not exist
# yet is copied from ../shared/corpora/X when the checkout sits beside it.
# Tokenized with --drop-overlap: training pairs whose source line occurs in valid or a test are dropped,
# and the counts are in $TOK/stats.json (overlap) and the report. The language pair is the config's
# data.src and data.tgt (de and en by default).
# Training stops at the config's train.max_time (training time over every resumed invocation), cools
# the lr down over its last part and averages its last checkpoints; re-running the command resumes an
# interrupted run, and a finished one is only reported (each test set is scored once per averaged.pt).
# Writes $RUN/{averaged.pt, <test>.hyp, <test>.json, results.json, bleu_vs_time.csv}.
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a TEST_SPLITS <<< "${TESTS:-}"
read -r -a CORPUS_SPECS <<< "${CORPORA:-}"
if [ -z "${CONFIG:-}" ] || [ -z "${RUN:-}" ] || [ -z "${TOK:-}" ] || [ "${#CORPUS_SPECS[@]}" -eq 0 ] \
    || [ "${#TEST_SPLITS[@]}" -eq 0 ]; then
    echo "$0: set CONFIG, CORPORA, TESTS, RUN and TOK (see the comment at the top of this script)" >&2
    exit 2
fi

. scripts/setup_env.sh ''
data_args=()
for spec in "${CORPUS_SPECS[@]}"; do
    [[ "$spec" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*= ]] && name=${spec%%=*}= dir=${spec#*=} || name="" dir=$spec  # as `--data`
    dir=${dir%/} && dir=${dir#./}
    shared=../shared/corpora/$(basename "$dir")
    if ! compgen -G "$dir/train.*" > /dev/null; then
        if [ "$(dirname "$dir")" != data ] || [ ! -d "$shared" ]; then
            echo "no training split in $dir: put its train, valid and test files there (e.g. train.de + train.en)" >&2
            exit 2
        fi
        mkdir -p "$dir"  # it may hold other files already (tok/): those stay
        for file in "$shared"/*; do
            name_only=$(basename "$file")
            case "$name_only" in
                train.*) cp "$file" "$dir/.$name_only.partial" ;;
                *) [ -e "$dir/$name_only" ] || cp -r "$file" "$dir/" ;;
            esac
        done
        for file in "$shared"/train.*; do  # the training files last: their presence means a whole copy
            mv "$dir/.$(basename "$file").partial" "$dir/$(basename "$file")"
        done
    fi
    data_args+=(--data "$name$dir")
done
[ -f "$TOK/meta.json" ] || mtrain tokenize --config "$CONFIG" "${data_args[@]}" \
    --splits "train,valid,$(IFS=,; echo "${TEST_SPLITS[*]}")" --drop-overlap --out "$TOK"

mtrain train --config "$CONFIG" --data "$TOK" --out "$RUN" "$@"

LENPEN=$(python -c "import sys; from mtrain.config import load_config; print(load_config(sys.argv[1]).decode.lenpen)" \
    "$RUN/config.yaml")
. scripts/score_once.sh
for test in "${TEST_SPLITS[@]}"; do  # once per averaged.pt: a run trained further is scored again
    score_once "$RUN/averaged.pt" "$TOK/$test.src.txt" "$TOK/$test.tgt.txt" "$RUN/$test" --beam 5 --lenpen "$LENPEN"
done
python scripts/corpus_report.py --run "$RUN" --data "$TOK" --tests "${TEST_SPLITS[@]}"
