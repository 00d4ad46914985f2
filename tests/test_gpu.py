"""Training on a CUDA GPU, checked with the GPU's own precision, copies and memory, where the CPU
tests use fakes and injected errors: the precision `train.amp=auto` resolves, batches copied from
page-locked memory, a stop and resume, a real out-of-memory error mid-run, and
`train.max_tokens=auto` under a memory cap. Skipped without a GPU; `pytest -m gpu` runs these
and the `cuda` cases of the property tests (scripts/gpu_check.sh runs them with the GPU benchmark)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from mtrain import checkpoint, probe
from mtrain.cli import app
from mtrain.config import load_config
from mtrain.train import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GiB = 2 ** 30
TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "train.max_tokens=512", "train.warmup_steps=10", "train.log_every=1",
        "train.max_steps=10", "train.save_every=4", "train.eval_every=5", "train.eval_max_sentences=2"]


def steady_precision() -> str:
    """bfloat16 where the GPU has it (compute capability 8 on), float32 below: float16's loss scaler
    skips updates early in a run, which would shift the update counts these tests check."""
    return "train.amp=" + ("bf16" if torch.cuda.get_device_capability()[0] >= 8 else "off")


def run(data, out, *extra: str) -> dict:
    return train(load_config(None, TINY + [steady_precision(), *extra]), data, out, device="cuda")


def train_records(run_dir) -> list[dict]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r.get("event") == "train"]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_records(run_dir)}


def test_auto_precision_is_bfloat16_from_compute_capability_8(tokenized_slice):
    summary = train(load_config(None, TINY), tokenized_slice, None, device="cuda", dry_run=True)
    major, _ = torch.cuda.get_device_capability()
    assert summary["device"].startswith("cuda")
    assert summary["precision"] == ("bfloat16" if major >= 8 else "float16")


def test_batches_come_from_pinned_memory_and_a_stopped_run_resumes(tokenized_slice, tmp_path, stop_at_step,
                                                                   monkeypatch):
    """Every micro-batch reaches the GPU from page-locked memory (the prefetch thread pins it, so
    the copy does not block). A run stopped by SIGINT after update 6 and resumed takes the same
    batches and logs the same losses as one never stopped, to rounding: GPU kernels are not
    guaranteed to add in the same order twice. Each train record carries the window's peak memory."""
    import mtrain.trainer

    pinned, original = [], mtrain.trainer.to_device

    def to_device(tensors, device):
        pinned.extend(t.is_pinned() for t in tensors)
        return original(tensors, device)

    monkeypatch.setattr(mtrain.trainer, "to_device", to_device)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert run(tokenized_slice, whole)["step"] == 10
    assert len(pinned) == 30 and all(pinned)  # 10 updates x (source, target in, target out)
    stop_at_step(6)
    assert run(tokenized_slice, cut)["stopped"] == "interrupted"
    stop_at_step(None)
    assert run(tokenized_slice, cut)["step"] == 10
    peaks = [r["peak_memory_gib"] for r in train_records(whole)]
    assert len(peaks) == 10 and all(0 < p < torch.cuda.get_device_properties(0).total_memory / GiB for p in peaks)
    a, b = losses(whole), losses(cut)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    assert [b[s] for s in a] == pytest.approx([a[s] for s in a], rel=1e-3)
    state_a, state_b = (checkpoint.load(d / "last.pt")["train_state"]["state"] for d in (whole, cut))
    assert (state_a["epoch"], state_a["batch_index"]) == (state_b["epoch"], state_b["batch_index"])


def test_a_real_out_of_memory_mid_run_is_one_line_and_the_run_resumes(tokenized_slice, tmp_path, monkeypatch):
    """Update 5 asks CUDA's allocator for twice the GPU's memory: PyTorch's own OutOfMemoryError.
    The run ends with the one line (step, batch shape, a smaller budget), last.pt from update 4 is
    intact, and the same command then trains to the end."""
    from mtrain import trainer

    original, calls = trainer.forward_backward, []

    def forward_backward(objective, micro, *args, **kwargs):
        calls.append(micro)
        if len(calls) == 5:
            torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")
        return original(objective, micro, *args, **kwargs)

    out = tmp_path / "run"
    args = ["train", "--data", str(tokenized_slice), "--out", str(out), "--device", "cuda"]
    for item in TINY + [steady_precision(), "train.max_steps=8", "train.save_every=2"]:
        args += ["--set", item]
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "forward_backward", forward_backward)
        stopped = CliRunner().invoke(app, args)
    assert stopped.exit_code == 1 and "Traceback" not in stopped.output
    last = stopped.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: step 5: out of cuda(:0)? memory in a batch of \d+ x \d+ source / \d+ x \d+ target "
                        rf"tokens \(train.max_tokens=512\); {re.escape(str(out / 'last.pt'))} is intact, and re-running "
                        r"the same command with --set train.max_tokens=384 resumes from it", last), last
    assert checkpoint.load(out / "last.pt")["step"] == 4
    resumed = CliRunner().invoke(app, args)
    assert resumed.exit_code == 0, resumed.output
    assert checkpoint.load(out / "last.pt")["step"] == 8


MEDIUM = ["model.d_model=512", "model.d_ff=2048", "model.n_heads=8", "model.n_encoder_layers=6",
          "model.n_decoder_layers=6", "train.warmup_steps=10", "train.log_every=10", "train.max_steps=30",
          "train.save_every=30", "train.eval_every=1000", "train.eval_max_sentences=2"]


def test_max_tokens_auto_keeps_every_update_under_a_memory_cap(tokenized_slice, tmp_path):
    """The process capped at 3 GiB (torch.cuda.set_per_process_memory_fraction, as a job sharing
    its GPU would be): the probe sizes its search by the cap, not by the GPU, and its budget trains
    30 updates of the base model's shape without running out of memory (the allocator refuses to
    reserve past the cap, so an update that needed more would have failed)."""
    cap = 3 * GiB
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        assert probe.CudaMemory(torch.device("cuda")).capacity() <= cap
        config = load_config(None, MEDIUM + ["train.max_tokens=auto"])
        assert train(config, tokenized_slice, tmp_path / "run", device="cuda")["step"] == 30
        chosen = checkpoint.load(tmp_path / "run" / "last.pt")["config"]["train"]["max_tokens"]
        assert isinstance(chosen, int) and chosen >= 1024
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
