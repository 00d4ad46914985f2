# Where the Multi30k corpus comes from; shared by quickstart.sh, recipe-multi30k.sh and .ci/run.
# Source it from the repository root:  . scripts/multi30k_data.sh
# A checkout that sits beside a shared corpus folder (as on CI) copies it into data/multi30k/, which
# is git-ignored because the corpus's terms (research and education only) forbid committing it.
# Sets source_args to the `mtrain tokenize` options: the local copy if there is one, else the
# Hugging Face dataset (which needs internet).
# MULTI30K_TEXT=lc-tok picks the Multi30k repo's own lowercased, Moses-tokenized files instead
# (tok/*.lc.norm.tok.*: the form papers reporting tokenized BLEU usually train on), copied under the
# split names mtrain reads into data/multi30k-lctok/. The Hub dataset has no such files: without a tok/
# folder they are made from the local raw copy with scripts/eval_tok.py (sacremoses), which gives
# test2016 and valid.en line for line and differs on 9 of the other 59k lines (a closing quote placed
# before or after the full stop; one trailing space).
MULTI30K_SHARED=../shared/corpora/multi30k
if [ ! -f data/multi30k/train.de ] && [ -f "$MULTI30K_SHARED/train.de" ]; then
    mkdir -p data/multi30k
    cp "$MULTI30K_SHARED"/*.de "$MULTI30K_SHARED"/*.en data/multi30k/
fi
if [ "${MULTI30K_TEXT:-raw}" = lc-tok ]; then
    if [ ! -f data/multi30k-lctok/test2016.en ]; then  # written last: its presence means the folder is complete
        . scripts/tok_bleu.sh  # find_tokref: the one place that knows where tok/ lives
        lctok_train=$(find_tokref train de)
        if [ -z "$lctok_train" ] && [ ! -f data/multi30k/train.de ]; then
            echo "MULTI30K_TEXT=lc-tok: neither tok/train.lc.norm.tok.de (in data/multi30k/tok or $MULTI30K_SHARED/tok) nor data/multi30k/train.de to make it from; copy data/task1/tok/ of github.com/multi30k/dataset to data/multi30k/tok, or use MULTI30K_TEXT=raw" >&2
            return 2
        fi
        [ -n "$lctok_train" ] || echo "MULTI30K_TEXT=lc-tok: no tok/ folder; making data/multi30k-lctok from data/multi30k with scripts/eval_tok.py (the Multi30k repo's lowercase + normalize + tokenize)" >&2
        lctok_from=$(dirname "${lctok_train:-.}")
        mkdir -p data/multi30k-lctok
        for split in train valid test2016; do
            for lang in de en; do
                out=data/multi30k-lctok/$split.$lang
                if [ -n "$lctok_train" ]; then
                    cp "$lctok_from/$split.lc.norm.tok.$lang" "$out.tmp"
                else
                    python scripts/eval_tok.py --lang $lang --input data/multi30k/$split.$lang --output "$out.tmp"
                fi
                mv "$out.tmp" "$out"
            done
        done
    fi
    source_args=(--data data/multi30k-lctok)
elif [ -f data/multi30k/train.de ]; then
    source_args=(--data data/multi30k)
else
    source_args=(--hf-dataset bentrevett/multi30k)
fi
