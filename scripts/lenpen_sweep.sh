#!/usr/bin/env bash
# Choose the length penalty on the VALID split (never on test): decode valid with beam 5 at each
# penalty and print one JSON line per penalty with cased sacreBLEU and, when the Multi30k tokenized
# references are found, lowercased tokenized BLEU (the papers' metric) and its brevity penalty.
#   scripts/lenpen_sweep.sh CHECKPOINT TOKENIZED_DIR TGT_LANG [LENPEN ...]   (default: 0.6 1.0 1.5 2.0)
#   e.g. scripts/lenpen_sweep.sh runs/multi30k-en-de/averaged.pt data/multi30k-tok-en-de de
# CHECKPOINT may be a comma-separated list (A.pt,B.pt): they decode as an ensemble.
# Hypotheses and scores go to <first checkpoint's folder>/lenpen-sweep/, or to $SWEEP_OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { sed -n 2,9p "$0" >&2; exit 2; }
CKPT=$1 TOK=$2 TGT=$3; shift 3
LENPENS=("$@"); [ ${#LENPENS[@]} -gt 0 ] || LENPENS=(0.6 1.0 1.5 2.0)
CKPT_ARGS=()
IFS=, read -ra CKPTS <<< "$CKPT"
for c in "${CKPTS[@]}"; do CKPT_ARGS+=(--checkpoint "$c"); done
OUT=${SWEEP_OUT:-"$(dirname "${CKPTS[0]}")/lenpen-sweep"}; mkdir -p "$OUT"
. scripts/tok_bleu.sh
TOKREF=$(find_tokref valid "$TGT")
for lp in "${LENPENS[@]}"; do
    mtrain eval "${CKPT_ARGS[@]}" --src "$TOK/valid.src.txt" --ref "$TOK/valid.tgt.txt" --beam 5 \
        --lenpen "$lp" --output-hyp "$OUT/valid.lp$lp.hyp" --json > "$OUT/valid.lp$lp.json"
    tok_json=none
    if [ -n "$TOKREF" ]; then
        tok_json="$OUT/valid.lp$lp.tok.json"
        tok_bleu "$OUT/valid.lp$lp.hyp" "$TOKREF" "$TGT" "$OUT/valid.lp$lp.tok" "$tok_json"
    fi
    python - "$lp" "$OUT/valid.lp$lp.json" "$tok_json" <<'PY'
import json, sys
lenpen, cased, tok = sys.argv[1:]
row = {"lenpen": float(lenpen), "bleu": round(json.load(open(cased))["bleu"], 2)}
if tok != "none":
    tok = json.load(open(tok))
    row.update(tok_bleu=round(tok["bleu"], 2), tok_bp=round(tok["bleu_bp"], 3))
print(json.dumps(row))
PY
done
