#!/usr/bin/env bash
# Multi30k + Tatoeba de->en in one model, one command: venv -> tokenize -> train -> score -> report.
#   scripts/recipe-mixed.sh [extra `mtrain train` options]
# The two corpora are tokenized together (one vocabulary; training pairs of either whose source line
# occurs in an evaluation split are dropped)
# and mixed by configs/mixed-de-en.yaml's data.weights. Validation is on Multi30k's valid split; scored
# on Multi30k test2016, the Tatoeba test, FLORES-200 devtest and newstest2014 (scripts/recipe-corpus.sh).
# scripts/mixing_table.py then sets it beside the single-corpus recipes' models.
# RUN=... and TOK=... override the run and tokenized-data folders, CONFIG=... the config, and
# CORPORA="multi30k=DIR tatoeba=DIR" the corpus folders.
set -euo pipefail
cd "$(dirname "$0")/.."
export CONFIG=${CONFIG:-configs/mixed-de-en.yaml} TOK=${TOK:-data/mixed-tok} RUN=${RUN:-runs/mixed-de-en}
export CORPORA=${CORPORA:-multi30k=data/multi30k tatoeba=data/tatoeba-de-en} TESTS="test2016 test flores200-devtest newstest2014"
exec bash scripts/recipe-corpus.sh "$@"
