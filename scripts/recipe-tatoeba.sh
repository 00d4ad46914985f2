#!/usr/bin/env bash
# The Tatoeba de->en recipe, one command: venv -> tokenize -> train to a time budget -> score -> report.
#   scripts/recipe-tatoeba.sh [extra `mtrain train` options, e.g. --set train.max_time=1h]
# Data: data/tatoeba-de-en/ (copied from ../shared/corpora/tatoeba-de-en when the checkout sits beside it).
# Scored on the Tatoeba test, FLORES-200 devtest and newstest2014; scripts/recipe-corpus.sh does the work.
# RUN=..., TOK=... and DATA=... override the run, tokenized-data and corpus folders; CONFIG=... the config.
set -euo pipefail
cd "$(dirname "$0")/.."
export CONFIG=${CONFIG:-configs/tatoeba-de-en.yaml} TOK=${TOK:-data/tatoeba-tok} RUN=${RUN:-runs/tatoeba-de-en}
export CORPORA=${DATA:-data/tatoeba-de-en} TESTS="test flores200-devtest newstest2014"
exec bash scripts/recipe-corpus.sh "$@"
