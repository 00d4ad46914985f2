"""benchmarks/gpu_step.py, the script that measures training speed and peak memory on a GPU, runs
end to end on a CPU (its --quick check): every budget gets a row for both models, with tokens/s,
and the batches stay within their budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_step_benchmark_runs_on_a_cpu():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--device", "cpu", "--quick",
                           "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["device"], result["shape"], result["max_tokens_auto"]) == ("cpu", "quick", None)
    [row] = result["rows"]
    assert 0 < row["target_tokens_per_batch"] <= row["padded_tokens_per_batch_max"] <= row["max_tokens"] == 512
    for model in ("mtrain", "nn.Transformer"):
        assert row[model]["tok_s"] > 0 and row[model]["peak_allocated_gib"] is None  # no CUDA allocator here
    assert row["mtrain_vs_nn_transformer"] > 0
