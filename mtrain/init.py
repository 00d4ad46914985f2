"""Start a new run from a trained model: `mtrain train --init-from CKPT`.

Fine-tuning a general model to a domain, continuing a finished run on new data, or adapting an
imported public model (mtrain.hub) all start the same way: the new run takes CKPT's weights and
CKPT's model section, and everything else is its own: a fresh optimizer and learning-rate schedule
(its warmup, lr and max_steps count from step 0), its data, its run folder. Of the model section only
the dropout rates may change (fine-tuning on little data may want more); any other model key set in
the config or by --set that differs from CKPT's is a one-line error, since the weights fit CKPT's
shape alone.

The data must be tokenized with CKPT's SentencePiece model (`mtrain tokenize --spm-from CKPT`): only
then does a token id mean the same piece to the model. A folder tokenized with any other vocabulary,
a larger one with new tags included, is refused before any work, in one line that says how to
re-tokenize. mtrain does not grow the embedding with new rows: the new pieces would start untrained
beside trained ones, and with tied embeddings they would also be output rows the model has never
predicted; a tag the new data needs belongs in the vocabulary the general model is trained with.

Resuming the new run after a kill reads its own last.pt like any run, and CKPT is not read again.
RUN/init_from.json records where the run started: CKPT's path and SHA-256.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from mtrain import checkpoint
from mtrain.atomic import atomic_write
from mtrain.config import Config, replace
from mtrain.errors import MtrainError

DROPOUT_KEYS = ("dropout", "attention_dropout", "activation_dropout")
RECORD = "init_from.json"


@dataclasses.dataclass
class Start:
    """The checkpoint a run starts from."""

    path: Path
    sha256: str
    config: dict[str, Any]  # its stored config
    tokenizer: dict[str, Any]  # its SentencePiece model(s), as Tokenizer.to_state
    weights: dict[str, Any]

    def record(self) -> dict[str, str]:
        return {"path": str(self.path.resolve()), "sha256": self.sha256}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_start(path: Path) -> Start:
    """CKPT's weights, config and tokenizer (checkpoint.load: weights_only, one-line errors)."""
    ckpt = checkpoint.load(path)
    return Start(Path(path), sha256_of(Path(path)), ckpt["config"], ckpt["tokenizer"], ckpt["model"])


def config_for(cfg: Config, start: Start, set_model_keys: dict[str, Any]) -> Config:
    """cfg with CKPT's model section, the dropout rates from cfg where the config or --set gave them.
    set_model_keys: the model keys the config file and --set gave (mtrain.config.set_keys)."""
    stored = start.config.get("model", {})
    ours = dataclasses.asdict(cfg.model)
    for key in set_model_keys:
        if key not in DROPOUT_KEYS and key in stored and stored[key] != ours[key]:
            raise MtrainError(f"--init-from {start.path}: model.{key}={ours[key]!r} differs from the checkpoint's "
                              f"{stored[key]!r}; the model section comes from the checkpoint (only "
                              f"{', '.join('model.' + k for k in DROPOUT_KEYS)} may change): drop model.{key} "
                              "from the config and --set")
    model = {**stored, **{key: ours[key] for key in DROPOUT_KEYS if key in set_model_keys}}
    return replace(cfg, model=model)


def check_vocabulary(start: Start, data_dir: Path, tokenizer_state: dict[str, Any]) -> None:
    """One line, before any work, when data_dir was tokenized with another vocabulary than CKPT's."""
    if tokenizer_state != start.tokenizer:
        raise MtrainError(f"{data_dir}: tokenized with another SentencePiece model than {start.path}; re-tokenize "
                          f"the corpus with the checkpoint's: mtrain tokenize --spm-from {start.path} --data RAW_DIR "
                          f"--out NEW_DIR (then train on NEW_DIR)")


def check_resume(run_dir: Path, start: Start) -> None:
    """A run folder that started from another checkpoint refuses to continue from this one."""
    path = run_dir / RECORD
    if not path.is_file():
        if (run_dir / "last.pt").is_file():
            raise MtrainError(f"{run_dir}: a run that did not start from a checkpoint; resume it without "
                              "--init-from, or pass a new --out folder")
        return
    started = json.loads(path.read_text(encoding="utf-8"))
    if started.get("sha256") != start.sha256:
        raise MtrainError(f"{run_dir}: this run started from {started.get('path')} (SHA-256 "
                          f"{str(started.get('sha256'))[:12]}...), not {start.path}; resume it with that "
                          "checkpoint (or without --init-from), or pass a new --out folder")


def write_record(run_dir: Path, start: Start) -> None:
    with atomic_write(run_dir / RECORD) as handle:
        handle.write(json.dumps(start.record(), indent=2) + "\n")
