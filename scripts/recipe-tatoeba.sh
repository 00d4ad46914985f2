#!/usr/bin/env bash
# The Tatoeba de->en recipe, one command: venv -> tokenize -> train to a time budget -> score -> report.
#   scripts/recipe-tatoeba.sh [extra `mtrain train` options, e.g. --set train.max_time=1h]
# Data: data/tatoeba-de-en/ (copied from ../shared/corpora/tatoeba-de-en when the checkout sits beside it).
# Tokenized with --drop-overlap: training pairs that also occur in valid or test are dropped, and the
# counts are in $TOK/stats.json (overlap) and the report.
# Training stops at the config's train.max_time (training time over every resumed invocation), cools
# the lr down over its last part and averages its last checkpoints; re-running the command resumes an
# interrupted run, and a finished one is only reported (each test set is scored once per averaged.pt).
# Writes $RUN/{averaged.pt, <test>.hyp, <test>.json, results.json, bleu_vs_time.csv}.
# RUN=..., TOK=... and DATA=... override the run, tokenized-data and corpus folders; CONFIG=... the config.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/tatoeba-de-en.yaml}
TOK=${TOK:-data/tatoeba-tok}
DATA=${DATA:-data/tatoeba-de-en}
RUN=${RUN:-runs/tatoeba-de-en}
TESTS=(test flores200-devtest newstest2014)

. scripts/setup_env.sh ''
SHARED=../shared/corpora/tatoeba-de-en
if [ ! -f "$DATA/train.de" ]; then
    if [ "$DATA" != data/tatoeba-de-en ] || [ ! -f "$SHARED/train.de" ]; then
        echo "no $DATA/train.de: copy the corpus there (train, valid, $(IFS=,; echo "${TESTS[*]}") as .de and .en files)" >&2
        exit 2
    fi
    rm -rf "$DATA.partial" && mkdir -p "$DATA.partial" "$(dirname "$DATA")"
    cp "$SHARED"/*.de "$SHARED"/*.en "$DATA.partial"/
    rmdir "$DATA" 2>/dev/null || true  # an empty folder left by hand
    mv "$DATA.partial" "$DATA"  # whole or not at all
fi
[ -f "$TOK/meta.json" ] || mtrain tokenize --config "$CONFIG" --data "$DATA" --src de --tgt en \
    --splits "train,valid,$(IFS=,; echo "${TESTS[*]}")" --drop-overlap --out "$TOK"

mtrain train --config "$CONFIG" --data "$TOK" --out "$RUN" "$@"

LENPEN=$(python -c "import sys; from mtrain.config import load_config; print(load_config(sys.argv[1]).decode.lenpen)" \
    "$RUN/config.yaml")
for test in "${TESTS[@]}"; do
    # Scored once per averaged.pt: a run trained further (a larger train.max_time) is scored again.
    [ "$RUN/$test.json" -nt "$RUN/averaged.pt" ] && continue
    echo "scoring $RUN/averaged.pt on $test (beam 5, lenpen $LENPEN)" >&2
    mtrain eval --checkpoint "$RUN/averaged.pt" --src "$TOK/$test.src.txt" --ref "$TOK/$test.tgt.txt" \
        --beam 5 --lenpen "$LENPEN" --output-hyp "$RUN/$test.hyp" --json > "$RUN/$test.json.tmp"
    mv "$RUN/$test.json.tmp" "$RUN/$test.json"
done
python scripts/corpus_report.py --run "$RUN" --data "$TOK" --tests "${TESTS[@]}"
