"""Everything exact resume restores besides the model and optimizer: the loop's own state
(`TrainState`: step, data position, early stopping, the open log window) and every RNG the
loop may touch, as plain data that torch.load(weights_only=True) accepts."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def rng_state(device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """Every RNG the loop may touch, as plain data that torch.load(weights_only=True) accepts:
    Python's, numpy's, torch's CPU generator and, training on a GPU, that GPU's generator (only
    the one this process trains on, so a resume where other GPUs are visible still restores it)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(device)] if device.type == "cuda" else [],
    }


def set_rng_state(state: dict[str, Any], device: torch.device = torch.device("cpu")) -> str | None:
    """Restore rng_state(device); a note (None when all was restored) where the saved state cannot
    decide this device's masks: a checkpoint from a CPU run resumed on a GPU or the reverse, or one
    that saved every GPU's generator (older checkpoints) while another number of GPUs is visible now."""
    random.setstate(_as_tuple(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    saved = state["cuda"]
    if device.type != "cuda":
        # The CPU generator is restored, but on the GPU the masks came from the GPU's generator.
        return "the checkpoint was written by a run on a GPU, whose generator drew the dropout masks" if saved else None
    if len(saved) == 1:
        torch.cuda.set_rng_state(saved[0], device)
        return None
    if saved and len(saved) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(saved)
        return None
    if not saved:
        return "the checkpoint was written by a run on a CPU, which kept no GPU generator"
    return (f"the checkpoint holds the generators of {len(saved)} GPUs and {torch.cuda.device_count()} are "
            f"visible now, so which one drove the dropout on {device} is unknown")


def _as_tuple(value: Any) -> Any:
    # random.setstate wants nested tuples; a checkpoint round trip may hand back lists.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def empty_window() -> dict[str, float]:
    """Sums over the updates since the last train log line; seconds = time inside those updates."""
    return {"loss": 0.0, "nll": 0.0, "tokens": 0, "steps": 0, "seconds": 0.0}


@dataclass
class TrainState:
    step: int = 0  # optimizer updates done
    epoch: int = 1  # position in the batch stream: epoch and next batch index
    batch_index: int = 0
    best_bleu: float = -1.0
    best_step: int = 0
    bad_evals: int = 0  # validations since the last BLEU gain (early stopping)
    last_eval_step: int = 0
    nonfinite_run: int = 0  # consecutive skipped updates
    nonfinite_total: int = 0
    finished: str = ""  # why the last run ended ("max_steps", "max_time", "early_stopping") once finish() saved
    # Training wall time over every invocation, up to the end of the last update and its
    # validation (start-up and saving not counted): what train.max_time's schedule and stop read.
    train_seconds: float = 0.0
    # Sums since the last train log line; in the checkpoint so a resumed run logs the same numbers.
    # "seconds" is time inside updates only, so tokens/s skips validation, saving and the restart gap.
    window: dict[str, float] = field(default_factory=empty_window)

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> "TrainState":
        """The state as last.pt stored it; windows saved before a key existed get it at zero."""
        return cls(**{**saved, "window": {**empty_window(), **saved.get("window", {})}})
