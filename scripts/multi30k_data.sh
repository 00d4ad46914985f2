# Where the Multi30k corpus comes from; shared by quickstart.sh, recipe-multi30k.sh and .ci/run.
# Source it from the repository root:  . scripts/multi30k_data.sh
# A checkout that sits beside a shared corpus folder (as on CI) copies it into data/multi30k/, which
# is git-ignored because the corpus's terms (research and education only) forbid committing it.
# Sets source_args to the `mtrain tokenize` options: the local copy if there is one, else the
# Hugging Face dataset (which needs internet).
MULTI30K_SHARED=../shared/corpora/multi30k
if [ ! -f data/multi30k/train.de ] && [ -f "$MULTI30K_SHARED/train.de" ]; then
    mkdir -p data/multi30k
    cp "$MULTI30K_SHARED"/*.de "$MULTI30K_SHARED"/*.en data/multi30k/
fi
if [ -f data/multi30k/train.de ]; then
    source_args=(--data data/multi30k)
else
    source_args=(--hf-dataset bentrevett/multi30k)
fi
