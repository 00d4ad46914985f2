#!/usr/bin/env bash
# Choose the length penalty on the VALID split (never on test): decode valid with beam 5 at each
# penalty and print one JSON line per penalty with cased sacreBLEU and, when the Multi30k tokenized
# references are found, lowercased tokenized BLEU (the papers' metric) and its brevity penalty.
#   scripts/lenpen_sweep.sh CHECKPOINT TOKENIZED_DIR TGT_LANG [LENPEN ...]   (default: 0.6 1.0 1.5 2.0)
#   e.g. scripts/lenpen_sweep.sh runs/multi30k-en-de/averaged.pt data/multi30k-tok-en-de de
# Hypotheses and scores go to <checkpoint folder>/lenpen-sweep/.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { sed -n 2,7p "$0" >&2; exit 2; }
CKPT=$1 TOK=$2 TGT=$3; shift 3
LENPENS=("$@"); [ ${#LENPENS[@]} -gt 0 ] || LENPENS=(0.6 1.0 1.5 2.0)
OUT="$(dirname "$CKPT")/lenpen-sweep"; mkdir -p "$OUT"
. scripts/tok_bleu.sh
TOKREF=$(find_tokref valid "$TGT")
for lp in "${LENPENS[@]}"; do
    mtrain eval --checkpoint "$CKPT" --src "$TOK/valid.src.txt" --ref "$TOK/valid.tgt.txt" --beam 5 \
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
