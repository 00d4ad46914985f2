#!/usr/bin/env bash
# What only a CUDA GPU can check, in one command on a machine that has one:
#   scripts/gpu_check.sh [OUT]          (default OUT: gpu-check/, git-ignored)
# writes
#   OUT/gpu.txt         the GPU torch sees (name, memory, compute capability), and nvidia-smi
#   OUT/pytest-gpu.txt  the gpu-marked tests: tests/test_gpu.py (the precision train.amp=auto picks,
#                       batches from pinned memory, stop and resume, a real out-of-memory error mid-run,
#                       train.max_tokens=auto under a memory cap) and the cuda cases of the property
#                       tests (causality, padding, cached == uncached decoding, beam 1 == greedy, the
#                       fused loss against the plain one)
#   OUT/gpu_step.json   benchmarks/gpu_step.py at the paper's base shape: target tokens/s and peak
#                       memory by token budget, mtrain against torch.nn.Transformer in the same
#                       precision, and the budget train.max_tokens=auto picks on this GPU
#   OUT/gpu_step_compile.json  the same at budgets 4096 and 25000 with mtrain under torch.compile
#                       (train.compile) beside them: whether fused kernels lift the small batches'
#                       launch-bound steps (a separate run, so a compile failure keeps gpu_step.json)
#   OUT/train_base.jsonl  `mtrain train` itself at the base shape (configs/transformer-base.yaml) on
#                       Multi30k de-en: 200 updates at train.max_tokens=25000 (the paper's batch),
#                       then 200 at train.max_tokens=auto, validating only after the last; their train
#                       records (tokens_per_s over the updates, peak_memory_gib), each tagged with
#                       the budget it ran at
#   OUT/train_base.log  those runs' stderr: the probe's measurements, the precision, the budget
# It runs the python on PATH as it is (its torch must be a CUDA build, with mtrain's dependencies; a
# checkout that is not installed is imported from here). The tests that train read Multi30k from
# data/multi30k (scripts/multi30k_data.sh fills it) and skip without it. Exit status 1 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python - > "$OUT/gpu.txt" <<'PY' || { cat "$OUT/gpu.txt"; exit 1; }
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"no CUDA GPU visible to torch {torch.__version__}: run this where one is")
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
nvidia-smi >> "$OUT/gpu.txt" 2>&1 || true
head -n 1 "$OUT/gpu.txt"
rc=0
python -m pytest -q -rs -m gpu 2>&1 | tee "$OUT/pytest-gpu.txt" || rc=1
python benchmarks/gpu_step.py --json > "$OUT/gpu_step.json" || rc=1
python benchmarks/gpu_step.py --json --compile --no-probe --budgets 4096 25000 > "$OUT/gpu_step_compile.json" || rc=1
if [ -f data/multi30k/train.de ]; then
    TOK=$(mktemp -d)  # the de-en recipe's 8k joint vocabulary and the two runs (checkpoints with Adam's moments)
    trap 'rm -rf "$TOK"' EXIT
    python -m mtrain tokenize --config configs/multi30k-de-en.yaml --data data/multi30k --src de --tgt en \
        --out "$TOK" > "$OUT/train_base.log" 2>&1 || rc=1
    : > "$OUT/train_base.jsonl"
    for budget in 25000 auto; do
        python -m mtrain train --config configs/transformer-base.yaml --data "$TOK" --out "$TOK/run-$budget" \
            --device cuda --set train.max_tokens=$budget --set train.max_steps=200 --set train.log_every=50 \
            --set train.eval_every=100000 --set train.save_every=100000 >> "$OUT/train_base.log" 2>&1 || rc=1
        python - "$TOK/run-$budget/metrics.jsonl" "$budget" >> "$OUT/train_base.jsonl" <<'PY' || rc=1
import json, sys
from mtrain.plot import read_metrics  # skips a torn last line (a run killed mid-write)
for record in read_metrics(sys.argv[1]):
    if record.get("event") == "train":
        print(json.dumps({"max_tokens": sys.argv[2], **record}))
PY
        tail -n 1 "$OUT/train_base.jsonl" >&2
    done
else
    echo "no data/multi30k (scripts/multi30k_data.sh fills it): mtrain train's own base-shape runs skipped" >&2
fi
echo "results in $OUT/" >&2
exit $rc
