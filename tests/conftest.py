"""Shared fixtures. Tests never download: real-data tests read a local Multi30k copy
(data/multi30k, filled by .ci/run, or ../shared/corpora/multi30k) and skip without one."""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = [ROOT / "data" / "multi30k", ROOT.parent / "shared" / "corpora" / "multi30k"]


# Tests of device-dependent code take `device` from DEVICES: the CPU always, a CUDA GPU where one is
# visible. The CUDA cases carry the `gpu` mark, so on a machine with a GPU `pytest -m gpu` runs just them.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                reason="needs a CUDA GPU")]),
]


def pytest_configure(config):
    # Two cores on CI: keep the processes tests start (the CLI, torchrun) from oversubscribing them;
    # this process's torch has read the variable already.
    os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    for path in CANDIDATES:
        if (path / "train.de").is_file():
            return path
    pytest.skip("no local Multi30k copy (data/multi30k or ../shared/corpora/multi30k)")


def write_slice(src_dir: Path, out_dir: Path, sizes: dict[str, int]) -> Path:
    """Copy the first N lines of each split (both sides) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, n in sizes.items():
        for lang in ("de", "en"):
            with open(src_dir / f"{split}.{lang}", encoding="utf-8") as handle:
                lines = [next(handle) for _ in range(n)]
            (out_dir / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    return out_dir


@pytest.fixture(scope="session")
def multi30k_slice(multi30k_dir, tmp_path_factory) -> Path:
    """2000 training pairs, 100 validation and 100 test pairs of real Multi30k."""
    out = tmp_path_factory.mktemp("multi30k-slice")
    return write_slice(multi30k_dir, out, {"train": 2000, "valid": 100, "test2016": 100})


@pytest.fixture(scope="session")
def tokenized_slice(multi30k_slice, tmp_path_factory) -> Path:
    """`mtrain tokenize` output for multi30k_slice (joint unigram, vocab 1000): spm.model, ids, stats.

    Open it with mtrain.data.TokenizedData(path): .split("train" | "valid" | "test2016"), .tokenizer, .stats.
    """
    from mtrain.config import load_config
    from mtrain.prepare import tokenize_corpus

    out = tmp_path_factory.mktemp("multi30k-tok")
    cfg = load_config(None, ["tokenizer.vocab_size=1000"])
    tokenize_corpus(cfg, data_dir=multi30k_slice, out_dir=out, splits=["train", "valid", "test2016"])
    return out


# ---------------------------------------------------------------- seams into the training loop

@pytest.fixture
def stop_at_step(monkeypatch):
    """stop_at_step(n): a real SIGINT reaches the trainer at the end of update n, as Ctrl-C would
    (the loop's own handler takes it: save last.pt, stop); stop_at_step(None) disarms it."""
    from mtrain.trainer import Trainer

    original = Trainer.train_step

    def arm(step: int | None) -> None:
        def train_step(self):
            stats = original(self)
            if stats is not None and self.state.step == step:
                signal.raise_signal(signal.SIGINT)  # the Python handler runs before this returns
            return stats

        monkeypatch.setattr(Trainer, "train_step", original if step is None else train_step)

    return arm


@pytest.fixture
def nan_losses(monkeypatch):
    """nan_losses(attempts): the summed loss of these update attempts (counted from 1 in this
    process, skipped updates included) comes back NaN, as an overflow would make it."""
    from mtrain import trainer

    original = trainer.forward_backward

    def arm(attempts) -> None:
        calls, attempts = itertools.count(1), set(attempts)

        def forward_backward(*args, **kwargs):
            loss_sum, nll_sum = original(*args, **kwargs)
            return (float("nan"), nll_sum) if next(calls) in attempts else (loss_sum, nll_sum)

        monkeypatch.setattr(trainer, "forward_backward", forward_backward)

    return arm


def pytest_collection_modifyitems(config, items):
    """With MTRAIN_CPU_FAST=0 the suite runs the paper's model on PyTorch's ops alone; the tests of
    the fast paths themselves then have nothing to test and skip."""
    from mtrain import cpu

    if cpu.fast():
        return
    skip = pytest.mark.skip(reason=f"tests a CPU fast path, which {cpu.FAST_ENV}=0 turns off")
    for item in items:
        if "fast_paths" in item.keywords:
            item.add_marker(skip)
