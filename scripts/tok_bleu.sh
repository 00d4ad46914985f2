# Lowercased Moses-tokenized BLEU (the papers' Multi30k metric), shared by recipe-multi30k.sh and
# lenpen_sweep.sh. Source it from the repository root:  . scripts/tok_bleu.sh

# find_tokref SPLIT LANG: print the path of Multi30k's tok/SPLIT.lc.norm.tok.LANG (the local copy
# under data/multi30k/tok first, then the shared corpus beside the checkout); print nothing if absent.
find_tokref() {
    local dir
    for dir in data/multi30k/tok ../shared/corpora/multi30k/tok; do
        if [ -f "$dir/$1.lc.norm.tok.$2" ]; then echo "$dir/$1.lc.norm.tok.$2"; return; fi
    done
}

# tok_bleu HYP TOKREF LANG TOK_OUT JSON_OUT: lowercase + Moses-tokenize the detokenized hypotheses
# HYP the way the references were made (into TOK_OUT), then score them against TOKREF with no further
# tokenization (the JSON of `mtrain eval --json` into JSON_OUT). Under MULTI30K_TEXT=lc-tok the model was trained
# on the tokenized files and already writes that form; tokenizing again would escape its "&apos;" twice.
tok_bleu() {
    if [ "${MULTI30K_TEXT:-raw}" = lc-tok ]; then
        cp "$1" "$4"
    else
        python scripts/eval_tok.py --lang "$3" --input "$1" --output "$4"
    fi
    mtrain eval --hyp "$4" --ref "$2" --lowercase --tokenize none --json > "$5"
}
