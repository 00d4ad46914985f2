#!/usr/bin/env bash
# Multi30k en->de, one model learned from models of the anchor's regime, one command:
#   scripts/recipe-multi30k-anchor-distill.sh [extra `mtrain train` options for the student]
# 1. tokenize the original text with the en->de vocabulary (TOK, default data/multi30k-tok-en-de);
# 2. one teacher per seed in SEEDS (default "2 3") from configs/multi30k-en-de-teacher.yaml (the anchor's
#    transformer_tiny regime: 8000 updates of 8192 tokens, the last 10 epoch checkpoints averaged), into
#    TEACHERS_DIR/seed-S (default runs/multi30k-en-de-teacher/seed-S); TEACHER_SETTINGS adds options to each;
# 3. scripts/recipe-multi30k-distill.sh en-de with those teachers decoded together: their beam-5 translations
#    of the training sources, the student (configs/multi30k-en-de-student.yaml, one en->de recipe model), its
#    int8 export and the report on test2016, lowercased tokenized BLEU included (DISTILL, default
#    runs/multi30k-en-de-anchor-distill).
# On 2 CPU cores with native bf16 a teacher took 85.5-100.7 min and the student 46.9 min, about 4 hours in
# all (docs/recipe.md#one-model-learned-from-two-models-of-the-anchors-regime). SIDE_BY_SIDE=1 trains the
# teachers at once, each in its own process with its share of the CPU threads and its log in
# TEACHERS_DIR/seed-S.log: the fast way on a GPU, whose kernels a model this small cannot fill (four took
# 7 minutes on one H100), and no gain on a CPU, whose cores they would share.
# Every stage is skipped when its output exists, so re-running resumes where it stopped (a teacher from
# its last.pt). CORPUS (default data/multi30k) holds {train,valid,test2016}.{en,de}. DRY_RUN=1 prints the stages.
# WITH_ORIGINAL=1 (passed on to the distillation) trains the student on the original pairs too: in one run,
# 41.31 lowercased tokenized BLEU against 40.82 on the distilled pairs alone (docs/recipe.md); give it its own
# DISTILL folder when one built without it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/multi30k-en-de-teacher.yaml
TOK=${TOK:-data/multi30k-tok-en-de}
TEACHERS_DIR=${TEACHERS_DIR:-runs/multi30k-en-de-teacher}
DISTILL=${DISTILL:-runs/multi30k-en-de-anchor-distill}
CORPUS=${CORPUS:-data/multi30k}
read -ra SEED_LIST <<< "${SEEDS:-2 3}"
read -ra TEACHER_ARGS <<< "${TEACHER_SETTINGS:-}"
if [ "${#SEED_LIST[@]}" -lt 1 ]; then
    echo "SEEDS is empty: give one seed per teacher, e.g. SEEDS=\"2 3\"" >&2; exit 2
fi
for s in "${SEED_LIST[@]}"; do
    [[ "$s" =~ ^[0-9]+$ ]] || { echo "SEEDS=${SEEDS:-}: '$s' is not a seed; give whole numbers, e.g. SEEDS=\"2 3\"" >&2; exit 2; }
done
if [ "$(printf '%s\n' "${SEED_LIST[@]}" | sort -u | wc -l)" -ne "${#SEED_LIST[@]}" ]; then
    echo "SEEDS=${SEEDS:-}: a seed twice would train the same teacher twice; give distinct seeds" >&2; exit 2
fi
TEACHERS=(); for s in "${SEED_LIST[@]}"; do TEACHERS+=("$TEACHERS_DIR/seed-$s/averaged.pt"); done
teacher_command() {  # COMMAND = the training command of the teacher with seed $1
    COMMAND=(mtrain train --config "$CONFIG" --data "$TOK" --out "$TEACHERS_DIR/seed-$1" --set "train.seed=$1"
             "${TEACHER_ARGS[@]}")
}
if [ -n "${DRY_RUN:-}" ]; then
    echo "1. tokenize $CORPUS -> $TOK (vocabulary of $CONFIG)"
    for s in "${SEED_LIST[@]}"; do teacher_command "$s"; echo "2. teacher, seed $s: ${COMMAND[*]}"; done
    [ -n "${SIDE_BY_SIDE:-}" ] && echo "   the ${#SEED_LIST[@]} teachers side by side"
    echo "3. TEACHER=\"${TEACHERS[*]}\" DISTILL=$DISTILL${WITH_ORIGINAL:+ WITH_ORIGINAL=$WITH_ORIGINAL} scripts/recipe-multi30k-distill.sh en-de $*"
    exit 0
fi

. scripts/setup_env.sh ''
. scripts/multi30k_data.sh
for split in train valid test2016; do
    for lang in en de; do
        [ -f "$CORPUS/$split.$lang" ] || { echo "CORPUS=$CORPUS: no $split.$lang; copy Multi30k's {train,valid,test2016}.{en,de} there (the teachers translate its training sources)" >&2; exit 2; }
    done
done
[ -f "$TOK/meta.json" ] || mtrain tokenize --config "$CONFIG" --data "$CORPUS" --src en --tgt de --out "$TOK"

# 2. The teachers: in turn, or side by side with the CPU threads shared out among them.
pids=()
for s in "${SEED_LIST[@]}"; do
    [ -f "$TEACHERS_DIR/seed-$s/averaged.pt" ] && continue
    teacher_command "$s"
    if [ -n "${SIDE_BY_SIDE:-}" ]; then
        threads=$(( $(nproc) / ${#SEED_LIST[@]} )); [ "$threads" -ge 1 ] || threads=1
        mkdir -p "$TEACHERS_DIR"
        "${COMMAND[@]}" --set "train.num_threads=$threads" > "$TEACHERS_DIR/seed-$s.log" 2>&1 &
        pids+=($!)
    else
        "${COMMAND[@]}"
    fi
done
for pid in "${pids[@]}"; do
    wait "$pid" || { echo "a teacher trained side by side failed; see $TEACHERS_DIR/seed-*.log" >&2; exit 1; }
done

# 3. Their ensemble's translations, the student, its export and the report.
TEACHER="${TEACHERS[*]}" DISTILL="$DISTILL" CORPUS="$CORPUS" scripts/recipe-multi30k-distill.sh en-de "$@"
