"""The training report: RUN/metrics.jsonl (one JSON object per log or validation event) and a
PNG of train/valid loss, validation BLEU and learning rate against step (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mtrain.atomic import atomic_write

# Fields of metrics.jsonl records measured on the machine rather than computed by the run (wall
# clock; on a GPU the allocator's peak, which a resumed window's checkpoint load adds to): the only
# ones that differ between two identical runs.
TIME_FIELDS = frozenset({"tokens_per_s", "elapsed_s", "train_s", "valid_s", "peak_memory_gib"})


class MetricsLog:
    """Append-only JSON-lines log. On resume, events after the resumed step are dropped: they came
    from the part of a killed run that is about to be redone, and would otherwise appear twice.

    A validation record at the resumed step itself is dropped too when the resumed state had not
    validated there yet (last_eval_step): it was logged after that last.pt, and is redone.

    A failed append (a full disk) raises OSError and may leave a torn last line; the loop stops
    before the next last.pt, so the record's step is past the one a resume starts from, and the
    resumed run's rewrite drops it (read_metrics skips a torn line anyway)."""

    def __init__(self, path: str | Path, resume_step: int | None = None, last_eval_step: int | None = None) -> None:
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []
        if resume_step is not None and self.path.is_file():
            valid_until = resume_step if last_eval_step is None else min(resume_step, last_eval_step)
            self.records = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step
                            and not (r.get("event") == "valid" and r.get("step", 0) > valid_until)]
        self._rewrite()

    def _rewrite(self) -> None:
        with atomic_write(self.path) as handle:
            for record in self.records:
                handle.write(json.dumps(record) + "\n")

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Parse metrics.jsonl, skipping a torn last line left by a hard kill."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _series(records: list[dict[str, Any]], event: str, key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records
              if r.get("event") == event and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def plot_metrics(records: list[dict[str, Any]], out: str | Path) -> None:
    """Three panels sharing the step axis, written atomically."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe in headless runs
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bleu, ax_lr) = plt.subplots(3, 1, figsize=(7, 9), sharex=True)
    for event, label in (("train", "train loss"), ("valid", "valid loss")):
        steps, values = _series(records, event, "loss")
        ax_loss.plot(steps, values, marker="o" if event == "valid" else None, ms=3, label=label)
    ax_loss.set_ylabel("label-smoothed loss / token")
    ax_loss.legend()
    steps, values = _series(records, "valid", "bleu")
    ax_bleu.plot(steps, values, marker="o", ms=3, color="tab:green")
    ax_bleu.set_ylabel("valid BLEU")
    steps, values = _series(records, "train", "lr")
    ax_lr.plot(steps, values, color="tab:red")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    for ax in (ax_loss, ax_bleu, ax_lr):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_write(out, binary=True) as handle:
            fig.savefig(handle, format="png", dpi=100)
    finally:
        plt.close(fig)
