"""Shared fixtures. Tests never download: real-data tests read a local Multi30k copy
(data/multi30k, filled by .ci/run, or ../shared/corpora/multi30k) and skip without one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = [ROOT / "data" / "multi30k", ROOT.parent / "shared" / "corpora" / "multi30k"]


def pytest_configure(config):
    # Two cores on CI: keep torch from oversubscribing them when tests run.
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

    Load it with mtrain.data.load_split(path, "train" | "valid" | "test2016") / load_tokenizer(path).
    """
    from mtrain.config import load_config
    from mtrain.data import tokenize_corpus

    out = tmp_path_factory.mktemp("multi30k-tok")
    cfg = load_config(None, ["tokenizer.vocab_size=1000"])
    tokenize_corpus(cfg, data_dir=multi30k_slice, out_dir=out, splits=["train", "valid", "test2016"])
    return out
