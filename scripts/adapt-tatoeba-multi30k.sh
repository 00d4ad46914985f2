#!/usr/bin/env bash
# Domain adaptation, end to end: a general de->en model trained on Tatoeba, fine-tuned on Multi30k
# captions (train --init-from), against a Multi30k model trained from scratch for the same number of
# updates of the same size, each scored once on test2016, the Tatoeba test, FLORES-200 devtest and
# newstest2014 (the last three show how much of the general model fine-tuning keeps).
#   scripts/adapt-tatoeba-multi30k.sh [step ...]   steps: data pretrain finetune scratch score (default: all)
# Data: data/tatoeba-de-en/ (copy ../shared/corpora/tatoeba-de-en there) and data/multi30k/.
# FT_LR (default 0.32) and FT_STEPS (default 1000) set the fine-tuning's train.lr_scale and length;
# choose them on the Multi30k valid BLEU the runs log (runs/adapt-ft*/metrics.jsonl), never on a test.
# With 100 warmup steps the inverse-sqrt peak is lr_scale * 256^-0.5 * 100^-0.5: 0.16 gives 1.0e-3,
# the pretraining's own peak (0.5 * 256^-0.5 * 1000^-0.5); 0.32 gave valid BLEU 34.31 against 32.75
# for 0.16 (docs/adapt.md).
# Every step resumes where it stopped; a finished one is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh ''
STEPS=${*:-data pretrain finetune scratch score}
PRE_STEPS=${PRE_STEPS:-3600}
FT_STEPS=${FT_STEPS:-1000}
FT_LR=${FT_LR:-0.32}
CONFIG=configs/multi30k-de-en.yaml  # the model and batch size of all three runs
PRE=runs/adapt-tatoeba FT=runs/adapt-ft-lr$FT_LR SCRATCH=runs/adapt-scratch
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has data; then
    # Tatoeba: evaluation pairs also found in training are dropped from it (657 valid, 5084 test).
    [ -f data/tatoeba-tok/meta.json ] || mtrain tokenize --config $CONFIG --data data/tatoeba-de-en --src de --tgt en \
        --splits train,valid,test,flores200-devtest,newstest2014 --drop-overlap --out data/tatoeba-tok
    # Multi30k in the general model's vocabulary (for fine-tuning), and in its own (from scratch).
    [ -f data/multi30k-tok-tatoeba-spm/meta.json ] || mtrain tokenize --config $CONFIG --data data/multi30k \
        --src de --tgt en --spm-from data/tatoeba-tok --out data/multi30k-tok-tatoeba-spm
    [ -f data/multi30k-tok-de-en/meta.json ] || mtrain tokenize --config $CONFIG --data data/multi30k \
        --src de --tgt en --out data/multi30k-tok-de-en
fi
# One schedule shape for all: warmup, then the lr cooled down to ~0 over the last third.
schedule() { echo --set train.max_steps=$1 --set train.cooldown_steps=$(($1 / 3)) --set train.save_every=$2 \
    --set train.eval_every=$2 --set train.keep_every=0 --set train.average_last=4; }
if has pretrain; then
    mtrain train --config $CONFIG --data data/tatoeba-tok --out $PRE $(schedule $PRE_STEPS 300) \
        --set train.cooldown_steps=1200 --set train.eval_every=600
fi
if has finetune; then
    mtrain train --config $CONFIG --data data/multi30k-tok-tatoeba-spm --out $FT --init-from $PRE/averaged.pt \
        $(schedule $FT_STEPS 125) --set train.warmup_steps=100 --set train.lr_scale=$FT_LR
fi
if has scratch; then  # the updates of pretraining and fine-tuning together
    mtrain train --config $CONFIG --data data/multi30k-tok-de-en --out $SCRATCH $(schedule $((PRE_STEPS + FT_STEPS)) 250)
fi
if has score; then
    for run in $PRE $FT $SCRATCH; do
        for test in multi30k:data/multi30k-tok-de-en/test2016 tatoeba:data/tatoeba-tok/test \
                    flores:data/tatoeba-tok/flores200-devtest news:data/tatoeba-tok/newstest2014; do
            name=${test%%:*} base=${test#*:}
            [ -f "$run/$name.json" ] || mtrain eval --checkpoint "$run/averaged.pt" --src "$base.src.txt" \
                --ref "$base.tgt.txt" --output-hyp "$run/$name.hyp" --json > "$run/$name.json"
        done
    done
    python - "$PRE" "$FT" "$SCRATCH" <<'EOF'
import json, sys
from pathlib import Path
print("| model | test2016 | Tatoeba test | FLORES-200 | newstest2014 |")
print("|---|---|---|---|---|")
for run in sys.argv[1:]:
    scores = [json.loads((Path(run) / f"{n}.json").read_text()) for n in ("multi30k", "tatoeba", "flores", "news")]
    print(f"| {run} | " + " | ".join(f"{s['bleu']:.2f} / {s['chrf']:.2f}" for s in scores) + " |")
EOF
fi
