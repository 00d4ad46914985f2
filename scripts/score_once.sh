# Scoring a checkpoint on one test set once, shared by recipe-corpus.sh and time-budget-vs-steps.sh.
# Source it from the repository root:  . scripts/score_once.sh

# score_once CKPT SRC REF OUT [mtrain eval options]: OUT.hyp and OUT.json (cased sacreBLEU, chrF,
# TER with signatures), unless OUT.json is newer than CKPT: a checkpoint trained further is scored
# again. OUT.json appears whole or not at all.
score_once() {
    local ckpt=$1 src=$2 ref=$3 out=$4
    shift 4
    [ "$out.json" -nt "$ckpt" ] && return 0
    echo "scoring $ckpt on $src ($*)" >&2
    mtrain eval --checkpoint "$ckpt" --src "$src" --ref "$ref" "$@" --output-hyp "$out.hyp" --json > "$out.json.tmp"
    mv "$out.json.tmp" "$out.json"
}
